"""``device update`` from a real repository served over loopback HTTP, and ``device status``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sealfl.enclave.device.boot import boot_last_good, read_device_state
from sealfl.enclave.device.status import device_status
from sealfl.enclave.device.update import update
from sealfl.enclave.errors import UpdateError
from sealfl.platform.repo.keys import RepoError
from sealfl.platform.repo.server import RepoServer
from tests.support.releases import WEIGHTS, direct_outputs, make_onnx_model, sample_inputs
from tests.support.tufrepo import NAME, make_repo, new_release, provision_trust, publish_verified


@pytest.fixture
def served(tmp_path, enclave, trust_dir):
    repo = make_repo(tmp_path)
    provision_trust(trust_dir, repo)
    with RepoServer(repo.www) as server:
        yield repo, server


def test_update_installs_newest_then_is_up_to_date_then_follows_a_new_release(tmp_path, enclave, trust_dir, served):
    repo, server = served
    state = tmp_path / "device"
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r3", 3))
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r4", 4, weight=0.75))
    res = update(trust_dir, server.url, state, name=NAME, backend="sim")
    assert (res.action, res.version, res.exit_code) == ("installed", 4, 0)
    lg = read_device_state(state).last_good
    assert (lg.name, lg.version) == (NAME, 4)
    # the staging directory is gone; what runs is the device's slot copy, and it is v4's model
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".device.update-")]
    w = WEIGHTS.copy()
    w[0, 0] = 0.75
    x = sample_inputs(4)
    with boot_last_good(trust_dir, state) as dev:
        np.testing.assert_array_equal(dev.predict(x), direct_outputs(make_onnx_model(w), x))
    assert update(trust_dir, server.url, state).action == "current"
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r5", 5, weight=1.5))
    res = update(trust_dir, server.url, state)
    assert (res.action, res.version) == ("installed", 5)
    s = device_status(state)
    assert s["release"]["version"] == 5 and s["release"]["root_digest"] == res.root_digest
    assert s["release"]["source"] == {"kind": "repository", "repo": server.url, "at": s["release"]["source"]["at"]}
    assert s["tee_backend"] == "sim" and s["insecure"] is True and s["rollback_floor"] == 5
    assert s["last_update"]["result"] == "installed"


def test_update_without_a_tuf_root_is_refused_naming_the_file(tmp_path, enclave, trust_dir):
    repo = make_repo(tmp_path)
    with RepoServer(repo.www) as server, pytest.raises(UpdateError, match="tuf-root.json missing") as e:
        update(trust_dir, server.url, tmp_path / "device", name=NAME, backend="sim")
    assert e.value.stage == "trust"
    assert device_status(tmp_path / "device")["last_update"]["result"] == "refused"


def test_update_of_an_unknown_name_is_refused(tmp_path, enclave, trust_dir, served):
    repo, server = served
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r3", 3))
    with pytest.raises(UpdateError, match="no release named other"):
        update(trust_dir, server.url, tmp_path / "device", name="other", backend="sim")


@pytest.mark.slow
def test_cli_update_and_status(tmp_path, enclave, trust_dir, served):
    repo, server = served
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r3", 3))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    cli = [sys.executable, "-m", "sealfl.platform.cli", "device"]
    state = tmp_path / "device"
    r = subprocess.run([*cli, "update", "--trust", str(trust_dir), "--state", str(state), "--repo", server.url,
                        "--name", NAME, "--tee", "sim", "--json"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["action"] == "installed"
    r = subprocess.run([*cli, "status", "--state", str(state), "--json"], capture_output=True, text=True, env=env,
                       timeout=120)
    s = json.loads(r.stdout)
    assert (s["release"]["name"], s["release"]["version"], s["release"]["source"]["kind"]) == (NAME, 3, "repository")
    r = subprocess.run([*cli, "status", "--state", str(state)], capture_output=True, text=True, env=env, timeout=120)
    assert f"release: {NAME} v3" in r.stdout and "rollback floor: v3" in r.stdout and "TEE backend: sim" in r.stdout
    # an unreachable repository: refused, exit 3, v3 still recorded
    (trust_dir / "tuf-root.json").unlink()  # the device keeps its own root from now on
    r = subprocess.run([*cli, "update", "--trust", str(trust_dir), "--state", str(state), "--repo",
                        "http://127.0.0.1:1", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 3 and "update refused (download)" in r.stderr, r.stderr
    assert json.loads(r.stdout)["action"] == "refused" and json.loads(r.stdout)["stage"] == "download"
    assert read_device_state(state).last_good.version == 3


def test_tuf_client_refuses_target_paths_that_leave_the_target_dir(tmp_path):
    from sealfl.enclave.device.tuf_client import _local_path

    assert _local_path(tmp_path, "a/b.txt") == tmp_path / "a" / "b.txt"
    for bad in ("../x", "a/../../x", "/etc/passwd", "a//b", ""):
        with pytest.raises(UpdateError, match="would leave the target directory"):
            _local_path(tmp_path, bad)


def test_device_follows_root_and_targets_key_rotations(tmp_path, enclave, trust_dir, served):
    repo, server = served
    state = tmp_path / "device"
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r3", 3))
    assert update(trust_dir, server.url, state, name=NAME, backend="sim").action == "installed"
    assert repo.rotate("root", tmp_path / "offline", tmp_path / "offline-2") == 2
    assert repo.rotate("targets", tmp_path / "offline-2") == 3  # signed by the new root keys only
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r4", 4, weight=1.0))
    assert update(trust_dir, server.url, state).version == 4
    # the device now trusts root v3 (kept in its own metadata), not the provisioned v1
    assert json.loads((state / "tuf" / "root.json").read_bytes())["signed"]["version"] == 3
    # the old root keys can no longer sign for it
    with pytest.raises(RepoError, match="root threshold"):
        repo.rotate("snapshot", tmp_path / "offline")
