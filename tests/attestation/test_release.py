"""verify_release: accepts the untouched release and names file + check for every refusal."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

from sealfl.attestation import keys
from sealfl.attestation.bundle import build_attestation
from sealfl.attestation.canonical import canonical_json
from sealfl.attestation.dsse import sign_envelope
from sealfl.attestation.errors import TrustAnchorError, VerificationError
from sealfl.attestation.quote import pcr_after
from sealfl.attestation.release import (
    DeviceState,
    LastGood,
    load_trust_anchors,
    read_release_dir,
    verify_release,
)
from sealfl.attestation.statement import PAYLOAD_TYPE
from sealfl.enclave.measurement import measure_release_enclave
from sealfl.enclave.tee.sim import SimTEE
from tests.support.releases import MODEL_FILE, resigned_model_sig


def _statement_digest(files) -> str:
    """SHA-256 of the signed statement, computed here with base64 + hashlib."""
    import base64

    return hashlib.sha256(base64.b64decode(json.loads(files["manifest.dsse.json"])["payload"])).hexdigest()


def _state(version: int, root_digest: str = "0" * 64, statement_digest: str | None = "0" * 64) -> DeviceState:
    """A device that last ran ``version`` (root / statement digests as given)."""
    return DeviceState(LastGood("heart-mlp", version, root_digest, statement_digest, "slots/x", "/src", MODEL_FILE))


def _refused(files, trust, file, check, **kw) -> VerificationError:
    with pytest.raises(VerificationError) as info:
        verify_release(files, trust, **kw)
    err = info.value
    assert (err.file, err.check) == (file, check), str(err)
    assert repr(file) in str(err) and repr(check) in str(err)
    return err


def test_untouched_release_is_accepted(release_files, trust_dir):
    trust = load_trust_anchors(trust_dir)
    root = json.loads(release_files["manifest.json"])["root_digest"]
    verified = verify_release(release_files, trust, state=_state(3, root, _statement_digest(release_files)))
    assert (verified.name, verified.version, verified.backend) == ("heart-mlp", 3, "sim")
    # root digest recomputed here from the files on disk with hashlib
    h = hashlib.sha256()
    for name in sorted(["labels.json", MODEL_FILE]):
        h.update(name.encode() + b"\0" + hashlib.sha256(release_files[name]).digest())
    assert verified.root_digest == h.hexdigest()
    assert set(verified.payload) == {"labels.json", MODEL_FILE}
    assert verified.payload[MODEL_FILE] is release_files[MODEL_FILE]  # the very bytes that were hashed
    assert verified.metadata == {"model_file": MODEL_FILE}
    assert verified.statement_digest == _statement_digest(release_files)


def test_trust_dir_pins_the_enclave_measurement(trust_dir, enclave):
    trust = load_trust_anchors(trust_dir)
    assert dict(trust.expected_pcrs) == {16: pcr_after([measure_release_enclave()])}
    assert trust.allow_insecure_sim and trust.allowed_backends == {"sim"}
    assert [keys.keyid(k) for k in trust.release_public_keys] == [keys.keyid(enclave.release_public_key)]
    for name in os.listdir(trust_dir):
        assert b"PRIVATE" not in (trust_dir / name).read_bytes()


def test_flipped_byte_in_model_refused(release_files, trust_dir):
    data = bytearray(release_files[MODEL_FILE])
    data[len(data) // 2] ^= 0x01
    _refused({**release_files, MODEL_FILE: bytes(data)}, load_trust_anchors(trust_dir), MODEL_FILE, "hash")


def test_truncated_model_refused(release_files, trust_dir):
    err = _refused({**release_files, MODEL_FILE: release_files[MODEL_FILE][:-1]},
                   load_trust_anchors(trust_dir), MODEL_FILE, "hash")
    assert "size" in str(err)


@pytest.mark.parametrize("edit", ["digest", "version", "consistent-digest", "metadata"])
def test_manifest_edits_refused(release_files, trust_dir, edit):
    manifest = json.loads(release_files["manifest.json"])
    if edit == "digest":
        manifest["files"][0]["sha256"] = hashlib.sha256(b"evil").hexdigest()
    elif edit == "version":
        manifest["version"] = 99
    elif edit == "consistent-digest":  # attacker rewrites the file, its digest and the root digest
        from sealfl.attestation.manifest import root_digest
        entry = next(e for e in manifest["files"] if e["path"] == MODEL_FILE)
        entry["sha256"] = hashlib.sha256(b"evil").hexdigest()
        entry["size"] = 4
        manifest["root_digest"] = root_digest({e["path"]: e["sha256"] for e in manifest["files"]})
    else:
        manifest["metadata"]["model_file"] = "labels.json"
    files = {**release_files, "manifest.json": canonical_json(manifest)}
    _refused(files, load_trust_anchors(trust_dir), "manifest.json", "manifest")


def test_dsse_signed_by_another_key_refused(release_files, trust_dir):
    envelope = json.loads(release_files["manifest.dsse.json"])
    import base64
    statement = base64.b64decode(envelope["payload"])
    forged = sign_envelope(statement, PAYLOAD_TYPE, keys.generate_key())
    files = {**release_files, "manifest.dsse.json": json.dumps(forged).encode()}
    _refused(files, load_trust_anchors(trust_dir), "manifest.dsse.json", "signature")


def test_attestation_with_other_measurement_refused(release_files, trust_dir, enclave):
    statement = bytes.fromhex(_statement_digest(release_files))
    # Same TEE (same pinned AK), rebooted, PCR 16 extended with a different code digest.
    tee = SimTEE.load(enclave.state_dir / "tee", reset_pcrs=True)
    tee.extend(16, hashlib.sha256(b"patched release enclave code").digest())
    quote = tee.quote("release", statement, [16])
    files = {**release_files, "attestation.json": canonical_json(build_attestation(quote))}
    err = _refused(files, load_trust_anchors(trust_dir), "attestation.json", "attestation")
    assert "PCR 16" in str(err)


def test_attestation_from_another_tee_refused(release_files, trust_dir, tmp_path):
    statement = bytes.fromhex(_statement_digest(release_files))
    rogue = SimTEE.create(tmp_path / "rogue")
    rogue.extend(16, measure_release_enclave())  # right measurement, wrong (unpinned) AK
    quote = rogue.quote("release", statement, [16])
    files = {**release_files, "attestation.json": canonical_json(build_attestation(quote))}
    _refused(files, load_trust_anchors(trust_dir), "attestation.json", "attestation")


def test_attestation_for_another_release_refused(release_files, trust_dir, enclave):
    stale = enclave.tee.quote("release", hashlib.sha256(b"some other statement").digest(), [16])
    files = {**release_files, "attestation.json": canonical_json(build_attestation(stale))}
    err = _refused(files, load_trust_anchors(trust_dir), "attestation.json", "attestation")
    assert "nonce" in str(err)


def test_kind_challenge_quote_is_not_a_release_attestation(release_files, trust_dir, enclave):
    """The issue's input: ReleaseEnclave.attest(nonce) with nonce = the release's root digest
    (or its statement digest) is a genuine quote by the pinned AK with the pinned PCRs, and
    still never passes as the release attestation."""
    root = json.loads(release_files["manifest.json"])["root_digest"]
    for nonce in (bytes.fromhex(root), bytes.fromhex(_statement_digest(release_files))):
        challenge = enclave.attest(nonce)
        files = {**release_files, "attestation.json": canonical_json(build_attestation(challenge))}
        err = _refused(files, load_trust_anchors(trust_dir), "attestation.json", "attestation")
        assert "purpose" in str(err)


def test_kind_attestation_is_bound_to_the_signed_statement_not_only_the_root(trust_dir, enclave, tmp_path):
    """v4 and v5 carry the same model bytes (same root digest); v4's attestation in v5's
    directory is refused, so an attestation cannot be carried over to another version."""
    from tests.support.releases import default_payload

    v4 = read_release_dir(Path(enclave.write_release(tmp_path / "v4", default_payload(), "heart-mlp", 4,
                                                     {"model_file": MODEL_FILE})["dir"]))
    v5 = read_release_dir(Path(enclave.write_release(tmp_path / "v5", default_payload(), "heart-mlp", 5,
                                                     {"model_file": MODEL_FILE})["dir"]))
    assert json.loads(v4["manifest.json"])["root_digest"] == json.loads(v5["manifest.json"])["root_digest"]
    files = {**v5, "attestation.json": v4["attestation.json"]}
    err = _refused(files, load_trust_anchors(trust_dir), "attestation.json", "attestation")
    assert "nonce" in str(err)


def test_kind_version_one_attestation_is_refused(release_files, trust_dir, enclave):
    doc = json.loads(release_files["attestation.json"])
    doc["schema"] = "sealfl.release-attestation/v1"
    files = {**release_files, "attestation.json": canonical_json(doc)}
    _refused(files, load_trust_anchors(trust_dir), "attestation.json", "attestation")


def test_sim_attestation_refused_when_policy_forbids_insecure(release_files, trust_dir):
    trust = dataclasses.replace(load_trust_anchors(trust_dir), allow_insecure_sim=False)
    _refused(release_files, trust, "attestation.json", "attestation")


@pytest.mark.parametrize("name", ["labels.json", MODEL_FILE, "manifest.dsse.json", "attestation.json",
                                  "manifest.json"])
def test_missing_file_refused(release_files, trust_dir, name):
    files = {k: v for k, v in release_files.items() if k != name}
    _refused(files, load_trust_anchors(trust_dir), name, "missing-file")


def test_extra_file_refused(release_files, trust_dir):
    files = {**release_files, "notes.txt": b"not signed"}
    _refused(files, load_trust_anchors(trust_dir), "notes.txt", "extra-file")


def test_rollback_and_min_version_refused(release_files, trust_dir):
    trust = load_trust_anchors(trust_dir)
    root, statement = json.loads(release_files["manifest.json"])["root_digest"], _statement_digest(release_files)
    _refused(release_files, trust, "manifest.json", "rollback", state=_state(4, root, statement))
    verify_release(release_files, trust, state=_state(3, root, statement))  # the same release again is fine
    # the same version as another signed release (other statement, even with the same root) is not
    _refused(release_files, trust, "manifest.json", "rollback", state=_state(3, root, "1" * 64))
    _refused(release_files, trust, "manifest.json", "rollback", state=_state(3, "2" * 64, None))  # v1 state
    verify_release(release_files, trust, state=_state(3, root, None))  # v1 state: same root = re-boot
    _refused(release_files, dataclasses.replace(trust, min_version=4), "manifest.json", "version")


def test_kind_version_jump_over_policy_step_refused(release_files, trust_dir):
    trust = load_trust_anchors(trust_dir)
    assert trust.max_version_step == 1000  # the default, written into policy.json
    verify_release(release_files, dataclasses.replace(trust, max_version_step=1), state=_state(2))
    err = _refused(release_files, dataclasses.replace(trust, max_version_step=1), "manifest.json", "version",
                   state=_state(1))
    assert "max_version_step" in str(err)
    verify_release(release_files, trust, state=None)  # a fresh device has no floor to jump from


def test_mutable_bytes_refused(release_files, trust_dir):
    files = {**release_files, MODEL_FILE: bytearray(release_files[MODEL_FILE])}
    _refused(files, load_trust_anchors(trust_dir), MODEL_FILE, "read")


def test_read_release_dir_reads_regular_files_only(release_dir, tmp_path):
    files = read_release_dir(release_dir)
    assert files[MODEL_FILE] == (release_dir / MODEL_FILE).read_bytes()
    assert sorted(files) == sorted(os.listdir(release_dir))
    with pytest.raises(VerificationError) as info:
        read_release_dir(release_dir, max_file_bytes=8)
    assert info.value.check == "size"

    (tmp_path / "outside").write_bytes(b"x")
    os.symlink(tmp_path / "outside", release_dir / "link.onnx")
    with pytest.raises(VerificationError) as info:
        read_release_dir(release_dir)
    assert (info.value.file, info.value.check) == ("link.onnx", "file-type")
    os.unlink(release_dir / "link.onnx")

    (release_dir / "sub").mkdir()
    with pytest.raises(VerificationError) as info:
        read_release_dir(release_dir)
    assert (info.value.file, info.value.check) == ("sub", "file-type")

    with pytest.raises(VerificationError) as info:
        read_release_dir(tmp_path / "does-not-exist")
    assert info.value.check == "read"


def test_trust_dir_errors(tmp_path, trust_dir):
    with pytest.raises(TrustAnchorError, match="cannot read"):
        load_trust_anchors(tmp_path / "empty")
    policy = json.loads((trust_dir / "policy.json").read_bytes())
    policy["ak_keyid"] = "0" * 64
    (trust_dir / "policy.json").write_text(json.dumps(policy))
    with pytest.raises(TrustAnchorError, match="ak_keyid"):
        load_trust_anchors(trust_dir)


def test_deeply_nested_json_is_a_verification_error_not_a_crash():
    from sealfl.attestation.canonical import JSONFormatError, loads_strict

    with pytest.raises(JSONFormatError, match="nested"):
        loads_strict(b"[" * 100_000)


def test_kind_versions_are_bounded_everywhere(release_files, trust_dir, enclave, tmp_path):
    """The issue's input: a validly signed release of version 2**62 would have become the
    device's rollback floor for good. Versions are 0..2**31-1 in manifest, statement, policy
    and device state; the signed 2**62 release is refused at the statement."""
    import base64

    from sealfl.attestation.manifest import MAX_VERSION, build_manifest
    from sealfl.enclave.errors import ReleaseWriteError

    assert MAX_VERSION == 2147483647
    for bad in (2**31, 2**62, -1):
        with pytest.raises(Exception) as info:
            build_manifest({"m.onnx": b"x"}, "n", bad)
        assert "version" in str(info.value)
        with pytest.raises(ReleaseWriteError):
            enclave.write_release(tmp_path / f"v{bad}", {"m.onnx": b"x"}, "n", bad)
    envelope = json.loads(release_files["manifest.dsse.json"])
    statement = json.loads(base64.b64decode(envelope["payload"]))
    manifest = json.loads(release_files["manifest.json"])
    statement["predicate"]["version"] = manifest["version"] = 2**62
    payload = canonical_json(statement)
    files = {**release_files, "manifest.json": canonical_json(manifest),
             "manifest.dsse.json": json.dumps(sign_envelope(payload, PAYLOAD_TYPE, enclave._key)).encode(),
             "attestation.json": canonical_json(build_attestation(
                 enclave.tee.quote("release", hashlib.sha256(payload).digest(), [16])))}
    err = _refused(files, load_trust_anchors(trust_dir), "manifest.dsse.json", "statement")
    assert "'predicate.version'" in str(err) and "2147483647" in str(err)
    statement["predicate"]["version"] = manifest["version"] = MAX_VERSION  # the bound itself is a version
    payload = canonical_json(statement)
    files = {**release_files, "manifest.json": canonical_json(manifest),
             "manifest.dsse.json": json.dumps(sign_envelope(payload, PAYLOAD_TYPE, enclave._key)).encode(),
             "attestation.json": canonical_json(build_attestation(
                 enclave.tee.quote("release", hashlib.sha256(payload).digest(), [16])))}
    files["model.sig"] = resigned_model_sig(files, enclave._key)
    assert verify_release(files, load_trust_anchors(trust_dir)).version == MAX_VERSION
