"""Wrapping a model key to a device's per-request public key: HPKE (RFC 9180) base mode,
DHKEM(P-256, HKDF-SHA256) / HKDF-SHA256 / AES-256-GCM, via ``pyhpke``.

The device creates a fresh key pair for each request (:func:`new_request_key`), binds the
public key into its quote (:func:`binding`), and only it can open what the broker sealed.
``info`` = ``b"sealfl.kbs/v1" || release root digest (32 bytes)`` binds the wrapped key to the
release it is for.
"""

from __future__ import annotations

import hashlib
import os

from pyhpke import AEADId, CipherSuite, KDFId, KEMId

from sealfl.attestation.errors import KeyWrapFormatError

__all__ = ["SUITE", "PUBLIC_KEY_SIZE", "new_request_key", "public_bytes", "binding", "wrap", "unwrap"]

SUITE = CipherSuite.new(KEMId.DHKEM_P256_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES256_GCM)
#: Uncompressed SEC1 P-256 point.
PUBLIC_KEY_SIZE = 65
_INFO = b"sealfl.kbs/v1"


def new_request_key():
    """A fresh HPKE key pair (``.public_key``, ``.private_key``) for one key request."""
    return SUITE.kem.derive_key_pair(os.urandom(32))


def public_bytes(pair) -> bytes:
    """The 65-byte public key of ``pair``."""
    return pair.public_key.to_public_bytes()


def binding(nonce: bytes, public_key: bytes) -> bytes:
    """The quote data of a key request: ``nonce (32) || SHA-256(public key)`` (64 bytes)."""
    return bytes(nonce) + hashlib.sha256(bytes(public_key)).digest()


def wrap(public_key: bytes, release_root: str, key: bytes) -> tuple[bytes, bytes]:
    """Seal ``key`` to ``public_key``; return ``(enc, ciphertext)``.

    Raises:
        KeyWrapFormatError: ``public_key`` is not a valid P-256 point.
    """
    try:
        recipient = SUITE.kem.deserialize_public_key(bytes(public_key))
    except Exception as exc:  # pyhpke raises its own and ValueError for bad points
        raise KeyWrapFormatError(f"the request's public key is not an uncompressed P-256 point: {exc}") from exc
    enc, sender = SUITE.create_sender_context(recipient, info=_INFO + bytes.fromhex(release_root))
    return enc, sender.seal(key, aad=b"")


def unwrap(pair, release_root: str, enc: bytes, ciphertext: bytes) -> bytes:
    """Open what :func:`wrap` sealed to ``pair``'s public key.

    Raises:
        KeyWrapFormatError: it was not sealed to this key or for this release.
    """
    try:
        recipient = SUITE.create_recipient_context(enc, pair.private_key, info=_INFO + bytes.fromhex(release_root))
        return recipient.open(ciphertext, aad=b"")
    except Exception as exc:
        raise KeyWrapFormatError(f"the wrapped key does not open with this request's key: {exc}") from exc
