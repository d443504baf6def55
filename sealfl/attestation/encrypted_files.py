"""Release files encrypted at rest: AES-256-GCM (NIST SP 800-38D) with pycryptodome.

File format::

    MAGIC (b"SEALFL-ATREST/1\\n") || nonce (12 bytes) || tag (16 bytes) || ciphertext

The GCM associated data is ``MAGIC || utf8(name)``, so a ciphertext cannot be moved to
another file name of the release. The release's signed manifest covers the *encrypted*
bytes: a device verifies the release before it has the key, and decrypts only after the
broker released the key to its attested state.
"""

from __future__ import annotations

from Crypto.Cipher import AES
from Crypto.Random import get_random_bytes

from sealfl.attestation.errors import AtRestError

__all__ = ["MAGIC", "KEY_SIZE", "SUFFIX", "new_key", "encrypt", "decrypt", "encrypt_payload"]

MAGIC = b"SEALFL-ATREST/1\n"
KEY_SIZE = 32
#: Name suffix of an encrypted payload file (``model.int8.onnx`` -> ``model.int8.onnx.enc``).
SUFFIX = ".enc"


def new_key() -> bytes:
    """A fresh random 32-byte AES-256 key."""
    return get_random_bytes(KEY_SIZE)


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_SIZE:
        raise AtRestError(f"an at-rest key must be {KEY_SIZE} bytes (AES-256)")
    return bytes(key)


def encrypt(key: bytes, name: str, plaintext: bytes) -> bytes:
    """Encrypt ``plaintext`` of release file ``name`` (format in the module docstring).

    Raises:
        AtRestError: the key is not 32 bytes.
    """
    cipher = AES.new(_check_key(key), AES.MODE_GCM, nonce=get_random_bytes(12))
    cipher.update(MAGIC + name.encode("utf-8"))
    ciphertext, tag = cipher.encrypt_and_digest(bytes(plaintext))
    return MAGIC + cipher.nonce + tag + ciphertext


def decrypt(key: bytes, name: str, blob: bytes) -> bytes:
    """Decrypt an at-rest file of release file ``name``.

    Raises:
        AtRestError: not an at-rest file, or authentication failed (wrong key, other file
            name, or modified bytes).
    """
    blob = bytes(blob)
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 28:
        raise AtRestError(f"release file {name!r} is not an AES-256-GCM at-rest file (bad magic or truncated)")
    nonce, tag = blob[len(MAGIC):len(MAGIC) + 12], blob[len(MAGIC) + 12:len(MAGIC) + 28]
    cipher = AES.new(_check_key(key), AES.MODE_GCM, nonce=nonce)
    cipher.update(MAGIC + name.encode("utf-8"))
    try:
        return cipher.decrypt_and_verify(blob[len(MAGIC) + 28:], tag)
    except ValueError as exc:
        raise AtRestError(f"release file {name!r} does not decrypt with the released key (wrong key, "
                          "renamed or modified file)") from exc


def encrypt_payload(payload: dict[str, bytes], files: list[str], key: bytes | None = None
                    ) -> tuple[dict[str, bytes], bytes, dict]:
    """Publisher side: encrypt ``files`` of ``payload`` under one key, renamed ``<name>.enc``.

    Returns:
        ``(new payload, key, metadata)``: sign the new payload with ``metadata`` merged into
        the release metadata (``{"at_rest": {...}}``; set ``model_file`` to the ``.enc`` name),
        then give the key to the broker for the release's root digest.

    Raises:
        AtRestError: a name is not in ``payload``.
    """
    key = new_key() if key is None else _check_key(key)
    out = dict(payload)
    names = []
    for name in files:
        if name not in out:
            raise AtRestError(f"{name!r} is not a payload file")
        enc = name + SUFFIX
        out[enc] = encrypt(key, enc, out.pop(name))
        names.append(enc)
    return out, key, {"at_rest": {"alg": "AES-256-GCM", "files": names}}
