"""Reads bounded by what was signed: load_release / `sealfl verify` never open an unlisted
file, read each listed file no further than its signed size + 1 byte, and cap the signed
documents -- measured as the peak RSS of the verifying subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sealfl.attestation import reader
from sealfl.attestation.config import VerifyConfig
from sealfl.attestation.errors import AttestationError, VerificationError
from sealfl.attestation.release import load_release, load_trust_anchors
from tests.support.releases import MODEL_FILE

SPARSE_BYTES = 1536 * 1024**2  # 1.5 GiB, allocated sparse (no disk blocks, no page cache)
RSS_BOUND_KB = 400 * 1024      # far below 1.5 GiB: the verifier never holds the big file


def _sparse(path: Path, size: int = SPARSE_BYTES) -> None:
    with open(path, "wb") as fh:
        fh.truncate(size)


# Runs the real CLI and, however it exits, reports this process's own peak RSS (VmHWM: the
# high-water mark of the address space after exec). The parent's ru_maxrss of the child is
# no use here: Linux carries the forking parent's peak (pytest with torch loaded) into it.
_PROBE = """
import runpy, sys
sys.argv = ["sealfl"] + sys.argv[1:]
try:
    runpy.run_module("sealfl.platform.cli", run_name="__main__")
finally:
    with open("/proc/self/status") as status:
        hwm = next(line for line in status if line.startswith("VmHWM:"))
    sys.stderr.write("\\nPEAK " + hwm.split()[1] + "\\n")
"""


def _run_verify(trust: Path, release: Path, timeout_s: float = 120.0) -> tuple[int, str, int]:
    """Run `sealfl verify` in a child; return (exit code, stderr, the child's peak RSS in KiB)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, "verify", "--trust", str(trust), str(release)],
                          capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "COLUMNS": "400"})
    head, _, peak = proc.stderr.rpartition("\nPEAK ")
    assert peak, proc.stderr
    return proc.returncode, head, int(peak.split()[0])


def test_kind_good_release_verifies_with_small_rss(trust_dir, release_dir):
    code, stderr, rss_kb = _run_verify(trust_dir, release_dir)
    assert code == 0, stderr
    assert rss_kb < RSS_BOUND_KB


@pytest.mark.parametrize("case", ["unlisted-sparse-file", "model-replaced-by-sparse-file",
                                  "envelope-replaced-by-sparse-file"])
def test_kind_big_files_are_refused_without_being_read(trust_dir, release_dir, case):
    """The issue's inputs: an unlisted 1.5 GiB file, and the model (signed size ~1.7 KB)
    replaced by 1.5 GiB. Both are refused naming file and check, and the verifier's peak RSS
    stays far below the file's size (before: 1.6 GB)."""
    if case == "unlisted-sparse-file":
        _sparse(release_dir / "huge.bin")
        file, check = "huge.bin", "extra-file"
    elif case == "model-replaced-by-sparse-file":
        _sparse(release_dir / MODEL_FILE)
        file, check = MODEL_FILE, "hash"
    else:
        _sparse(release_dir / "manifest.dsse.json")
        file, check = "manifest.dsse.json", "size"
    code, stderr, rss_kb = _run_verify(trust_dir, release_dir)
    msg = " ".join(stderr.split())
    assert code == 1, stderr
    assert f"'{file}'" in msg and f"'{check}'" in msg, msg
    assert rss_kb < RSS_BOUND_KB, f"peak RSS {rss_kb} KiB"


