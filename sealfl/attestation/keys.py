"""ECDSA P-256 key helpers (pycryptodome).

Signatures are ECDSA over SHA-256 (FIPS 186-3 / 186-4 ``DSS`` mode ``'fips-186-3'``) in
DER encoding (``Ecdsa-Sig-Value`` from RFC 3279 §2.2.3). Key ids are the lowercase hex
SHA-256 of the DER ``SubjectPublicKeyInfo`` (RFC 5280 §4.1.2.7) of the public key.
"""

from __future__ import annotations

import hashlib
import re

from Crypto.Hash import SHA256
from Crypto.PublicKey import ECC
from Crypto.Signature import DSS

from sealfl.attestation.errors import KeyFormatError

__all__ = [
    "CURVE",
    "generate_key",
    "private_key_to_pem",
    "load_private_key",
    "public_key_to_pem",
    "load_public_key",
    "load_public_keys",
    "keyid",
    "sign",
    "verify",
]

#: The only curve sealfl uses (pycryptodome's name for NIST P-256 / secp256r1).
CURVE = "NIST P-256"

_PEM_PUBLIC_BLOCK = re.compile(
    rb"-----BEGIN PUBLIC KEY-----\s.*?-----END PUBLIC KEY-----", re.DOTALL
)


def _check_curve(key: ECC.EccKey) -> ECC.EccKey:
    if key.curve != CURVE:
        raise KeyFormatError(f"key is on curve {key.curve!r}; sealfl accepts only ECDSA P-256 keys")
    return key


def generate_key() -> ECC.EccKey:
    """Generate a fresh ECDSA P-256 private key (``Crypto.PublicKey.ECC.EccKey``)."""
    return ECC.generate(curve="P-256")


def private_key_to_pem(key: ECC.EccKey, passphrase: str | None = None) -> bytes:
    """Export a private key as PKCS#8 PEM bytes.

    Args:
        key: an ECDSA P-256 private key.
        passphrase: if given, the PEM is encrypted PKCS#8 (RFC 8018 PBES2 with scrypt,
            RFC 7914, N = 2**16, r = 8, p = 1, and AES-256-CBC; ~0.2 s per export/import);
            otherwise it is plaintext PKCS#8.

    Raises:
        KeyFormatError: ``key`` has no private part or is not P-256.
    """
    _check_curve(key)
    if not key.has_private():
        raise KeyFormatError("private_key_to_pem needs a private key; got a public key")
    if passphrase is None:
        return key.export_key(format="PEM", use_pkcs8=True).encode("ascii")
    return key.export_key(
        format="PEM",
        passphrase=passphrase,
        use_pkcs8=True,
        protection="scryptAndAES256-CBC",
        prot_params={"iteration_count": 2**16},
    ).encode("ascii")


def load_private_key(pem: bytes, passphrase: str | None = None) -> ECC.EccKey:
    """Import a P-256 private key from PEM bytes (optionally passphrase-protected).

    Raises:
        KeyFormatError: unparsable PEM, wrong passphrase, not P-256, or a public key.
    """
    try:
        key = ECC.import_key(pem, passphrase=passphrase)
    except (ValueError, IndexError, TypeError) as exc:
        raise KeyFormatError(
            f"could not read ECDSA private key PEM ({exc}); check the file and the passphrase"
        ) from exc
    if not key.has_private():
        raise KeyFormatError("expected a private key PEM, got a public key")
    return _check_curve(key)


def public_key_to_pem(key: ECC.EccKey) -> bytes:
    """Export the public part of ``key`` as SubjectPublicKeyInfo PEM bytes (``-----BEGIN PUBLIC KEY-----``)."""
    return _check_curve(key).public_key().export_key(format="PEM").encode("ascii") + b"\n"


def load_public_key(pem: bytes) -> ECC.EccKey:
    """Import one P-256 public key from SubjectPublicKeyInfo PEM bytes.

    Raises:
        KeyFormatError: unparsable, not P-256, or a *private* key (trust directories must
            never contain private keys).
    """
    try:
        key = ECC.import_key(pem)
    except (ValueError, IndexError, TypeError) as exc:
        raise KeyFormatError(f"could not read ECDSA public key PEM: {exc}") from exc
    if key.has_private():
        raise KeyFormatError(
            "expected a public key PEM but found a PRIVATE key; remove it and pin only the public key"
        )
    return _check_curve(key)


def load_public_keys(pem: bytes) -> list[ECC.EccKey]:
    """Import one or more concatenated ``PUBLIC KEY`` PEM blocks (key rotation).

    Raises:
        KeyFormatError: no PEM public key block found, or any block is invalid.
    """
    blocks = _PEM_PUBLIC_BLOCK.findall(pem)
    if not blocks:
        raise KeyFormatError("no '-----BEGIN PUBLIC KEY-----' block found")
    return [load_public_key(block) for block in blocks]


def keyid(public_key: ECC.EccKey) -> str:
    """Return the key id: lowercase hex SHA-256 of the DER SubjectPublicKeyInfo (64 chars)."""
    der = _check_curve(public_key).public_key().export_key(format="DER")
    return hashlib.sha256(der).hexdigest()


def sign(private_key: ECC.EccKey, data: bytes) -> bytes:
    """Sign ``data`` with ECDSA P-256 / SHA-256; return the DER-encoded signature (~70-72 bytes).

    Raises:
        KeyFormatError: ``private_key`` has no private part.
    """
    if not private_key.has_private():
        raise KeyFormatError("signing needs a private key; got a public key")
    return DSS.new(private_key, "fips-186-3", encoding="der").sign(SHA256.new(data))


def verify(public_key: ECC.EccKey, data: bytes, signature: bytes) -> bool:
    """Return True iff ``signature`` (DER) is a valid ECDSA P-256/SHA-256 signature over ``data``.

    Never raises on a bad or malformed signature; returns False instead.
    """
    try:
        DSS.new(public_key.public_key(), "fips-186-3", encoding="der").verify(
            SHA256.new(data), bytes(signature)
        )
        return True
    except (ValueError, TypeError):
        return False
