"""Large files read into huge-page backed bytes (sealfl.attestation.bigread): the same
bytes ``os.read`` gives, an ordinary immutable ``bytes`` object, short at EOF, read from
the current offset, and the reader's ``limit + 1`` check still sees a file that grew."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest

from sealfl.attestation import bigread, reader
from sealfl.attestation.errors import VerificationError
from sealfl.attestation.release import load_release, load_trust_anchors

MIN = bigread.MIN_BYTES


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "payload.bin"
    path.write_bytes(os.urandom(MIN + 3 * 4096 + 777))  # not a whole number of pages
    return path


def _fd(path, offset=0):
    fd = os.open(path, os.O_RDONLY)
    os.lseek(fd, offset, os.SEEK_SET)
    return fd


@pytest.mark.parametrize("offset, size", [(0, MIN), (0, MIN + 1), (5, MIN + 4096), (0, MIN + 3 * 4096 + 777),
                                          (0, 2 * MIN)])
def test_same_bytes_as_os_read(big_file, offset, size):
    if sys.implementation.name != "cpython":
        pytest.skip("not this platform: the huge-page read is CPython-only (others fall back to os.read)")
    assert bigread._OFFSET is not None, "CPython here: the huge-page read path must be available"
    want = big_file.read_bytes()[offset:offset + size]
    fd = _fd(big_file, offset)
    try:
        got = bigread.read_new_bytes(fd, size)
        assert os.read(fd, 1) == big_file.read_bytes()[offset + size:offset + size + 1]  # left where it stopped
    finally:
        os.close(fd)
    assert type(got) is bytes and got == want  # short at EOF (2 * MIN > the file)
    assert hashlib.sha256(got).digest() == hashlib.sha256(want).digest()


def test_small_reads_and_unavailable_path_fall_back(big_file, monkeypatch):
    fd = _fd(big_file)
    try:
        assert bigread.read_new_bytes(fd, MIN - 1) is None
        monkeypatch.setattr(bigread, "_OFFSET", None)
        assert bigread.read_new_bytes(fd, MIN) is None
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # nothing was read
    finally:
        os.close(fd)


def test_reader_sees_a_byte_past_the_limit(big_file):
    fd = _fd(big_file)
    try:
        data = reader._read_at_most(fd, "payload.bin", MIN)
    finally:
        os.close(fd)
    assert data == big_file.read_bytes()[:MIN + 1]  # limit + 1 bytes: "larger than signed"


def test_large_signed_payload_verifies_and_a_flipped_byte_is_refused(enclave, trust_dir, tmp_path):
    payload = os.urandom(MIN + 12345)
    rel = tmp_path / "rel"
    enclave.write_release(rel, {"weights.bin": payload}, "big", 1, {})
    got = load_release(rel, load_trust_anchors(trust_dir))
    assert got.payload["weights.bin"] == payload and type(got.payload["weights.bin"]) is bytes
    flipped = bytearray(payload)
    flipped[MIN // 2] ^= 1
    (rel / "weights.bin").write_bytes(bytes(flipped))
    with pytest.raises(VerificationError) as info:
        load_release(rel, load_trust_anchors(trust_dir))
    assert (info.value.file, info.value.check) == ("weights.bin", "hash")