def test_kind_unlisted_files_are_never_opened(trust_dir, release_dir, monkeypatch):
    opened: list[str] = []
    real_open = os.open

    def recording_open(path, flags, mode=0o777, *, dir_fd=None):
        opened.append(os.fsdecode(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    os.mkfifo(release_dir / "pipe")          # opening this for reading without O_NONBLOCK would hang
    _sparse(release_dir / "zz-huge.bin")
    (release_dir / "sub").mkdir()
    os.symlink("/etc/hostname", release_dir / "link")
    monkeypatch.setattr(reader.os, "open", recording_open)
    with pytest.raises(VerificationError) as info:
        load_release(release_dir, load_trust_anchors(trust_dir))
    err = info.value
    assert (err.file, err.check) == ("link", "extra-file")
    assert err.files == ("link", "pipe", "sub", "zz-huge.bin")  # every unlisted name, sorted
    for name in err.files:
        assert repr(name)[1:-1] in str(err)
    assert set(opened) <= {str(release_dir), "manifest.dsse.json", "manifest.json", "attestation.json", "model.sig"}


def test_kind_missing_and_unlisted_are_reported_together(trust_dir, release_dir):
    (release_dir / "labels.json").unlink()
    (release_dir / "notes.txt").write_bytes(b"not signed")
    with pytest.raises(VerificationError) as info:
        load_release(release_dir, load_trust_anchors(trust_dir))
    assert (info.value.file, info.value.check) == ("labels.json", "missing-file")
    assert "'notes.txt'" in str(info.value)


def test_kind_listed_files_are_read_no_further_than_signed_size_plus_one(trust_dir, release_dir, monkeypatch):
    """A listed file that grows after fstat (or whose fstat lies) is read only up to its
    signed size + 1 byte, then refused by its hash check."""
    names: dict[int, str] = {}
    got: dict[str, int] = {}
    real_read, real_fstat, real_open = os.read, os.fstat, os.open
    signed = len((release_dir / MODEL_FILE).read_bytes())
    (release_dir / MODEL_FILE).write_bytes(b"\0" * (10 * signed))

    def lying_fstat(fd):  # report the signed size, as a file appended to after the check would
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid,
                               signed if st.st_size == 10 * signed else st.st_size, st.st_atime, st.st_mtime,
                               st.st_ctime))

    def naming_open(path, flags, mode=0o777, *, dir_fd=None):
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        names[fd] = os.fsdecode(path)
        return fd

    def counting_read(fd, n):
        data = real_read(fd, n)
        got[names[fd]] = got.get(names[fd], 0) + len(data)
        return data

    monkeypatch.setattr(reader.os, "open", naming_open)
    monkeypatch.setattr(reader.os, "fstat", lying_fstat)
    monkeypatch.setattr(reader.os, "read", counting_read)
    with pytest.raises(VerificationError) as info:
        load_release(release_dir, load_trust_anchors(trust_dir))
    assert (info.value.file, info.value.check) == (MODEL_FILE, "hash")
    assert f"size {signed + 1} bytes" in str(info.value)
    assert got[MODEL_FILE] == signed + 1


def test_kind_signed_sizes_over_the_cap_are_refused_before_reading(trust_dir, release_dir, monkeypatch):
    signed = len((release_dir / MODEL_FILE).read_bytes())
    with pytest.raises(VerificationError) as info:
        load_release(release_dir, load_trust_anchors(trust_dir), config=VerifyConfig(max_file_bytes=signed - 1))
    assert (info.value.file, info.value.check) == (MODEL_FILE, "size")
    with pytest.raises(VerificationError) as info:
        load_release(release_dir, load_trust_anchors(trust_dir), config=VerifyConfig(max_attestation_bytes=64))
    assert (info.value.file, info.value.check) == ("attestation.json", "size")
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(AttestationError, match="max_entries"):
            VerifyConfig(max_entries=bad)


def test_kind_too_many_directory_entries_refused(trust_dir, release_dir):
    for i in range(4):
        (release_dir / f"extra-{i}").write_bytes(b"")
    with pytest.raises(VerificationError) as info:
        load_release(release_dir, load_trust_anchors(trust_dir), config=VerifyConfig(max_entries=8))
    assert info.value.check == "read" and "max_entries" in str(info.value)


