"""The repository floor over a real repository served over loopback: a floor set under root
keys that ``sealfl repo rotate root`` revokes is re-based, and the device ends running the
newest release (:mod:`sealfl.enclave.device.update_trust`)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sealfl.attestation.repo_floor import REPO_FLOOR_FILE, RepoFloor
from sealfl.enclave.device.boot import read_device_state
from sealfl.enclave.device.status import device_status, format_status
from sealfl.enclave.device.update import read_update_record, update
from sealfl.enclave.errors import UpdateError
from sealfl.platform.repo.server import RepoServer
from tests.support.tufrepo import NAME, make_repo, new_release, provision_trust, publish_verified

REPO_ROOT = Path(__file__).resolve().parents[3]


def _floor(state: Path) -> RepoFloor:
    return RepoFloor.from_bytes((state / REPO_FLOOR_FILE).read_bytes())


def test_floor_of_rotated_root_keys_is_rebased_and_the_newest_release_runs(tmp_path, enclave, trust_dir):
    repo = make_repo(tmp_path)
    provision_trust(trust_dir, repo)
    state = tmp_path / "device"
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r3", 3))
    with RepoServer(repo.www) as server:
        assert update(trust_dir, server.url, state, name=NAME, backend="sim").action == "installed"
        r1 = repo.root_bytes(1)
        assert _floor(state) == RepoFloor(NAME, 3, 1, hashlib.sha256(r1).hexdigest())
        # what a device holds after the v1 keys signed an index offering v9 (a fast-forward by
        # stolen keys): under the same keys, v4 is refused and v3 keeps running
        (state / REPO_FLOOR_FILE).write_bytes(RepoFloor(NAME, 9, 1, hashlib.sha256(r1).hexdigest()).to_bytes())
        publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r4", 4, weight=1.0))
        with pytest.raises(UpdateError, match="same keys offered v9 before") as e:
            update(trust_dir, server.url, state)
        assert e.value.stage == "index" and read_device_state(state).last_good.version == 3
        assert _floor(state).version == 9
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        r = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "repo", "rotate", "root", "--repo",
                            str(repo.dir), "--offline-keys", str(tmp_path / "offline"), "--new-offline-keys",
                            str(tmp_path / "offline-2")], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        res = update(trust_dir, server.url, state)
    assert (res.action, res.version, res.floor.action) == ("installed", 4, "rebase")
    assert read_device_state(state).last_good.version == 4
    assert _floor(state) == RepoFloor(NAME, 4, 2, hashlib.sha256(repo.root_bytes(2)).hexdigest())
    assert read_update_record(state)["release"]["floor"]["action"] == "rebase"
    s = device_status(state)
    assert s["repository_floor"] == {"name": NAME, "version": 4, "root_version": 2}
    assert f"repository floor: {NAME} v4 (TUF root v2)" in format_status(s)


def test_a_replaced_trusted_root_without_a_chain_is_refused(tmp_path, enclave, trust_dir):
    """A root.json swapped into the device's metadata (python-tuf trusts its local root when it
    is signed by itself) that lists the repository's online keys but root keys of its own: the
    repository's metadata verifies under it, but no signature chain joins it to the floor's
    root -- refused, nothing installed, the floor unchanged."""
    from tuf.api.metadata import Metadata

    from sealfl.platform.repo.keys import new_signer

    repo = make_repo(tmp_path)
    provision_trust(trust_dir, repo)
    state = tmp_path / "device"
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r3", 3))
    with RepoServer(repo.www) as server:
        update(trust_dir, server.url, state, name=NAME, backend="sim")
        publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r4", 4, weight=1.0))
        forged = Metadata.from_bytes(repo.root_bytes(1))
        for keyid in list(forged.signed.roles["root"].keyids):
            forged.signed.revoke_key(keyid, "root")
        mine = new_signer()
        forged.signed.add_key(mine.public_key, "root")
        forged.signed.roles["root"].threshold = 1
        forged.signed.version = 2
        forged.signatures.clear()
        forged.sign(mine)
        (state / "tuf" / "root_history" / "2.root.json").write_bytes(forged.to_bytes())
        os.remove(state / "tuf" / "root.json")
        os.symlink("root_history/2.root.json", state / "tuf" / "root.json")
        with pytest.raises(UpdateError, match="no valid root chain.*not signed by the root threshold of v1") as e:
            update(trust_dir, server.url, state)
    assert e.value.stage == "trust"
    assert read_device_state(state).last_good.version == 3
    assert _floor(state).root_version == 1
