"""A device installs only its extra (onnxruntime, onnx, pycryptodome, numpy, the CLI and API
libraries; verification itself no longer imports onnx): the verify/boot path and the CLI must not
import torch, TenSEAL, Flower or Ray, not even while verifying a release."""

import subprocess
import sys

HEAVY = ("torch", "tenseal", "flwr", "ray")
#: model.sig is checked by sealfl's own code: OpenSSF's signing stack stays off the device
SIGNING_STACK = ("model_signing", "sigstore", "sigstore_models", "in_toto_attestation", "OpenSSL")


def _imported_after(code: str) -> set[str]:
    probe = code + "\nimport sys\nprint(' '.join(sorted(m for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_device_path_imports_no_training_stack():
    mods = _imported_after(
        "import sealfl.enclave.device.boot, sealfl.enclave.device.verify, sealfl.attestation.release, sealfl.platform.cli")
    assert "sealfl.enclave.device.boot" in mods  # the probe did import the device path
    assert not {m for m in mods if m.split(".")[0] in HEAVY}


def test_verifying_a_release_imports_no_training_stack(tmp_path):
    from sealfl.enclave.release.enclave import ReleaseEnclave
    from tests.support.releases import MODEL_FILE, default_payload

    enclave = ReleaseEnclave.create(tmp_path / "enclave")
    trust = enclave.export_trust(tmp_path / "trust")
    enclave.write_release(tmp_path / "release", default_payload(), "heart-mlp", 1, {"model_file": MODEL_FILE})
    mods = _imported_after(
        "from sealfl.enclave.device.verify import verify_dir\n"
        f"assert verify_dir({str(trust)!r}, {str(tmp_path / 'release')!r}).version == 1")
    assert "sealfl.attestation.onnx_wire" in mods  # the external-data check ran (on the wire format)
    assert "onnx" not in mods  # ... without the onnx package (issue 24: no parse, no copy of the weights)
    assert "sealfl.attestation.model_sig" in mods  # model.sig was checked
    assert not {m for m in mods if m.split(".")[0] in HEAVY + SIGNING_STACK}


def test_cli_help_lists_every_persona():
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for cmd in ("consortium", "campaign", "release", "partner", "device", "verify", "demo"):
        assert cmd in out


def test_campaign_status_reports_a_dead_aggregator(tmp_path):
    # a pid that is certainly gone: a child we started and reaped
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(p.stdout)
    (tmp_path / "status.json").write_text(f'{{"status": "running", "round": 3, "num_rounds": 9, "pid": {dead}}}')
    (tmp_path / "rounds.jsonl").write_text('{"round": 1, "pooled_test_accuracy": 0.8}\n{"round": 2, "pooled')
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "campaign", "status", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "stopped unexpectedly" in text and "0.800" in text
