"""Release pipeline -> `sealfl verify` (the real CLI, in a subprocess) -> device boot.

The campaign is replaced by a checkpoint encrypted under the consortium's CKKS context
(no Ray needed): the release enclave must decrypt it to the same parameters.
"""

import base64
import json
import shutil
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from sealfl.attestation.bundle import build_attestation
from sealfl.attestation.dsse import sign_envelope
from sealfl.attestation.keys import generate_key
from sealfl.clients.data import HOSPITALS, load_partitions
from sealfl.clients.stats import local_sums
from sealfl.clients.task import HeartTask, TrainConfig
from sealfl.enclave.device import boot
from sealfl.enclave.release_enclave import ReleaseEnclave
from sealfl.platform.consortium import create_consortium
from sealfl.platform.errors import ReleaseError
from sealfl.platform.release import MODEL_FILE, enclave_dir, provision_release_enclave, release, trust_dir
from sealfl.server.bookkeeping import save_checkpoint


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("rel")
    cons, codec = create_consortium(root / "c", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    parts = load_partitions()
    x = np.concatenate([p.x_train for p in parts])
    y = np.concatenate([p.y_train for p in parts])
    task = HeartTask()
    params, _ = task.train(task.init_params(), x, y, x.mean(0), x.std(0), TrainConfig(local_epochs=10), 0)
    weights = np.array([p.n_train for p in parts], dtype=np.float64)
    # as the aggregator would hold it: E(sum n_i w) with the same w at every partner
    model_ct = codec.encrypt(params * weights.sum())
    stats_ct = codec.encrypt(sum(local_sums(p.x_train) for p in parts))
    save_checkpoint(root / "camp", 3, model_ct, float(weights.sum()), stats_ct)
    res = release(cons.dir, root / "camp", root / "release", version=2)
    return {"root": root, "cons": cons, "params": params, "res": res, "x": x}


def _verify(trust, rel):
    return subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "verify", "--trust", str(trust), str(rel)],
                          capture_output=True, text=True, timeout=120)


def test_release_decrypts_to_the_trained_model(built):
    np.testing.assert_allclose(built["res"].params, built["params"], atol=1e-6)
    acc = built["res"].accuracy
    assert acc["int8"]["pooled"] >= acc["fp32"]["pooled"] - 0.01
    assert acc["fp32"]["n"] == sum(len(p.y_test) for p in load_partitions())


def test_verify_accepts_the_untouched_release(built):
    r = _verify(trust_dir(built["cons"]), built["root"] / "release")
    assert r.returncode == 0, r.stderr
    assert built["res"].summary["root_digest"] in r.stdout


def _copy(built, tmp_path):
    d = tmp_path / "release"
    shutil.copytree(built["root"] / "release", d)
    return d


def _flip_onnx(d, built):
    p = d / MODEL_FILE
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x01
    p.write_bytes(bytes(b))


def _edit_manifest(d, built):
    m = json.loads((d / "manifest.json").read_text())
    m["version"] = m["version"] + 1
    (d / "manifest.json").write_text(json.dumps(m))


def _other_signer(d, built):
    env = json.loads((d / "manifest.dsse.json").read_text())
    payload = base64.b64decode(env["payload"])
    (d / "manifest.dsse.json").write_text(json.dumps(sign_envelope(payload, env["payloadType"], generate_key())))


def _other_measurement(d, built):
    # the same enclave (same attestation key) after running other code: PCR 16 differs
    enclave = ReleaseEnclave.open(enclave_dir(built["cons"]))
    enclave.tee.extend(16, b"\x42" * 32)
    root_digest = bytes.fromhex(built["res"].summary["root_digest"])
    (d / "attestation.json").write_text(json.dumps(build_attestation(enclave.attest(root_digest))))


def _missing(d, built):
    (d / MODEL_FILE).unlink()


def _extra(d, built):
    (d / "notes.txt").write_text("not in the manifest")


@pytest.mark.parametrize("tamper, file, check", [
    (_flip_onnx, MODEL_FILE, "hash"),
    (_edit_manifest, "manifest.json", "manifest"),
    (_other_signer, "manifest.dsse.json", "signature"),
    (_other_measurement, "attestation.json", "attestation"),
    (_missing, MODEL_FILE, "missing-file"),
    (_extra, "notes.txt", "extra-file"),
])
def test_verify_refuses_tampering(built, tmp_path, tamper, file, check):
    d = _copy(built, tmp_path)
    tamper(d, built)
    r = _verify(trust_dir(built["cons"]), d)
    assert r.returncode != 0
    msg = " ".join(r.stderr.split())
    assert file in msg and check in msg, msg


def test_device_outputs_equal_direct_onnxruntime(built, tmp_path):
    int8 = (built["root"] / "release" / MODEL_FILE).read_bytes()
    x = np.concatenate([p.x_test for p in load_partitions()]).astype(np.float32)
    direct = ort.InferenceSession(int8, providers=["CPUExecutionProvider"]).run(None, {"features": x})[0]
    with boot(trust_dir(built["cons"]), built["root"] / "release", tmp_path / "dev") as dev:
        on_device = dev.predict(x)
        assert dev.release.version == 2
    np.testing.assert_array_equal(np.asarray(on_device), direct)


def test_gate_refuses_and_writes_nothing(built, tmp_path):
    with pytest.raises(ReleaseError, match="not releasing"):
        release(built["cons"].dir, built["root"] / "camp", tmp_path / "r2", version=3, max_drop=-1.0)
    assert not (tmp_path / "r2").exists()
