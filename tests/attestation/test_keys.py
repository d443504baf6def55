"""ECDSA P-256 key helpers."""

from __future__ import annotations

import hashlib

import pytest

from sealfl.attestation import keys
from sealfl.attestation.errors import KeyFormatError

# RFC 5480 §2: SubjectPublicKeyInfo for id-ecPublicKey / secp256r1 with an uncompressed point.
SPKI_P256_PREFIX = bytes.fromhex("3059301306072a8648ce3d020106082a8648ce3d030107034200")


def test_keyid_is_sha256_of_spki_der():
    key = keys.generate_key()
    point = b"\x04" + int(key.pointQ.x).to_bytes(32, "big") + int(key.pointQ.y).to_bytes(32, "big")
    assert keys.keyid(key.public_key()) == hashlib.sha256(SPKI_P256_PREFIX + point).hexdigest()
    assert keys.keyid(key) == keys.keyid(key.public_key())


def test_pem_round_trips(tmp_path):
    key = keys.generate_key()
    assert keys.load_private_key(keys.private_key_to_pem(key)) == key
    enc = keys.private_key_to_pem(key, passphrase="correct horse")
    assert b"ENCRYPTED PRIVATE KEY" in enc
    assert keys.load_private_key(enc, passphrase="correct horse") == key
    with pytest.raises(KeyFormatError):
        keys.load_private_key(enc, passphrase="wrong")
    pub_pem = keys.public_key_to_pem(key)
    assert keys.load_public_key(pub_pem) == key.public_key()
    with pytest.raises(KeyFormatError, match="PRIVATE"):
        keys.load_public_key(keys.private_key_to_pem(key))
    two = keys.load_public_keys(pub_pem + keys.public_key_to_pem(keys.generate_key()))
    assert len(two) == 2 and two[0] == key.public_key()


def test_sign_verify_never_raises_on_bad_signature():
    key = keys.generate_key()
    sig = keys.sign(key, b"data")
    assert sig[0] == 0x30  # DER SEQUENCE
    assert keys.verify(key.public_key(), b"data", sig)
    assert not keys.verify(key.public_key(), b"datA", sig)
    assert not keys.verify(keys.generate_key().public_key(), b"data", sig)
    assert not keys.verify(key.public_key(), b"data", b"\x00garbage")
    assert not keys.verify(key.public_key(), b"data", b"")


def _der_int(v: int) -> bytes:
    body = v.to_bytes((v.bit_length() + 8) // 8, "big")
    return b"\x02" + bytes([len(body)]) + body


def _der_sig(r: int, s: int) -> bytes:
    body = _der_int(r) + _der_int(s)
    return b"\x30" + bytes([len(body)]) + body


def _rs(sig: bytes) -> tuple[int, int]:
    """(r, s) by pycryptodome's own DER reader: an oracle independent of sealfl's."""
    from Crypto.Util.asn1 import DerSequence

    seq = DerSequence().decode(sig)
    return int(seq[0]), int(seq[1])


# SEC 2 v2 §2.4.2: the order of the P-256 base point, written out from the standard
N = int("FFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551", 16)


def test_kind_malleable_signature_encodings_are_refused():
    from Crypto.Hash import SHA256
    from Crypto.Signature import DSS

    key = keys.generate_key()
    for i in range(64):  # about half of raw ECDSA signatures have a high S
        sig = keys.sign(key, b"msg %d" % i)
        r, s = _rs(sig)
        assert s <= N // 2 and keys.verify(key.public_key(), b"msg %d" % i, sig)
        flipped = _der_sig(r, N - s)
        # the flipped signature is mathematically valid: the library's own verifier accepts it ...
        DSS.new(key.public_key(), "fips-186-3", encoding="der").verify(SHA256.new(b"msg %d" % i), flipped)
        # ... sealfl accepts one encoding per signature only
        assert not keys.verify(key.public_key(), b"msg %d" % i, flipped)
        assert "high S" in keys.signature_problem(flipped)
        assert keys.canonical_signature(flipped) == sig
    r, s = _rs(sig)
    padded_r = b"\x02" + bytes([len(_der_int(r)) - 1]) + b"\x00" + _der_int(r)[2:]  # a superfluous leading zero
    for bad in (b"\x30" + bytes([len(padded_r + _der_int(s))]) + padded_r + _der_int(s),
                b"\x30\x81" + bytes([len(sig) - 2]) + sig[2:],  # long-form length (BER, not DER)
                sig + b"\x00",  # trailing byte
                _der_sig(r, 0), _der_sig(N, s)):  # out of range
        assert not keys.verify(key.public_key(), b"msg 63", bad)
        assert keys.signature_problem(bad) is not None


@pytest.mark.parametrize("signer", ["auto", "pycryptodome"])
def test_openssl_and_pycryptodome_arithmetic_agree(monkeypatch, signer):
    """:func:`keys.sign`/:func:`keys.verify` do their curve arithmetic in OpenSSL when
    ``cryptography`` is installed: signatures of either verify under both, and both refuse
    the same bad ones (wrong data, wrong key, another signature's r, every encoding rule)."""
    from Crypto.Hash import SHA256
    from Crypto.Signature import DSS

    assert keys._openssl_ec() is not None  # the test environment has cryptography (Flower requires it)
    key, other = keys.generate_key(), keys.generate_key()
    for i in range(24):
        data = b"reply %d" % i
        monkeypatch.setattr(keys, "ARITHMETIC", signer)
        sig = keys.sign(key, data)
        assert keys.signature_problem(sig) is None
        # an independent oracle: pycryptodome's own DER verifier
        DSS.new(key.public_key(), "fips-186-3", encoding="der").verify(SHA256.new(data), sig)
        r, s = _rs(sig)
        results = {}
        for arithmetic in ("auto", "pycryptodome"):
            monkeypatch.setattr(keys, "ARITHMETIC", arithmetic)
            results[arithmetic] = (
                keys.verify(key.public_key(), data, sig), keys.verify(key, data, sig),
                keys.verify(key.public_key(), data + b"!", sig), keys.verify(other.public_key(), data, sig),
                keys.verify(key.public_key(), data, _der_sig(r, (s + 1) % N or 1)),
                keys.verify(key.public_key(), data, _der_sig(r, N - s)), keys.verify(key.public_key(), data, sig[:-1]))
        assert results["auto"] == results["pycryptodome"] == (True, True, False, False, False, False, False)
