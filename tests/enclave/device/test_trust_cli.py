"""The trust CLI end to end on a real swtpm: provision -> boot -> attest -> attest verify;
a wrong nonce is refused; a device whose TEE state was wiped exits 4 until re-provisioned."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tests.support.releases import default_payload


def _cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ), cwd=cwd)


def test_kind_cli_attestation_round_trip_and_wiped_tee_exit_code(swtpm, trust_dir, enclave, tmp_path):
    state, ak = tmp_path / "device", tmp_path / "ak.pem"
    rel = tmp_path / "release-v3"
    enclave.write_release(rel, default_payload(), "heart-mlp", 3, {"model_file": "model.int8.onnx"})
    out = _cli("device", "provision", "--state", state, "--tee", "tpm", "--export-ak", ak)
    assert out.returncode == 0, out.stderr
    out = _cli("device", "boot", "--release", rel, "--trust", trust_dir, "--state", state)
    assert out.returncode == 0, out.stderr
    nonce = os.urandom(32).hex()
    ev = tmp_path / "evidence.json"
    out = _cli("device", "attest", "--state", state, "--nonce", nonce, "--out", ev)
    assert out.returncode == 0, out.stderr
    assert json.loads(ev.read_text())["quote"]["backend"] == "tpm"
    policy = tmp_path / "policy.json"
    out = _cli("attest", "policy", "--trust", trust_dir, "--release", rel, "--tee", "tpm", "--out", policy)
    assert out.returncode == 0, out.stderr
    out = _cli("attest", "verify", "--evidence", ev, "--ak", ak, "--nonce", nonce, "--policy", policy)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["verified"] is True
    out = _cli("attest", "verify", "--evidence", ev, "--ak", ak, "--nonce", "00" * 32, "--policy", policy)
    assert out.returncode == 1 and "nonce" in out.stderr
    shutil.rmtree(state / "tee")
    out = _cli("device", "boot", "--release", rel, "--trust", trust_dir, "--state", state)
    assert out.returncode == 4 and "provision" in out.stderr
    out = _cli("device", "provision", "--state", state, "--tee", "tpm")
    assert out.returncode == 1 and "--force" in out.stderr
    assert _cli("device", "provision", "--state", state, "--tee", "tpm", "--force").returncode == 0
    out = _cli("device", "boot", "--release", rel, "--trust", trust_dir, "--state", state)
    assert out.returncode == 0, out.stderr
