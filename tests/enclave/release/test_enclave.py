"""ReleaseEnclave: sealed release key, measurement binding, atomic release writing, secrets."""

from __future__ import annotations

import os
import stat

import pytest

from sealfl.attestation import keys
from sealfl.attestation.quote import pcr_after
from sealfl.attestation.release import read_release_dir, verify_release
from sealfl.enclave import measurement as measure
from sealfl.enclave.errors import ReleaseWriteError, SecretNotFoundError, TEEStateError, UnsealError
from sealfl.enclave.release.enclave import ReleaseEnclave
from tests.support.releases import MODEL_FILE, default_payload


def test_open_unseals_the_same_key(enclave):
    reopened = ReleaseEnclave.open(enclave.state_dir)
    assert keys.keyid(reopened.release_public_key) == keys.keyid(enclave.release_public_key)
    assert reopened.measurement == {16: pcr_after([measure.measure_release_enclave()])}
    sealed = (enclave.state_dir / "release_key.sealed").read_bytes()
    assert b"PRIVATE KEY" not in sealed
    assert stat.S_IMODE(os.stat(enclave.state_dir / "release_key.sealed").st_mode) == 0o600


def test_open_fails_when_measurement_changes(enclave, monkeypatch):
    monkeypatch.setattr(measure, "measure_release_enclave", lambda: b"\x42" * 32)
    with pytest.raises(UnsealError, match="measurement changed"):
        ReleaseEnclave.open(enclave.state_dir)


def test_create_refuses_non_empty_dir(enclave):
    with pytest.raises(TEEStateError):
        ReleaseEnclave.create(enclave.state_dir)


def test_write_release_layout_and_self_verification(enclave, tmp_path):
    out = tmp_path / "releases" / "v1"
    summary = enclave.write_release(out, default_payload(), "heart-mlp", 1, {"model_file": MODEL_FILE})
    assert summary["dir"] == str(out) and summary["backend"] == "sim"
    assert sorted(os.listdir(out)) == sorted(["attestation.json", "labels.json", "manifest.dsse.json",
                                               "manifest.json", "model.sig", MODEL_FILE]) == summary["files"]
    assert os.listdir(tmp_path / "releases") == ["v1"]  # no temp dir left behind
    verified = verify_release(read_release_dir(out), enclave.trust_anchors())
    assert verified.root_digest == summary["root_digest"]
    assert verified.payload[MODEL_FILE] == default_payload()[MODEL_FILE]


def test_write_release_refuses_non_empty_out_dir_and_bad_payloads(enclave, tmp_path):
    out = tmp_path / "occupied"
    out.mkdir()
    (out / "something").write_bytes(b"x")
    with pytest.raises(ReleaseWriteError, match="not an empty directory"):
        enclave.write_release(out, default_payload(), "n", 1)
    assert os.listdir(out) == ["something"]
    for bad in ({"manifest.json": b"x"}, {"../evil.onnx": b"x"}, {"sub/model.onnx": b"x"}, {}):
        with pytest.raises(ReleaseWriteError):
            enclave.write_release(tmp_path / "new", bad, "n", 1)
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    enclave.write_release(empty, default_payload(), "n", 1)  # an empty dir is fine
    assert (empty / "manifest.json").exists()


def test_export_trust_refuses_overwrite(enclave, tmp_path):
    enclave.export_trust(tmp_path / "trust")
    with pytest.raises(Exception, match="overwrite"):
        enclave.export_trust(tmp_path / "trust")
    enclave.export_trust(tmp_path / "trust", min_version=2, overwrite=True)


def test_sealed_secrets(enclave, monkeypatch):
    enclave.seal_secret("ckks-secret-context", b"\x00secret context bytes")
    assert enclave.list_secrets() == ["ckks-secret-context"]
    assert enclave.unseal_secret("ckks-secret-context") == b"\x00secret context bytes"
    reopened = ReleaseEnclave.open(enclave.state_dir)
    assert reopened.unseal_secret("ckks-secret-context") == b"\x00secret context bytes"
    with pytest.raises(SecretNotFoundError):
        reopened.unseal_secret("nope")
    with pytest.raises(Exception, match="secret name"):
        reopened.seal_secret("../escape", b"x")
    reopened.tee.extend(16, b"\x01" * 32)  # enclave state no longer matches the policy
    with pytest.raises(UnsealError):
        reopened.unseal_secret("ckks-secret-context")


def test_crash_while_writing_leaves_nothing(enclave, tmp_path, monkeypatch):
    from sealfl.enclave.release import enclave as module

    calls = []
    real = module.atomic_write

    def failing(path, data, mode=0o600):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(path, data, mode)

    monkeypatch.setattr(module, "atomic_write", failing)
    with pytest.raises(ReleaseWriteError, match="No space"):
        enclave.write_release(tmp_path / "out" / "v1", default_payload(), "n", 1)
    assert os.listdir(tmp_path / "out") == []  # neither v1 nor a temp dir
