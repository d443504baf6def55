"""The AES-256-GCM sealed-blob framing both TEE backends share (pure functions over bytes).

Blob::

    MAGIC || u32be(len(header)) || header || nonce(12) || tag(16) || ciphertext

``header`` is canonical JSON chosen by the backend (at least ``alg``, ``bank`` and
``policy``; the TPM backend adds the sealed key object). The GCM additional data is
``MAGIC || u32be(len) || header``, so nothing in the header can be altered without failing
authentication (NIST SP 800-38D; PyCryptodome's ``AES.MODE_GCM``, 12-byte nonce, 16-byte tag).
The backend decides where the 32-byte key comes from: a file (sim) or the TPM (tpm).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from Crypto.Cipher import AES
from Crypto.Random import get_random_bytes

from sealfl.attestation.canonical import canonical_json
from sealfl.enclave.errors import UnsealError

__all__ = ["MAX_HEADER_BYTES", "SealedBlob", "seal_blob", "split_blob", "open_blob"]

#: headers are small (a policy of a few PCRs, a TPM key object of < 1 KB)
MAX_HEADER_BYTES = 8192
_LEN = struct.Struct(">I")
_NONCE, _TAG = 12, 16


@dataclass(frozen=True)
class SealedBlob:
    """A split blob: ``aad`` (magic, length, header), ``header`` bytes (canonical JSON,
    not yet authenticated), ``nonce``, ``tag`` and ``ciphertext``."""

    aad: bytes
    header: bytes
    nonce: bytes
    tag: bytes
    ciphertext: bytes


def seal_blob(magic: bytes, header: dict, key: bytes, data: bytes) -> bytes:
    """Encrypt ``data`` under the 32-byte ``key`` with ``header`` authenticated; returns the blob."""
    head = canonical_json(header)
    aad = magic + _LEN.pack(len(head)) + head
    cipher = AES.new(key, AES.MODE_GCM, nonce=get_random_bytes(_NONCE))
    cipher.update(aad)
    ciphertext, tag = cipher.encrypt_and_digest(bytes(data))
    return aad + cipher.nonce + tag + ciphertext


def split_blob(blob: bytes, magic: bytes, what: str) -> SealedBlob:
    """Split ``blob`` by its framing (nothing is authenticated yet).

    Raises UnsealError naming ``what`` (e.g. "SimTEE sealed blob"): wrong magic, truncated,
    or a header longer than :data:`MAX_HEADER_BYTES`.
    """
    blob = bytes(blob)
    head = len(magic) + _LEN.size
    if len(blob) < head + _NONCE + _TAG or not blob.startswith(magic):
        raise UnsealError(f"not a {what} (bad magic or truncated)")
    (hlen,) = _LEN.unpack_from(blob, len(magic))
    if hlen > MAX_HEADER_BYTES or len(blob) < head + hlen + _NONCE + _TAG:
        raise UnsealError(f"{what} is truncated or its header is oversized")
    end = head + hlen
    return SealedBlob(blob[:end], blob[head:end], blob[end:end + _NONCE], blob[end + _NONCE:end + _NONCE + _TAG],
                      blob[end + _NONCE + _TAG:])


def open_blob(parts: SealedBlob, key: bytes, failure: str) -> bytes:
    """Authenticate and decrypt; returns the data. Raises UnsealError(``failure``) when the
    tag does not verify (the blob was modified, or sealed under another key)."""
    cipher = AES.new(key, AES.MODE_GCM, nonce=parts.nonce)
    cipher.update(parts.aad)
    try:
        return cipher.decrypt_and_verify(parts.ciphertext, parts.tag)
    except ValueError as exc:
        raise UnsealError(failure) from exc
