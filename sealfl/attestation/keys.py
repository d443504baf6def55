"""ECDSA P-256 key helpers (pycryptodome keys; OpenSSL's arithmetic when it is installed).

Signatures are ECDSA over SHA-256 (FIPS 186-3 / 186-4 ``DSS`` mode ``'fips-186-3'``) in
DER encoding (``Ecdsa-Sig-Value`` from RFC 3279 §2.2.3). Key ids are the lowercase hex
SHA-256 of the DER ``SubjectPublicKeyInfo`` (RFC 5280 §4.1.2.7) of the public key.

**One encoding per signature (low-S).** ECDSA is malleable: if ``(r, s)`` verifies, so does
``(r, n - s)`` (SEC 1 v2 §4.1.4: only ``s``'s residue class up to sign enters the check), and
a lenient DER reader accepts further spellings (long-form lengths, leading zero bytes).
:func:`verify` -- the one verification helper every signature in sealfl goes through
(releases' DSSE envelopes, quotes, partners' replies) -- accepts only the canonical form:
strict DER (X.690 §10: definite short-form lengths, minimal positive INTEGERs, no trailing
bytes) with ``1 <= r < n`` and ``1 <= s <= n/2`` ("low-S", the rule of Bitcoin's BIP 62 and
of libsecp256k1's ``secp256k1_ecdsa_verify``), ``n`` the P-256 group order (SEC 2 §2.4.2).
:func:`sign` always produces that form; :func:`canonical_signature` converts a signature
made elsewhere (a TPM chooses its own ``s``) before it is stored.

**Arithmetic.** Keys are pycryptodome ``EccKey`` objects everywhere. The curve arithmetic
of :func:`sign` and :func:`verify` runs in OpenSSL (through the ``cryptography`` package,
which Flower requires, so every partner and aggregator has it) when it can be imported,
else in pycryptodome: ~0.1 ms instead of ~1.5 ms (sign) and ~3 ms (verify) here, paid for
every partner reply. Both compute the same FIPS 186-4 ECDSA: the encoding rules above are
checked by this module before either is asked, so they accept exactly the same signatures
(``tests/attestation/test_keys.py`` checks the two against each other).
"""

from __future__ import annotations

import hashlib
import re
import weakref
from functools import lru_cache

from Crypto.Hash import SHA256
from Crypto.PublicKey import ECC
from Crypto.Signature import DSS

from sealfl.attestation.errors import KeyFormatError, SignatureError

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
    "P256_ORDER",
    "canonical_signature",
    "signature_problem",
]

#: The only curve sealfl uses (pycryptodome's name for NIST P-256 / secp256r1).
CURVE = "NIST P-256"
#: Order n of the P-256 base point (SEC 2 v2 §2.4.2; FIPS 186-4 D.1.2.3).
P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_HALF_ORDER = P256_ORDER // 2
_SCALAR_BYTES = 32

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
        KeyFormatError: no PEM public key block found (a private key is named as such), or
            any block is invalid.
    """
    blocks = _PEM_PUBLIC_BLOCK.findall(pem)
    if not blocks:
        if re.search(rb"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----", pem):
            raise KeyFormatError("holds a PRIVATE key, not a public key: give the public key instead (for a device, "
                                 "the ak.pem that `sealfl device provision --export-ak` writes); a verifier never "
                                 "needs a private key")
        raise KeyFormatError("no '-----BEGIN PUBLIC KEY-----' block found (expected one or more PEM public keys)")
    return [load_public_key(block) for block in blocks]


def keyid(public_key: ECC.EccKey) -> str:
    """Return the key id: lowercase hex SHA-256 of the DER SubjectPublicKeyInfo (64 chars)."""
    der = _check_curve(public_key).public_key().export_key(format="DER")
    return hashlib.sha256(der).hexdigest()


def _der_integer(value: int) -> bytes:
    body = value.to_bytes((value.bit_length() + 8) // 8, "big")  # one leading 0x00 exactly when the top bit is set
    return b"\x02" + bytes([len(body)]) + body


def _encode(r: int, s: int) -> bytes:
    body = _der_integer(r) + _der_integer(s)
    return b"\x30" + bytes([len(body)]) + body


def _decode(signature: bytes) -> tuple[int, int]:
    """``(r, s)`` of a DER ``Ecdsa-Sig-Value``, any valid DER spelling; SignatureError otherwise."""
    sig = bytes(signature)
    if len(sig) < 8 or len(sig) > 72 or sig[0] != 0x30 or sig[1] != len(sig) - 2:
        raise SignatureError("an ECDSA signature must be a DER SEQUENCE of at most 72 bytes with a short-form length "
                             "covering exactly the rest")
    out, pos = [], 2
    for name in ("r", "s"):
        if pos + 2 > len(sig) or sig[pos] != 0x02 or sig[pos + 1] == 0 or sig[pos + 1] > 33 \
                or pos + 2 + sig[pos + 1] > len(sig):
            raise SignatureError(f"ECDSA signature: {name} is not a DER INTEGER of 1..33 bytes")
        body = sig[pos + 2:pos + 2 + sig[pos + 1]]
        if body[0] & 0x80:
            raise SignatureError(f"ECDSA signature: {name} is negative")
        out.append(int.from_bytes(body, "big"))
        pos += 2 + len(body)
    if pos != len(sig):
        raise SignatureError("ECDSA signature: bytes after the two INTEGERs")
    r, s = out
    if not (1 <= r < P256_ORDER and 1 <= s < P256_ORDER):
        raise SignatureError("ECDSA signature: r and s must lie in 1..n-1 (n: the P-256 group order)")
    return r, s


def signature_problem(signature: bytes) -> str | None:
    """Why ``signature`` is not the canonical encoding :func:`verify` accepts (module
    docstring), or None if it is. Pure; never raises."""
    try:
        r, s = _decode(signature)
    except (SignatureError, TypeError) as exc:
        return str(exc)
    if s > _HALF_ORDER:
        return ("ECDSA signature has a high S value (s > n/2); sealfl accepts only the low-S form of a signature "
                "(re-sign it with this version of sealfl)")
    if _encode(r, s) != bytes(signature):
        return "ECDSA signature is not in minimal DER (an INTEGER carries a superfluous leading zero byte)"
    return None


def canonical_signature(signature: bytes) -> bytes:
    """The canonical form of a valid-DER ECDSA signature: minimal DER, ``s`` replaced by
    ``n - s`` when it is above n/2 (verifies exactly when the original does).

    Raises:
        SignatureError: not a DER ``Ecdsa-Sig-Value`` with ``r``, ``s`` in 1..n-1.
    """
    r, s = _decode(signature)
    return _encode(r, P256_ORDER - s if s > _HALF_ORDER else s)


#: ``"auto"``: OpenSSL's arithmetic if ``cryptography`` imports, else pycryptodome's;
#: ``"pycryptodome"``: always pycryptodome's (module docstring; the tests compare the two)
ARITHMETIC = "auto"


@lru_cache(maxsize=1)
def _openssl_ec():
    """``(ec, hashes, InvalidSignature)`` from ``cryptography``, or None if it is not installed."""
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError:
        return None
    return ec, hashes, InvalidSignature


def _openssl_for(key: ECC.EccKey):
    """:func:`_openssl_ec` when it may do ``key``'s arithmetic (a P-256 key, :data:`ARITHMETIC`), else None."""
    if ARITHMETIC != "auto" or key.curve != CURVE:
        return None
    return _openssl_ec()