def test_kind_listed_symlink_or_fifo_is_refused_as_file_type(trust_dir, release_dir, tmp_path):
    target = tmp_path / "elsewhere.onnx"
    target.write_bytes((release_dir / MODEL_FILE).read_bytes())
    (release_dir / MODEL_FILE).unlink()
    os.symlink(target, release_dir / MODEL_FILE)
    with pytest.raises(VerificationError) as info:
        load_release(release_dir, load_trust_anchors(trust_dir))
    assert (info.value.file, info.value.check) == (MODEL_FILE, "file-type")
    (release_dir / MODEL_FILE).unlink()
    os.mkfifo(release_dir / MODEL_FILE)
    with pytest.raises(VerificationError) as info:
        load_release(release_dir, load_trust_anchors(trust_dir))
    assert (info.value.file, info.value.check) == (MODEL_FILE, "file-type")


# -- large payloads are hashed while they are read -------------------------------------

def _big_release(enclave, tmp_path, size):
    data = os.urandom(size)
    rel = tmp_path / "release-big"
    enclave.write_release(rel, {"blob.bin": data}, "big", 1, {})
    return rel, data


def test_a_large_payload_is_hashed_as_it_is_read_and_the_digest_is_sha256(enclave, trust_dir, tmp_path):
    import hashlib

    from sealfl.attestation.bigread import MIN_BYTES, WATCHED_CHUNK

    rel, data = _big_release(enclave, tmp_path, MIN_BYTES + 3 * WATCHED_CHUNK + 12345)  # chunks + a tail
    dfd = os.open(rel, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got, digest = reader._read_payload(dfd, "blob.bin", len(data))
    finally:
        os.close(dfd)
    assert got == data and digest == hashlib.sha256(data).hexdigest()  # hashlib: the independent source
    assert load_release(rel, load_trust_anchors(trust_dir)).payload["blob.bin"] == data


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_tampered_large_payload_is_refused_on_the_overlapped_path(enclave, trust_dir, tmp_path, where):
    from sealfl.attestation.bigread import MIN_BYTES

    rel, data = _big_release(enclave, tmp_path, MIN_BYTES + 5 * 1024**2 + 7)
    i = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}[where]
    with open(rel / "blob.bin", "r+b") as fh:
        fh.seek(i)
        fh.write(bytes([data[i] ^ 0x01]))
    with pytest.raises(VerificationError) as info:
        load_release(rel, load_trust_anchors(trust_dir))
    assert (info.value.file, info.value.check) == ("blob.bin", "hash")


def test_verify_payload_uses_a_well_formed_digest_and_ignores_anything_else(release_files, trust_dir):
    """The digests argument replaces hashing (so a digest that is not of these bytes is
    refused as a hash mismatch) -- and only a well-formed one does."""
    import hashlib

    from sealfl.attestation.verify import verify_metadata, verify_payload

    trust = load_trust_anchors(trust_dir)
    docs = {k: v for k, v in release_files.items() if k.endswith(".json") or k == "model.sig"}
    signed = verify_metadata(docs, list(release_files), trust)
    payload = {e.path: release_files[e.path] for e in signed.files}
    for bad in ("XYZ", 42, None, "A" * 64, hashlib.sha256(b"").hexdigest()[:63]):
        verify_payload(signed, payload, {MODEL_FILE: bad})  # ignored: hashed here, verifies
    with pytest.raises(VerificationError, match="sha256"):
        verify_payload(signed, payload, {MODEL_FILE: hashlib.sha256(b"other bytes").hexdigest()})


# -- keep: files verified as they stream past, never held (issue 24) ----------------------------

def _two_files(enclave, tmp_path, size: int = 3 * 1024**2 + 17):
    kept, streamed = os.urandom(4096), os.urandom(size)  # the streamed one spans several chunks
    rel = tmp_path / "release-two"
    enclave.write_release(rel, {"kept.bin": kept, "other.bin": streamed}, "two", 1, {})
    return rel, kept, streamed


