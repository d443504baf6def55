"""``sealfl release delta`` -> ``sealfl repo publish --delta`` -> ``sealfl device update``,
as real CLI processes against a real repository served on loopback (issue 21 item 7)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from sealfl.attestation.repo_index import TUF_ROOT_FILE
from sealfl.clients.heart.data import HOSPITALS
from sealfl.enclave.device.boot import boot, read_device_state
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.platform.consortium import create_consortium
from sealfl.platform.release import enclave_dir, provision_release_enclave, trust_dir
from sealfl.platform.repo.repository import Repository
from sealfl.platform.repo.server import RepoServer
from tests.support.tufrepo import NAME, new_release


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_release_delta_published_and_applied_by_the_cli(tmp_path):
    cons, codec = create_consortium(tmp_path / "cons", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    enclave = ReleaseEnclave.open(enclave_dir(cons))
    v3 = new_release(enclave, tmp_path / "v3", 3, weight=0.5)
    v4 = new_release(enclave, tmp_path / "v4", 4, weight=2.5)
    out = _cli("release", "delta", v3, v4, "-o", tmp_path / "delta", "-c", cons.dir, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (doc["base_version"], doc["version"], doc["name"]) == (3, 4, NAME)
    assert "model.int8.onnx" in doc["patched"] and (tmp_path / "delta" / "delta.dsse.json").is_file()
    again = _cli("release", "delta", v3, v4, "-o", tmp_path / "delta", "-c", cons.dir)
    assert again.returncode == 1 and "not an empty directory" in " ".join(again.stderr.split())

    trust = tmp_path / "trust"
    shutil.copytree(trust_dir(cons), trust)
    assert _cli("repo", "init", tmp_path / "repo", "--offline-keys", tmp_path / "offline", "--trust",
                trust).returncode == 0
    assert (trust / TUF_ROOT_FILE).is_file()
    wrong = _cli("repo", "publish", tmp_path / "repo", v3, "--trust", trust, "--delta", tmp_path / "delta")
    assert wrong.returncode == 1 and "not this release" in " ".join(wrong.stderr.split())
    pub = _cli("repo", "publish", tmp_path / "repo", v4, "--trust", trust, "--delta", tmp_path / "delta")
    assert pub.returncode == 0, pub.stderr
    assert "published the delta from v3" in pub.stdout

    boot(trust, v3, tmp_path / "dev", backend="sim").close()
    boot(trust, v3, tmp_path / "dev-full", backend="sim").close()
    with RepoServer(Repository(tmp_path / "repo").www) as server:
        up = _cli("device", "update", "--trust", trust, "--state", tmp_path / "dev", "--repo", server.url,
                  "--tee", "sim", "--json")
        full = _cli("device", "update", "--trust", trust, "--state", tmp_path / "dev-full", "--repo", server.url,
                    "--tee", "sim", "--no-delta", "--json")
    assert full.returncode == 0, full.stderr
    assert json.loads(full.stdout.strip().splitlines()[-1])["via"] == "full"
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout.strip().splitlines()[-1]) | {"root_digest": None} == {
        "action": "installed", "name": NAME, "version": 4, "root_digest": None, "via": "delta", "delta_refused": None}
    assert read_device_state(tmp_path / "dev").last_good.version == 4
