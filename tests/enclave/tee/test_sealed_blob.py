"""The sealed-blob framing both TEE backends share: a round trip, and every kind of damage
is an UnsealError -- a flipped byte anywhere (magic, length, header, nonce, tag, data), a
cut at any point, an oversized header length, another key."""

import os

import pytest

from sealfl.enclave.errors import UnsealError
from sealfl.enclave.tee.sealed_blob import MAX_HEADER_BYTES, open_blob, seal_blob, split_blob

MAGIC = b"TEST-SEAL/1\n"
KEY = bytes(range(32))
HEADER = {"alg": "AES-256-GCM", "bank": "sha256", "policy": {"16": "00" * 32}}


def _open(blob, key=KEY):
    return open_blob(split_blob(blob, MAGIC, "test blob"), key, "failed authentication")


def test_kind_round_trip_and_the_header_is_readable_before_authentication():
    data = os.urandom(1000)
    blob = seal_blob(MAGIC, HEADER, KEY, data)
    assert _open(blob) == data
    assert split_blob(blob, MAGIC, "test blob").header == b'{"alg":"AES-256-GCM","bank":"sha256","policy":{"16":"' \
        + b"00" * 32 + b'"}}'
    assert seal_blob(MAGIC, HEADER, KEY, data) != blob  # a fresh nonce each time


def test_kind_every_flipped_byte_is_refused():
    blob = seal_blob(MAGIC, HEADER, KEY, b"secret context bytes")
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(UnsealError):
            _open(bytes(bad))


def test_kind_every_cut_and_another_key_are_refused():
    blob = seal_blob(MAGIC, HEADER, KEY, b"x" * 40)
    for n in range(len(blob)):
        with pytest.raises(UnsealError):
            _open(blob[:n])
    with pytest.raises(UnsealError, match="failed authentication"):
        _open(blob, key=bytes(32))


def test_kind_an_oversized_header_length_is_refused_before_decryption():
    blob = MAGIC + (MAX_HEADER_BYTES + 1).to_bytes(4, "big") + bytes(MAX_HEADER_BYTES + 1 + 28)
    with pytest.raises(UnsealError, match="oversized"):
        split_blob(blob, MAGIC, "test blob")
