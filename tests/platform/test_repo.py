"""The TUF repository (``sealfl repo``): roles, thresholds, keys, publishing, rotation, serving.

The oracle is python-tuf's own client (``tuf.ngclient.Updater`` with its default fetcher)
over real HTTP, plus hashlib for the bytes it downloads."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tuf.api.metadata import Metadata
from tuf.ngclient import Updater

from sealfl.attestation.repo_index import INDEX_TARGET, parse_index
from sealfl.platform.repo.keys import RepoError, read_root_keys
from sealfl.platform.repo.repository import Repository
from sealfl.platform.repo.server import RepoServer
from tests.support.tufrepo import make_repo, new_release, publish_verified


def _client(tmp: Path, url: str, root: bytes) -> Updater:
    md, dl = tmp / "client-md", tmp / "client-dl"
    md.mkdir(exist_ok=True)
    dl.mkdir(exist_ok=True)
    return Updater(str(md), f"{url}/metadata/", str(dl), f"{url}/targets/", bootstrap=root)


def test_init_makes_threshold_two_of_three_offline_root_and_private_keys(tmp_path):
    repo = make_repo(tmp_path)
    root = Metadata.from_bytes(repo.root_bytes(1)).signed
    assert root.roles["root"].threshold == 2 and len(root.roles["root"].keyids) == 3
    assert root.consistent_snapshot is True
    online = {role: root.roles[role].keyids for role in ("timestamp", "snapshot", "targets")}
    assert all(len(k) == 1 for k in online.values()) and len({k[0] for k in online.values()}) == 3
    assert not set(root.roles["root"].keyids) & {k[0] for k in online.values()}
    offline = sorted((tmp_path / "offline").iterdir())
    assert len(offline) == 3 and all(os.stat(p).st_mode & 0o777 == 0o600 for p in offline)
    assert os.stat(tmp_path / "offline").st_mode & 0o777 == 0o700
    assert set(read_root_keys(tmp_path / "offline")) == set(root.roles["root"].keyids)
    for role in ("timestamp", "snapshot", "targets"):
        assert os.stat(repo.keys_dir / f"{role}.pem").st_mode & 0o777 == 0o600
    # nothing private below the served tree
    for p in repo.www.rglob("*"):
        assert b"PRIVATE KEY" not in (p.read_bytes() if p.is_file() else b"")
    # expiry per role, as configured by default (root a year, timestamp a day)
    ts = Metadata.from_file(str(repo.metadata_dir / "timestamp.json")).signed
    assert 0 < (ts.expires.timestamp() - time.time()) <= 86400 + 5
    assert 364 * 86400 < root.expires.timestamp() - time.time() <= 365 * 86400 + 5


def test_init_refuses_a_used_directory_and_offline_keys_inside_the_repo(tmp_path):
    make_repo(tmp_path)
    with pytest.raises(RepoError, match="not empty"):
        Repository.init(tmp_path / "repo", tmp_path / "offline2")
    with pytest.raises(RepoError, match="outside the repository"):
        Repository.init(tmp_path / "r2", tmp_path / "r2" / "offline")
    with pytest.raises(RepoError, match="already holds root keys"):
        Repository.init(tmp_path / "r3", tmp_path / "offline")


def test_publish_serves_release_files_with_claims_to_python_tuf(tmp_path, enclave, trust_dir):
    repo = make_repo(tmp_path)
    rel = new_release(enclave, tmp_path / "rel-v3", 3)
    pub = publish_verified(repo, trust_dir, rel)
    assert pub.targets_version == 2
    with RepoServer(repo.www) as server:
        client = _client(tmp_path, server.url, repo.root_bytes(1))
        client.refresh()
        for file in sorted(p.name for p in rel.iterdir()):
            info = client.get_targetinfo(f"releases/heart-mlp/3/{file}")
            assert info.custom["sealfl"]["version"] == 3
            data = Path(client.download_target(info)).read_bytes()
            assert data == (rel / file).read_bytes()
            assert info.hashes["sha256"] == hashlib.sha256(data).hexdigest()
        index = parse_index(Path(client.download_target(client.get_targetinfo(INDEX_TARGET))).read_bytes())
        assert [(r.name, r.version) for r in index] == [("heart-mlp", 3)]
        assert index[0].root_digest == pub.release.root_digest
    with pytest.raises(RepoError, match="published already"):
        publish_verified(repo, trust_dir, rel)


def test_rotate_online_key_client_follows_and_old_key_is_gone(tmp_path, enclave, trust_dir):
    repo = make_repo(tmp_path)
    old_ts = (repo.keys_dir / "timestamp.pem").read_bytes()
    with RepoServer(repo.www) as server:
        client = _client(tmp_path, server.url, repo.root_bytes(1))
        client.refresh()
        assert repo.rotate("timestamp", tmp_path / "offline") == 2
        publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "rel-v3", 3))
        client = _client(tmp_path, server.url, None)
        client.refresh()
        assert client.get_targetinfo("releases/heart-mlp/3/labels.json") is not None
    assert (repo.keys_dir / "timestamp.pem").read_bytes() != old_ts
    root2 = Metadata.from_bytes(repo.root_bytes(2))
    # signed by the threshold of the offline root keys (all three available here)
    assert len(root2.signatures) == 3
    Metadata.from_bytes(repo.root_bytes(1)).signed.verify_delegate("root", root2.signed_bytes, root2.signatures)


def test_rotate_root_signed_with_old_and_new_threshold(tmp_path):
    repo = make_repo(tmp_path)
    old_ids = set(Metadata.from_bytes(repo.root_bytes(1)).signed.roles["root"].keyids)
    assert repo.rotate("root", tmp_path / "offline", tmp_path / "offline-2") == 2
    root2 = Metadata.from_bytes(repo.root_bytes(2))
    new_ids = set(root2.signed.roles["root"].keyids)
    assert not new_ids & old_ids and len(new_ids) == 3 and root2.signed.roles["root"].threshold == 2
    assert set(root2.signatures) == old_ids | new_ids
    Metadata.from_bytes(repo.root_bytes(1)).signed.verify_delegate("root", root2.signed_bytes, root2.signatures)
    root2.signed.verify_delegate("root", root2.signed_bytes, root2.signatures)
    assert set(read_root_keys(tmp_path / "offline-2")) == new_ids


def test_rotation_with_one_root_key_is_refused_and_writes_nothing(tmp_path):
    repo = make_repo(tmp_path)
    one = tmp_path / "one-key"
    one.mkdir(mode=0o700)
    first = sorted((tmp_path / "offline").iterdir())[0]
    (one / first.name).write_bytes(first.read_bytes())
    os.chmod(one / first.name, 0o600)
    before = sorted(p.name for p in repo.metadata_dir.iterdir())
    key_before = (repo.keys_dir / "targets.pem").read_bytes()
    with pytest.raises(RepoError, match="root threshold"):
        repo.rotate("targets", one)
    assert sorted(p.name for p in repo.metadata_dir.iterdir()) == before
    assert (repo.keys_dir / "targets.pem").read_bytes() == key_before


def test_a_key_readable_by_others_is_refused_by_name(tmp_path):
    repo = make_repo(tmp_path)
    os.chmod(repo.keys_dir / "snapshot.pem", 0o644)
    with pytest.raises(RepoError, match="snapshot.pem: a private key readable"):
        repo.refresh()


@pytest.mark.slow
def test_cli_init_publish_serve(tmp_path, enclave, trust_dir):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cli = [sys.executable, "-m", "sealfl.platform.cli"]
    device_trust = tmp_path / "device-trust"
    r = subprocess.run([*cli, "repo", "init", str(tmp_path / "repo"), "--offline-keys", str(tmp_path / "off"),
                        "--expiry", "timestamp=2", "--trust", str(device_trust)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (device_trust / "tuf-root.json").read_bytes() == (tmp_path / "repo/www/metadata/1.root.json").read_bytes()
    rel = new_release(enclave, tmp_path / "rel-v3", 3)
    r = subprocess.run([*cli, "repo", "publish", str(tmp_path / "repo"), str(rel), "--trust", str(trust_dir)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "published heart-mlp v3" in r.stdout, r.stderr
    # a release that does not verify is not published
    (rel / "labels.json").write_bytes(b"{}")
    r = subprocess.run([*cli, "repo", "publish", str(tmp_path / "repo"), str(rel), "--trust", str(trust_dir)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "labels.json" in r.stderr
    port_file = tmp_path / "port"
    proc = subprocess.Popen([*cli, "repo", "serve", str(tmp_path / "repo"), "--port", "0", "--port-file",
                             str(port_file), "--json"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = json.loads(proc.stdout.readline())["url"]
        assert url == f"http://127.0.0.1:{int(port_file.read_text())}"
        ts = urllib.request.urlopen(f"{url}/metadata/timestamp.json", timeout=10).read()
        assert ts == (tmp_path / "repo/www/metadata/timestamp.json").read_bytes()
        for path in ("/keys/targets.pem", "/../keys/targets.pem", "/metadata/", "/repo.json"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"{url}{path}", timeout=10)
            assert e.value.code == 404
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
