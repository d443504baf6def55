"""``sealfl repo publish --encrypt-at-rest``: the release re-signed with its model encrypted,
published, its key registered at the key broker -> a real ``sealfl kbs serve`` on loopback ->
``sealfl device update --key-broker`` installs and runs it; a device the broker does not know
is refused (real CLI processes, issue 21 item 6)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sealfl.attestation.repo_index import TUF_ROOT_FILE
from sealfl.clients.heart.data import HOSPITALS
from sealfl.enclave.device.boot import boot_last_good, read_device_state
from sealfl.enclave.device.kbs_client import broker_key_source
from sealfl.enclave.device.provision import provision
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.platform.consortium import create_consortium
from sealfl.platform.release import enclave_dir, provision_release_enclave, trust_dir
from sealfl.platform.repo.repository import Repository
from sealfl.platform.repo.server import RepoServer
from tests.enclave.keybroker.test_kbs import _free_port, _wait_listening
from tests.support.releases import MODEL_FILE, WEIGHTS, direct_outputs, make_onnx_model, sample_inputs
from tests.support.tufrepo import NAME, new_release

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def _cli(*args, timeout=300):
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], capture_output=True,
                         text=True, timeout=timeout, env=ENV)
    return out.returncode, out.stdout, " ".join(out.stderr.split())


def _weights(w0: float):
    w = WEIGHTS.copy()
    w[0, 0] = np.float32(w0)
    return w


@pytest.mark.slow
def test_publish_encrypted_at_rest_registers_the_key_and_a_known_device_runs_it(tmp_path):
    cons, codec = create_consortium(tmp_path / "cons", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    enclave = ReleaseEnclave.open(enclave_dir(cons))
    trust = tmp_path / "trust"
    shutil.copytree(trust_dir(cons), trust)
    repo = tmp_path / "repo"
    assert _cli("repo", "init", repo, "--offline-keys", tmp_path / "offline", "--trust", trust)[0] == 0
    device, stranger = tmp_path / "device", tmp_path / "stranger"
    ak = tmp_path / "device-ak.pem"
    ak.write_bytes(provision(device, "sim").public_key())
    provision(stranger, "sim")  # a device whose AK the broker was never given
    policy, keys = tmp_path / "kbs" / "policy.json", tmp_path / "kbs" / "keys.json"
    policy.parent.mkdir()
    code, _, err = _cli("attest", "policy", "--trust", trust, "--tee", "sim", "-o", policy)
    assert code == 0, err
    at_rest = ("--encrypt-at-rest", "-c", cons.dir, "--kbs-keys", keys, "--kbs-policy", policy)

    v3 = new_release(enclave, tmp_path / "v3", 3, weight=0.5)
    code, out, err = _cli("repo", "publish", repo, v3, "--trust", trust, *at_rest)
    assert code == 0, err
    assert "encrypted at rest" in out and str(keys) in out
    assert keys.stat().st_mode & 0o777 == 0o600
    (root3,) = json.loads(keys.read_bytes())
    assert json.loads(policy.read_bytes())["release_root"] == [root3]
    # the repository holds the ciphertext only: no target carries the plaintext model bytes
    plain = (v3 / MODEL_FILE).read_bytes()
    served = [p.read_bytes() for p in (repo / "www" / "targets").rglob("*") if p.is_file()]
    assert served and not any(plain in data for data in served)
    assert any(p.name.endswith(".enc") for p in (repo / "www" / "targets").rglob("*"))

    port = _free_port()
    kbs = subprocess.Popen([sys.executable, "-m", "sealfl.platform.cli", "kbs", "serve", "--policy", str(policy),
                            "--ak", str(ak), "--keys", str(keys), "--port", str(port)], env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_listening(kbs, port)
        kbs_url = f"http://127.0.0.1:{port}"
        with RepoServer(Repository(repo).www) as server:
            update = ("device", "update", "--trust", trust, "--repo", server.url, "--name", NAME,
                      "--key-broker", kbs_url, "--json")
            code, out, err = _cli(*update, "--state", device)
            assert code == 0, err
            assert json.loads(out)["action"] == "installed"
            assert read_device_state(device).last_good.root_digest == root3
            x = sample_inputs(4)
            with boot_last_good(trust, device, key_source=broker_key_source(kbs_url)) as dev:
                np.testing.assert_array_equal(dev.predict(x), direct_outputs(make_onnx_model(_weights(0.5)), x))

            code, out, err = _cli(*update, "--state", stranger)  # the broker does not know this device
            assert code == 2 and "nothing runs" in err, err
            assert "is not a registered device" in err, err
            assert read_device_state(stranger).last_good is None

            # a release published while the broker runs: it re-reads its files, no restart
            v4 = new_release(enclave, tmp_path / "v4", 4, weight=2.5)
            code, _, err = _cli("repo", "publish", repo, v4, "--trust", trust, *at_rest)
            assert code == 0, err
            code, out, err = _cli(*update, "--state", device)
            assert code == 0 and json.loads(out)["version"] == 4, err
            with boot_last_good(trust, device, key_source=broker_key_source(kbs_url)) as dev:
                np.testing.assert_array_equal(dev.predict(x), direct_outputs(make_onnx_model(_weights(2.5)), x))
        assert len(json.loads(keys.read_bytes())) == 2
    finally:
        os.kill(kbs.pid, signal.SIGTERM)
        kbs.wait(timeout=60)
    assert (trust / TUF_ROOT_FILE).is_file()


def test_publish_encrypted_needs_its_options_and_refuses_a_delta(tmp_path, enclave, trust_dir):
    Repository.init(tmp_path / "repo", tmp_path / "offline")
    rel = new_release(enclave, tmp_path / "r3", 3)
    code, _, err = _cli("repo", "publish", tmp_path / "repo", rel, "--trust", trust_dir, "--encrypt-at-rest")
    assert code == 1 and "needs --consortium DIR" in err and "--kbs-keys FILE" in err
    code, _, err = _cli("repo", "publish", tmp_path / "repo", rel, "--trust", trust_dir, "--kbs-keys", tmp_path / "k")
    assert code == 1 and "go with --encrypt-at-rest" in err
    assert not (tmp_path / "k").exists()