def test_a_file_not_kept_is_verified_and_not_held(enclave, trust_dir, tmp_path, monkeypatch):
    """keep names the held files; the other is hashed through one small buffer: never read
    into a bytes object of its size, absent from payload, listed in streamed."""
    rel, kept, streamed = _two_files(enclave, tmp_path)
    big_reads = []
    real_read = reader._read_at_most

    def spy(fd, name, limit, hasher=None):
        big_reads.append(name)
        return real_read(fd, name, limit, hasher)

    monkeypatch.setattr(reader, "_read_at_most", spy)
    seen = []

    def keep(signed):
        seen.append(sorted(e.path for e in signed.files))
        return {"kept.bin"}

    v = load_release(rel, load_trust_anchors(trust_dir), keep=keep)
    assert seen == [["kept.bin", "other.bin"]]
    assert v.payload == {"kept.bin": kept} and set(v.streamed) == {"other.bin"}
    assert v.streamed["other.bin"].size == len(streamed)
    assert "other.bin" not in big_reads  # the documents and kept.bin only
    assert set(v.files()) >= {"kept.bin"} and "other.bin" not in v.files()


@pytest.mark.parametrize("how", ["flip", "append"])
def test_a_tampered_file_is_refused_even_when_not_kept(enclave, trust_dir, tmp_path, how):
    rel, _, streamed = _two_files(enclave, tmp_path)
    with open(rel / "other.bin", "r+b") as fh:
        if how == "flip":
            fh.seek(len(streamed) - 1)
            fh.write(bytes([streamed[-1] ^ 1]))
        else:
            fh.seek(0, os.SEEK_END)
            fh.write(b"x")
    with pytest.raises(VerificationError) as info:
        load_release(rel, load_trust_anchors(trust_dir), keep=lambda s: {"kept.bin"})
    assert (info.value.file, info.value.check) == ("other.bin", "hash")


def test_stream_sha256_reads_at_most_limit_plus_one_and_matches_hashlib(tmp_path):
    import hashlib

    data = os.urandom(reader.STREAM_CHUNK * 2 + 5)
    (tmp_path / "f").write_bytes(data)
    for limit in (len(data), len(data) - 1, 10):
        fd = os.open(tmp_path / "f", os.O_RDONLY)
        try:
            got, digest = reader.stream_sha256(fd, limit)
        finally:
            os.close(fd)
        n = min(len(data), limit + 1)
        assert (got, digest) == (n, hashlib.sha256(data[:n]).hexdigest())


def test_verify_payload_refuses_a_file_both_held_and_streamed_or_missing(release_files, trust_dir):
    import hashlib

    from sealfl.attestation.verify import verify_metadata, verify_payload

    trust = load_trust_anchors(trust_dir)
    docs = {k: v for k, v in release_files.items() if k.endswith(".json") or k == "model.sig"}
    signed = verify_metadata(docs, list(release_files), trust)
    payload = {e.path: release_files[e.path] for e in signed.files}
    data = payload[MODEL_FILE]
    ok = {MODEL_FILE: (len(data), hashlib.sha256(data).hexdigest())}
    rest = {k: v for k, v in payload.items() if k != MODEL_FILE}
    v = verify_payload(signed, rest, streamed=ok)
    assert MODEL_FILE not in v.payload and set(v.streamed) == {MODEL_FILE}
    with pytest.raises(VerificationError) as info:
        verify_payload(signed, payload, streamed=ok)
    assert info.value.check == "extra-file"
    for bad in ({MODEL_FILE: (len(data) + 1, ok[MODEL_FILE][1])}, {MODEL_FILE: (len(data), "0" * 64)},
                {MODEL_FILE: (len(data), None)}):
        with pytest.raises(VerificationError) as info:
            verify_payload(signed, rest, streamed=bad)
        assert (info.value.file, info.value.check) == (MODEL_FILE, "hash")
    with pytest.raises(VerificationError) as info:
        verify_payload(signed, rest)
    assert info.value.check == "missing-file"