@lru_cache(maxsize=4096)
def _openssl_public(point: bytes):
    """OpenSSL's public key for an uncompressed P-256 point (its validation costs ~0.3 ms: kept)."""
    ec = _openssl_ec()[0]
    return ec.EllipticCurvePublicNumbers(int.from_bytes(point[1:33], "big"), int.from_bytes(point[33:], "big"),
                                         ec.SECP256R1()).public_key()


#: id(key) -> (weak reference to the key, its uncompressed point): pycryptodome converts the
#: point to affine coordinates (a field inversion, ~0.2 ms) on every ``pointQ.xy``
_POINTS: dict[int, tuple[weakref.ref, bytes]] = {}


def _point_bytes(key: ECC.EccKey) -> bytes:
    """``04 || x || y`` of ``key``'s public point (kept per live key object)."""
    hit = _POINTS.get(id(key))
    if hit is not None and hit[0]() is key:
        return hit[1]
    x, y = key.pointQ.xy
    point = b"\x04" + int(x).to_bytes(_SCALAR_BYTES, "big") + int(y).to_bytes(_SCALAR_BYTES, "big")
    if len(_POINTS) >= 4096:
        _POINTS.clear()
    _POINTS[id(key)] = (weakref.ref(key), point)
    return point


def sign(private_key: ECC.EccKey, data: bytes) -> bytes:
    """Sign ``data`` with ECDSA P-256 / SHA-256; return the canonical (minimal DER, low-S)
    signature (~70-72 bytes).

    Raises:
        KeyFormatError: ``private_key`` has no private part.
    """
    if not private_key.has_private():
        raise KeyFormatError("signing needs a private key; got a public key")
    openssl = _openssl_for(private_key)
    if openssl is not None:
        ec, hashes, _ = openssl
        der = ec.derive_private_key(int(private_key.d), ec.SECP256R1()).sign(bytes(data), ec.ECDSA(hashes.SHA256()))
        return canonical_signature(der)
    # pycryptodome's own DER encoder works on its GMP integers byte by byte (~80 % of a
    # signature's time here): take the raw r || s and encode the two Python ints ourselves
    raw = DSS.new(private_key, "fips-186-3", encoding="binary").sign(SHA256.new(data))
    r, s = int.from_bytes(raw[:_SCALAR_BYTES], "big"), int.from_bytes(raw[_SCALAR_BYTES:], "big")
    return _encode(r, P256_ORDER - s if s > _HALF_ORDER else s)


def verify(public_key: ECC.EccKey, data: bytes, signature: bytes) -> bool:
    """Return True iff ``signature`` is a canonical (:func:`signature_problem` is None) and
    valid ECDSA P-256/SHA-256 signature over ``data``.

    Never raises on a bad or malformed signature; returns False instead.
    """
    if signature_problem(signature) is not None:
        return False
    openssl = _openssl_for(public_key)
    if openssl is not None:
        _, hashes, invalid = openssl
        try:
            _openssl_public(_point_bytes(public_key)).verify(bytes(signature), bytes(data), openssl[0].ECDSA(hashes.SHA256()))
            return True
        except (invalid, ValueError, TypeError):
            return False
    try:
        r, s = _decode(signature)  # canonical DER (checked above): hand pycryptodome the raw r || s
        DSS.new(public_key.public_key(), "fips-186-3", encoding="binary").verify(
            SHA256.new(data), r.to_bytes(_SCALAR_BYTES, "big") + s.to_bytes(_SCALAR_BYTES, "big")
        )
        return True
    except (ValueError, TypeError, SignatureError):
        return False
