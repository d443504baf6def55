"""Signed deltas (issue 21 item 7): made by the release enclave, applied by the device only
onto its exact base, every patch bounded by its signed size, the result verified in full."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import hdiffpatch
import numpy as np
import pytest

from sealfl.attestation.canonical import loads_strict
from sealfl.attestation.delta import DELTA_FILE, PATCH_DIR, check_patch_header, verify_delta_statement
from sealfl.attestation.errors import DeltaError
from sealfl.enclave.device.delta import apply_delta, read_delta_statement
from sealfl.enclave.device.verify import verify_dir
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.platform.delta import DeltaBuildError, make_delta
from tests.support.releases import MODEL_FILE
from tests.support.tufrepo import NAME, new_release


@pytest.fixture
def pair(tmp_path, enclave, trust_dir):
    v3 = new_release(enclave, tmp_path / "v3", 3, weight=0.5)
    v4 = new_release(enclave, tmp_path / "v4", 4, weight=2.5)
    return v3, v4


def _statement(delta: Path) -> dict:
    env = loads_strict((delta / DELTA_FILE).read_bytes())
    import base64
    return json.loads(base64.b64decode(env["payload"]))["predicate"]


def test_delta_roundtrip_rebuilds_the_new_release_byte_for_byte(tmp_path, enclave, trust_dir, pair):
    v3, v4 = pair
    summary = make_delta(enclave, trust_dir, v3, v4, tmp_path / "delta")
    assert MODEL_FILE in summary.patched
    base_root = verify_dir(trust_dir, v3).root_digest
    result = apply_delta(trust_dir, v3, tmp_path / "delta", tmp_path / "out", base_root_digest=base_root)
    assert (result.version, result.root_digest) == (4, verify_dir(trust_dir, v4).root_digest)
    for f in v4.iterdir():
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in v4.iterdir())


def test_delta_onto_the_wrong_base_is_refused(tmp_path, enclave, trust_dir, pair):
    v3, v4 = pair
    v2 = new_release(enclave, tmp_path / "v2", 2, weight=1.0)
    make_delta(enclave, trust_dir, v3, v4, tmp_path / "delta")
    with pytest.raises(DeltaError, match="wrong base"):
        apply_delta(trust_dir, v2, tmp_path / "delta", tmp_path / "out",
                    base_root_digest=verify_dir(trust_dir, v2).root_digest)
    assert not (tmp_path / "out").exists()
    # the device's state names v3 but the directory holds v2: refused too
    with pytest.raises(DeltaError, match="base release is"):
        apply_delta(trust_dir, v2, tmp_path / "delta", tmp_path / "out2",
                    base_root_digest=verify_dir(trust_dir, v3).root_digest)


def _resign(enclave, delta: Path, edit) -> None:
    pred = _statement(delta)
    edit(pred)
    (delta / DELTA_FILE).write_bytes(enclave.sign_delta(pred))


def test_delta_whose_result_hash_mismatches_is_refused(tmp_path, enclave, trust_dir, pair):
    v3, v4 = pair
    make_delta(enclave, trust_dir, v3, v4, tmp_path / "delta")

    def wrong_hash(pred):
        entry = next(f for f in pred["files"] if f["name"] == MODEL_FILE)
        entry["sha256"] = hashlib.sha256(b"another model").hexdigest()
    _resign(enclave, tmp_path / "delta", wrong_hash)
    with pytest.raises(DeltaError, match=f"{MODEL_FILE}: the patched file is not the signed result"):
        apply_delta(trust_dir, v3, tmp_path / "delta", tmp_path / "out",
                    base_root_digest=verify_dir(trust_dir, v3).root_digest)


def test_delta_whose_result_root_digest_is_another_release_is_refused(tmp_path, enclave, trust_dir, pair):
    v3, v4 = pair
    make_delta(enclave, trust_dir, v3, v4, tmp_path / "delta")
    _resign(enclave, tmp_path / "delta", lambda p: p["result"].update(root_digest="ab" * 32))
    with pytest.raises(DeltaError, match="not the signed result"):
        apply_delta(trust_dir, v3, tmp_path / "delta", tmp_path / "out",
                    base_root_digest=verify_dir(trust_dir, v3).root_digest)


def test_tampered_delta_statement_is_refused(tmp_path, enclave, trust_dir, pair):
    v3, v4 = pair
    make_delta(enclave, trust_dir, v3, v4, tmp_path / "delta")
    data = (tmp_path / "delta" / DELTA_FILE).read_bytes()
    env = loads_strict(data)
    import base64
    stmt = json.loads(base64.b64decode(env["payload"]))
    stmt["predicate"]["base"]["root_digest"] = "cd" * 32
    env["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
    (tmp_path / "delta" / DELTA_FILE).write_text(json.dumps(env))
    with pytest.raises(DeltaError, match=DELTA_FILE):
        read_delta_statement(trust_dir, tmp_path / "delta")


def test_delta_statement_signed_by_another_key_is_refused(tmp_path, enclave, trust_dir, pair):
    v3, v4 = pair
    make_delta(enclave, trust_dir, v3, v4, tmp_path / "delta")
    rogue = ReleaseEnclave.create(tmp_path / "rogue")
    (tmp_path / "delta" / DELTA_FILE).write_bytes(rogue.sign_delta(_statement(tmp_path / "delta")))
    with pytest.raises(DeltaError, match=DELTA_FILE):
        apply_delta(trust_dir, v3, tmp_path / "delta", tmp_path / "out",
                    base_root_digest=verify_dir(trust_dir, v3).root_digest)
    assert not (tmp_path / "out").exists()


def test_unsigned_delta_statement_is_refused(tmp_path, enclave, trust_dir, pair):
    v3, v4 = pair
    make_delta(enclave, trust_dir, v3, v4, tmp_path / "delta")
    (tmp_path / "delta" / DELTA_FILE).write_text(json.dumps({"predicate": _statement(tmp_path / "delta")}))
    with pytest.raises(DeltaError):
        read_delta_statement(trust_dir, tmp_path / "delta")


def test_tampered_patch_is_refused_by_its_signed_hash(tmp_path, enclave, trust_dir, pair):
    v3, v4 = pair
    make_delta(enclave, trust_dir, v3, v4, tmp_path / "delta")
    p = tmp_path / "delta" / PATCH_DIR / f"{MODEL_FILE}.hdiff"
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(DeltaError, match="tampered patch"):
        apply_delta(trust_dir, v3, tmp_path / "delta", tmp_path / "out",
                    base_root_digest=verify_dir(trust_dir, v3).root_digest)


def test_patch_that_expands_beyond_the_signed_size_is_refused_before_applying(tmp_path, enclave, trust_dir, pair):
    """A signed statement whose patch (hash-matching, so it passes the patch check) declares a
    64 MiB output for a file signed at its real length: refused from the header, unapplied."""
    v3, v4 = pair
    make_delta(enclave, trust_dir, v3, v4, tmp_path / "delta")
    old = (v3 / MODEL_FILE).read_bytes()
    bomb = hdiffpatch.diff(old, old + bytes(64 << 20), hdiffpatch.COMPRESSION_ZSTD)
    assert len(bomb) < 1 << 20
    (tmp_path / "delta" / PATCH_DIR / f"{MODEL_FILE}.hdiff").write_bytes(bomb)

    def point_at_bomb(pred):
        entry = next(f for f in pred["files"] if f["name"] == MODEL_FILE)
        entry.update(patch_length=len(bomb), patch_sha256=hashlib.sha256(bomb).hexdigest())
    _resign(enclave, tmp_path / "delta", point_at_bomb)
    signed_len = len((v4 / MODEL_FILE).read_bytes())
    with pytest.raises(DeltaError, match=f"would produce {len(old) + (64 << 20)} bytes, but the signed length is "
                       f"{signed_len}"):
        apply_delta(trust_dir, v3, tmp_path / "delta", tmp_path / "out",
                    base_root_digest=verify_dir(trust_dir, v3).root_digest)


def test_patch_longer_than_its_signed_length_is_refused(tmp_path, enclave, trust_dir, pair):
    v3, v4 = pair
    make_delta(enclave, trust_dir, v3, v4, tmp_path / "delta")
    p = tmp_path / "delta" / PATCH_DIR / f"{MODEL_FILE}.hdiff"
    p.write_bytes(p.read_bytes() + b"\0")
    with pytest.raises(DeltaError, match="longer than its signed"):
        apply_delta(trust_dir, v3, tmp_path / "delta", tmp_path / "out",
                    base_root_digest=verify_dir(trust_dir, v3).root_digest)


def test_check_patch_header_reads_sizes_from_an_independent_patch():
    patch = hdiffpatch.diff(b"x" * 300, b"y" * 70000)
    check_patch_header(patch, new_length=70000, old_length=300)
    with pytest.raises(DeltaError, match="would produce 70000 bytes, but the signed length is 69999"):
        check_patch_header(patch, new_length=69999, old_length=300)
    with pytest.raises(DeltaError, match="300-byte base file"):
        check_patch_header(patch, new_length=70000, old_length=301)
    for bad in (b"", b"BSDIFF40" + patch[8:], patch[:9], b"HDIFF13&rot13\0\x01\x01"):
        with pytest.raises(DeltaError):
            check_patch_header(bad, new_length=70000, old_length=300)


def test_statement_predicate_refuses_a_result_of_another_name_or_an_older_version(enclave, trust_dir):
    base = {"name": NAME, "version": 3, "root_digest": "aa" * 32}
    files = [{"name": "a.bin", "length": 1, "sha256": "bb" * 32, "from": "a.bin", "patch": None,
              "patch_length": 0, "patch_sha256": None}]
    keys = [enclave.release_public_key]
    good = {"algorithm": "hdiffpatch", "base": base, "result": {**base, "version": 4, "root_digest": "cc" * 32},
            "files": files}
    assert verify_delta_statement(enclave.sign_delta(good), keys).version == 4
    for result, match in (({**base, "name": "other", "version": 4}, "another"), ({**base, "version": 3}, "newer")):
        with pytest.raises(DeltaError, match=match):
            enclave.sign_delta({**good, "result": result})
    with pytest.raises(DeltaError, match="plain, unique"):
        enclave.sign_delta({**good, "files": [{**files[0], "name": "../x"}]})


def test_make_delta_refuses_going_backwards(tmp_path, enclave, trust_dir, pair):
    v3, v4 = pair
    with pytest.raises(DeltaBuildError, match="older to a newer"):
        make_delta(enclave, trust_dir, v4, v3, tmp_path / "delta")
    assert not np.any([p.exists() for p in [tmp_path / "delta"]])
