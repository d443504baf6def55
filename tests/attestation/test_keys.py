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
