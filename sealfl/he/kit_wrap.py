"""Wrap a secret to a key holder's P-256 public key (ECIES-style, HPKE base-mode shape).

Used to ship the HE secret context inside a partner's startup kit: only the partner's
private key unwraps it.

Construction (RFC 9180 HPKE base mode shape, built from pycryptodome primitives):
ephemeral P-256 ECDH (``Crypto.Protocol.DH.key_agreement``) -> HKDF-SHA256 (RFC 5869)
with info ``b"sealfl keywrap v1"`` and salt = ephemeral public key (SEC1 uncompressed)
|| recipient public key -> 32-byte AES-256-GCM key; 12-byte random nonce; the
``label`` (e.g. ``b"ckks-secret-context"``) is authenticated as associated data.

Blob layout: 65 B ephemeral public key | 12 B nonce | 16 B tag | ciphertext.
"""

from __future__ import annotations

from Crypto.Cipher import AES
from Crypto.Hash import SHA256
from Crypto.Protocol.DH import key_agreement
from Crypto.Protocol.KDF import HKDF
from Crypto.PublicKey import ECC
from Crypto.Random import get_random_bytes

from sealfl.he.errors import KeyWrapError

INFO = b"sealfl keywrap v1"




def _sec1(key: ECC.EccKey) -> bytes:
    return key.public_key().export_key(format="SEC1")


def _derive(shared_z: bytes, salt: bytes) -> bytes:
    return HKDF(shared_z, 32, salt, SHA256, context=INFO)


def wrap(secret: bytes, recipient_public: ECC.EccKey, label: bytes) -> bytes:
    """Encrypt ``secret`` (bytes) to ``recipient_public`` (P-256). Returns the blob."""
    eph = ECC.generate(curve="P-256")
    salt = _sec1(eph) + _sec1(recipient_public)
    key = key_agreement(static_priv=eph, static_pub=recipient_public, kdf=lambda z: _derive(z, salt))
    nonce = get_random_bytes(12)
    cipher = AES.new(key, AES.MODE_GCM, nonce=nonce)
    cipher.update(label)
    ct, tag = cipher.encrypt_and_digest(secret)
    return _sec1(eph) + nonce + tag + ct


def unwrap(blob: bytes, recipient_private: ECC.EccKey, label: bytes) -> bytes:
    """Decrypt a :func:`wrap` blob. Raises KeyWrapError if it does not authenticate."""
    if len(blob) < 65 + 12 + 16:
        raise KeyWrapError("wrapped secret is truncated")
    try:
        eph_pub = ECC.import_key(blob[:65], curve_name="P-256")
    except ValueError as exc:
        raise KeyWrapError(f"wrapped secret has an invalid ephemeral key: {exc}") from exc
    salt = blob[:65] + _sec1(recipient_private)
    key = key_agreement(static_priv=recipient_private, static_pub=eph_pub, kdf=lambda z: _derive(z, salt))
    nonce, tag, ct = blob[65:77], blob[77:93], blob[93:]
    cipher = AES.new(key, AES.MODE_GCM, nonce=nonce)
    cipher.update(label)
    try:
        return cipher.decrypt_and_verify(ct, tag)
    except ValueError as exc:
        raise KeyWrapError(
            "cannot unwrap the secret: it was wrapped to another key, for another purpose, or modified"
        ) from exc
