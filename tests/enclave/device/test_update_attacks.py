"""The attack matrix of issue 21 against ``device update``: a real repository served over
loopback HTTP (the real server, or a mirror the attacker rewrote), the real updater, and a
device that runs v3 before each attack and still runs v3 after it.

Each test is named after the attack (TUF specification 1.0, "Attacks and weaknesses"; the
sealfl-specific ones after the issue). A refusal is asserted by its stage and message, and
"keeps its previous release" by the recorded state *and* by booting the last good release
and comparing its answers with an independent onnxruntime run of v3's model."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
from tuf.api.metadata import Metadata, Root
from tuf.api.serialization.json import JSONSerializer

from sealfl.attestation.repo_index import INDEX_SCHEMA
from sealfl.enclave.device.boot import boot, boot_last_good, read_device_state
from sealfl.enclave.device.tuf_fetch import UpdateLimits
from sealfl.enclave.device.update import update
from sealfl.enclave.device.verify import verify_dir
from sealfl.enclave.errors import UpdateError
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.platform.repo.keys import new_signer, read_key, read_root_keys
from sealfl.platform.repo.repository import Repository
from sealfl.platform.repo.server import RepoServer
from tests.support.releases import MODEL_FILE, WEIGHTS, direct_outputs, make_onnx_model, sample_inputs
from tests.support.tufrepo import (
    NAME,
    StallingServer,
    make_repo,
    new_release,
    provision_trust,
    publish_raw,
    publish_verified,
)

_SER = JSONSerializer(compact=False)
_V3_WEIGHT = 0.5


@dataclass
class Ctx:
    tmp: Path
    repo: Repository
    server: RepoServer
    trust: Path
    state: Path
    enclave: ReleaseEnclave
    v3_root: str

    def release(self, version: int, name: str = NAME, weight: float = 2.5, enclave=None) -> Path:
        return new_release(enclave or self.enclave, self.tmp / f"rel-{name}-{version}-{weight}", version, name, weight)

    def mirror(self) -> Path:
        """A copy of the served tree to tamper with (a hostile mirror)."""
        out = self.tmp / f"mirror-{time.monotonic_ns()}"
        shutil.copytree(self.repo.www, out)
        return out

    def update(self, url: str | None = None, **kw):
        return update(self.trust, url or self.server.url, self.state, **kw)


@pytest.fixture
def ctx(tmp_path, enclave, trust_dir):
    repo = make_repo(tmp_path)
    provision_trust(trust_dir, repo)
    with RepoServer(repo.www) as server:
        c = Ctx(tmp_path, repo, server, trust_dir, tmp_path / "device", enclave, "")
        publish_verified(repo, trust_dir, c.release(3, weight=_V3_WEIGHT))
        assert c.update(name=NAME, backend="sim").action == "installed"
        c.v3_root = read_device_state(c.state).last_good.root_digest
        yield c


def keeps_v3(c: Ctx) -> None:
    """The device still runs v3: recorded, and its slot boots and answers as v3's model."""
    lg = read_device_state(c.state).last_good
    assert (lg.name, lg.version, lg.root_digest) == (NAME, 3, c.v3_root)
    w = WEIGHTS.copy()
    w[0, 0] = _V3_WEIGHT
    x = sample_inputs(3)
    with boot_last_good(c.trust, c.state) as dev:
        assert dev.release.version == 3
        np.testing.assert_array_equal(dev.predict(x), direct_outputs(make_onnx_model(w), x))
    assert not [p for p in c.tmp.iterdir() if p.name.startswith(".device.update-")]


def refused(c: Ctx, stage: str | tuple[str, ...], match: str, url: str | None = None, **kw) -> UpdateError:
    with pytest.raises(UpdateError, match=match) as e:
        c.update(url, **kw)
    assert e.value.stage in ((stage,) if isinstance(stage, str) else stage), str(e.value)
    keeps_v3(c)
    return e.value


def _hashed(www: Path, repo: Repository, target: str) -> Path:
    tf = repo.load("targets").signed.targets[target]
    d, _, base = target.rpartition("/")
    return www / "targets" / d / f"{tf.hashes['sha256']}.{base}"


def _write_md(path: Path, md: Metadata) -> None:
    path.write_bytes(md.to_bytes(_SER))


def _sign(md: Metadata, *signers) -> Metadata:
    md.signatures.clear()
    for s in signers:
        md.sign(s, append=True)
    return md


def _ts_key(c: Ctx):
    return read_key(c.repo.keys_dir / "timestamp.pem")


# ---- arbitrary installation -------------------------------------------------------------

def test_arbitrary_installation_release_signed_by_another_key(ctx, tmp_path):
    rogue = ReleaseEnclave.create(tmp_path / "rogue-enclave")
    rel = ctx.release(4, enclave=rogue)
    publish_raw(ctx.repo, rel, NAME, 4, verify_dir(rogue.export_trust(tmp_path / "rogue-trust"), rel).root_digest)
    refused(ctx, "release", "refused")


def test_arbitrary_installation_metadata_signed_by_another_key(ctx):
    rel = ctx.release(4)
    publish_verified(ctx.repo, ctx.trust, rel)
    www = ctx.mirror()
    ts = Metadata.from_file(str(www / "metadata" / "timestamp.json"))
    _write_md(www / "metadata" / "timestamp.json", _sign(ts, new_signer()))
    with RepoServer(www) as mirror:
        refused(ctx, "metadata", "UnsignedMetadataError", mirror.url)


# ---- endless data ------------------------------------------------------------------------

def test_endless_data_target_longer_than_its_metadata(ctx):
    publish_verified(ctx.repo, ctx.trust, ctx.release(4))
    www = ctx.mirror()
    with open(_hashed(www, ctx.repo, f"releases/{NAME}/4/{MODEL_FILE}"), "ab") as fh:
        fh.write(b"\0" * (1 << 20))
    with RepoServer(www) as mirror:
        refused(ctx, "download", "DownloadLengthMismatchError|exceeding", mirror.url)


def test_endless_data_timestamp_beyond_its_cap(ctx):
    www = ctx.mirror()
    (www / "metadata" / "timestamp.json").write_bytes(b" " * (64 << 10))
    with RepoServer(www) as mirror:
        refused(ctx, "download", "exceeding", mirror.url)


# ---- rollback and fast-forward ----------------------------------------------------------

def test_rollback_older_timestamp(ctx):
    old = (ctx.repo.metadata_dir / "timestamp.json").read_bytes()
    publish_verified(ctx.repo, ctx.trust, ctx.release(4))
    ctx.repo.refresh()
    ctx.update(name=NAME)  # the device sees the newer timestamp (and installs v4)
    assert read_device_state(ctx.state).last_good.version == 4
    www = ctx.mirror()
    (www / "metadata" / "timestamp.json").write_bytes(old)
    with RepoServer(www) as mirror, pytest.raises(UpdateError, match="BadVersionNumberError") as e:
        ctx.update(mirror.url)
    assert e.value.stage == "metadata" and read_device_state(ctx.state).last_good.version == 4


@pytest.mark.parametrize("role", ["snapshot", "targets"])
def test_rollback_older_snapshot_or_targets(ctx, role):
    publish_verified(ctx.repo, ctx.trust, ctx.release(4))
    www = ctx.mirror()
    current = ctx.repo.load(role).signed.version
    older = (ctx.repo.metadata_dir / f"{current - 1}.{role}.json").read_bytes()
    (www / "metadata" / f"{current}.{role}.json").write_bytes(older)
    with RepoServer(www) as mirror:
        # the timestamp pins the snapshot's length and hash; the snapshot pins the targets version
        refused(ctx, ("metadata", "download"),
                "BadVersionNumberError|LengthOrHashMismatchError|DownloadLengthMismatchError", mirror.url)


def test_rollback_older_release_version(tmp_path, enclave, trust_dir):
    """The repository's newest release is older than what the device runs: never installed."""
    repo = make_repo(tmp_path)
    provision_trust(trust_dir, repo)
    state = tmp_path / "device"
    boot(trust_dir, new_release(enclave, tmp_path / "r3", 3), state, backend="sim").close()
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r2", 2))
    with RepoServer(repo.www) as server, pytest.raises(UpdateError, match="older than the running v3") as e:
        update(trust_dir, server.url, state)
    assert e.value.stage == "index" and read_device_state(state).last_good.version == 3


def test_fast_forward_release_version_beyond_the_allowed_step(ctx):
    far = ctx.release(3 + 5000)
    publish_verified(ctx.repo, ctx.trust, far)
    res = ctx.update()
    assert res.action == "kept" and res.exit_code == 3 and res.outcome.refused.reason == "verification"
    keeps_v3(ctx)


def test_fast_forward_timestamp_recovered_after_key_rotation(ctx):
    """A stolen timestamp key pushes the device's timestamp to v1000; after the coordinator
    rotates that key the device accepts the repository's lower versions again (5.3.11)."""
    www = ctx.mirror()
    ts = Metadata.from_file(str(www / "metadata" / "timestamp.json"))
    ts.signed.version = 1000
    _write_md(www / "metadata" / "timestamp.json", _sign(ts, _ts_key(ctx)))
    with RepoServer(www) as mirror:
        assert ctx.update(mirror.url).action == "current"
    publish_verified(ctx.repo, ctx.trust, ctx.release(4))
    with pytest.raises(UpdateError, match="BadVersionNumberError"):
        ctx.update()  # frozen by the fast-forwarded timestamp
    ctx.repo.rotate("timestamp", ctx.tmp / "offline")
    assert ctx.update().action == "installed"


# ---- indefinite freeze -------------------------------------------------------------------

def test_indefinite_freeze_expired_timestamp(ctx):
    publish_verified(ctx.repo, ctx.trust, ctx.release(4))
    www = ctx.mirror()
    ts = Metadata.from_file(str(www / "metadata" / "timestamp.json"))
    ts.signed.expires = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(hours=1)
    _write_md(www / "metadata" / "timestamp.json", _sign(ts, _ts_key(ctx)))
    with RepoServer(www) as mirror:
        refused(ctx, "metadata", "ExpiredMetadataError", mirror.url)


# ---- mix-and-match -----------------------------------------------------------------------

def test_mix_and_match_files_of_two_releases(ctx):
    r4, r5 = ctx.release(4, weight=1.0), ctx.release(5, weight=2.0)
    mixed = ctx.tmp / "mixed"
    shutil.copytree(r4, mixed)
    (mixed / MODEL_FILE).write_bytes((r5 / MODEL_FILE).read_bytes())
    publish_raw(ctx.repo, mixed, NAME, 4, verify_dir(ctx.trust, r4).root_digest)
    refused(ctx, "release", MODEL_FILE)


def test_mix_and_match_snapshot_and_targets_disagree(ctx):
    old_targets = ctx.repo.load("targets")
    publish_verified(ctx.repo, ctx.trust, ctx.release(4))
    www = ctx.mirror()
    v = ctx.repo.load("targets").signed.version
    _write_md(www / "metadata" / f"{v}.targets.json", old_targets)  # validly signed, another version
    with RepoServer(www) as mirror:
        refused(ctx, "metadata", "BadVersionNumberError", mirror.url)


# ---- malicious mirror --------------------------------------------------------------------

def test_malicious_mirror_other_bytes_same_length(ctx):
    publish_verified(ctx.repo, ctx.trust, ctx.release(4))
    www = ctx.mirror()
    path = _hashed(www, ctx.repo, f"releases/{NAME}/4/labels.json")
    data = bytearray(path.read_bytes())
    data[3] ^= 0x20
    path.write_bytes(bytes(data))
    with RepoServer(www) as mirror:
        refused(ctx, "download", "LengthOrHashMismatchError|hash", mirror.url)


# ---- key compromise ----------------------------------------------------------------------

def test_key_compromise_below_threshold_one_root_key_signs_a_new_root(ctx):
    stolen = next(iter(read_root_keys(ctx.tmp / "offline").values()))
    evil = new_signer()
    root = Metadata.from_bytes(ctx.repo.root_bytes(1))
    r: Root = root.signed
    for role in ("root", "timestamp", "snapshot", "targets"):
        for keyid in list(r.roles[role].keyids):
            r.revoke_key(keyid, role)
        r.add_key(evil.public_key, role)
    r.roles["root"].threshold = 1
    r.version = 2
    www = ctx.mirror()
    _write_md(www / "metadata" / "2.root.json", _sign(root, stolen, evil))
    with RepoServer(www) as mirror:
        refused(ctx, "metadata", "UnsignedMetadataError", mirror.url)


# ---- wrong software ----------------------------------------------------------------------

def test_wrong_software_release_of_another_model(ctx):
    other = ctx.release(4, name="other-model")
    publish_raw(ctx.repo, other, NAME, 4, verify_dir(ctx.trust, other).root_digest)
    refused(ctx, "release", "wrong software")


def test_wrong_software_release_for_another_device_class(ctx):
    rel = ctx.tmp / "big-device"
    from tests.support.releases import default_payload

    ctx.enclave.write_release(rel, default_payload(), NAME, 4,
                              {"model_file": MODEL_FILE, "requirements": {"min_memory_bytes": 1 << 60}})
    publish_verified(ctx.repo, ctx.trust, rel)
    res = ctx.update()
    assert res.action == "kept" and res.outcome.refused.reason == "requirements"
    keeps_v3(ctx)


# ---- a file added, removed or renamed; a symlink ----------------------------------------

@pytest.mark.parametrize("change", ["added", "removed", "renamed"])
def test_file_added_removed_or_renamed_in_a_release(ctx, change):
    r4 = ctx.release(4)
    root = verify_dir(ctx.trust, r4).root_digest
    altered = ctx.tmp / f"altered-{change}"
    shutil.copytree(r4, altered)
    if change == "added":
        (altered / "extra.bin").write_bytes(b"not signed")
        what = "extra.bin"
    elif change == "removed":
        (altered / "labels.json").unlink()
        what = "labels.json"
    else:
        (altered / "labels.json").rename(altered / "labels2.json")
        what = "labels"
    publish_raw(ctx.repo, altered, NAME, 4, root)
    refused(ctx, "release", what)


def _sign_index(c: Ctx, index: bytes) -> None:
    """A repository whose targets key signs the index given (what a compromised online key
    or a buggy publisher could serve)."""
    from tuf.api.metadata import TargetFile

    repo = c.repo
    tmd = repo.load("targets")
    tf = TargetFile.from_data("releases/index.json", index, ["sha256"])
    repo._store_target("releases/index.json", index, tf)
    tmd.signed.targets["releases/index.json"] = tf
    repo._bump(tmd, 90)
    repo._sign_write(tmd, read_key(repo.keys_dir / "targets.pem"), repo.load("root"))
    repo.refresh()


def test_symlink_or_path_in_a_release_file_name(ctx):
    """An index listing ``../state.json`` (or ``a/b``) would let a download write outside the
    staging directory, e.g. over the device's state through a path or a planted symlink."""
    for bad in ("../device/state.json", "sub/link"):
        _sign_index(ctx, json.dumps({"schema": INDEX_SCHEMA, "releases": [
            {"name": NAME, "version": 4, "root_digest": "a" * 64, "files": [bad]}]}).encode())
        refused(ctx, "index", "plain file name")


def test_symlink_planted_in_the_staging_area_is_not_followed(ctx, monkeypatch):
    """Downloads go into a fresh private directory (mkdtemp, 0700). Should a local attacker
    still plant a symlink there (here: the staging name made predictable and ``release``
    pointing at a directory of theirs), the update stops and writes nothing through it."""
    import tempfile as _tempfile

    from sealfl.enclave.device import update as update_module

    victim = ctx.tmp / "victim"
    victim.mkdir()
    real_mkdtemp = _tempfile.mkdtemp

    def planted(**kw):
        d = real_mkdtemp(**kw)
        os.symlink(victim, os.path.join(d, "release"))
        return d

    publish_verified(ctx.repo, ctx.trust, ctx.release(4))
    with monkeypatch.context() as m:
        m.setattr(update_module.tempfile, "mkdtemp", planted)
        with pytest.raises(UpdateError, match="tampered with"):
            ctx.update()
    keeps_v3(ctx)
    assert list(victim.iterdir()) == []


# ---- truncated download, stalling mirror ------------------------------------------------

def test_truncated_download_then_resumed_from_a_good_mirror(ctx):
    publish_verified(ctx.repo, ctx.trust, ctx.release(4))
    www = ctx.mirror()
    path = _hashed(www, ctx.repo, f"releases/{NAME}/4/{MODEL_FILE}")
    path.write_bytes(path.read_bytes()[:-7])
    with RepoServer(www) as mirror:
        refused(ctx, "download", "LengthOrHashMismatchError|length", mirror.url)
    res = ctx.update()
    assert (res.action, res.version) == ("installed", 4)


def test_slow_loris_mirror_is_given_up_within_its_deadline(ctx):
    limits = UpdateLimits(socket_timeout_s=1.0, download_deadline_s=2.0)
    with StallingServer(gap_s=0.2) as mirror, pytest.raises(UpdateError, match="SlowRetrievalError") as e:
        t0 = time.monotonic()
        try:
            ctx.update(mirror.url, limits=limits)
        finally:
            took = time.monotonic() - t0
    # one stalled file: at most the deadline plus one gap timeout (and a little scheduling)
    assert e.value.stage == "download" and took < 2.0 + 1.0 + 3.0, took
    keeps_v3(ctx)


# ---- signed deltas ------------------------------------------------------------------------

def _runs(c: Ctx, version: int, weight: float) -> None:
    w = WEIGHTS.copy()
    w[0, 0] = weight
    x = sample_inputs(3)
    assert read_device_state(c.state).last_good.version == version
    with boot_last_good(c.trust, c.state) as dev:
        assert dev.release.version == version
        np.testing.assert_array_equal(dev.predict(x), direct_outputs(make_onnx_model(w), x))


def _publish_delta(c: Ctx, old: Path, new: Path, base_root: str | None = None) -> Path:
    from sealfl.enclave.device.delta import delta_files, read_delta_statement
    from sealfl.platform.delta import make_delta

    out = c.tmp / f"delta-{time.monotonic_ns()}"
    make_delta(c.enclave, c.trust, old, new, out)
    st = read_delta_statement(c.trust, out)
    c.repo.publish_delta(delta_files(out, st), NAME, st.version, st.root_digest, base_root or st.base_root_digest)
    return out


def test_delta_onto_the_running_release_installs_from_the_patch(ctx):
    v3 = ctx.tmp / f"rel-{NAME}-3-{_V3_WEIGHT}"
    v4 = ctx.release(4)
    publish_verified(ctx.repo, ctx.trust, v4)
    _publish_delta(ctx, v3, v4)
    res = ctx.update()
    assert (res.action, res.via, res.delta_refused) == ("installed", "delta", None)
    _runs(ctx, 4, 2.5)
    assert json.loads((ctx.state / "update.json").read_text())["release"]["via"] == "delta"


def test_delta_onto_the_wrong_base_is_refused_and_the_full_release_installs(ctx):
    """A delta made from v2, published where a device running v3 looks (under v3's root
    digest): validly signed by TUF and by the release key, but not for this base."""
    v2 = ctx.release(2, weight=1.0)
    v4 = ctx.release(4)
    publish_verified(ctx.repo, ctx.trust, v4)
    _publish_delta(ctx, v2, v4, base_root=ctx.v3_root)
    res = ctx.update()
    assert (res.action, res.via) == ("installed", "full")
    assert "wrong base" in res.delta_refused
    _runs(ctx, 4, 2.5)


def test_delta_of_a_hostile_mirror_is_refused_and_the_full_release_installs(ctx):
    v3 = ctx.tmp / f"rel-{NAME}-3-{_V3_WEIGHT}"
    v4 = ctx.release(4)
    publish_verified(ctx.repo, ctx.trust, v4)
    _publish_delta(ctx, v3, v4)
    www = ctx.mirror()
    from sealfl.attestation.repo_index import delta_target_path
    patch = _hashed(www, ctx.repo, delta_target_path(NAME, 4, ctx.v3_root, f"{MODEL_FILE}.hdiff"))
    patch.write_bytes(patch.read_bytes()[:-1] + bytes([patch.read_bytes()[-1] ^ 1]))
    with RepoServer(www) as mirror:
        res = ctx.update(mirror.url)
    assert (res.action, res.via) == ("installed", "full")
    assert "hash" in res.delta_refused.lower() or "length" in res.delta_refused.lower(), res.delta_refused
    _runs(ctx, 4, 2.5)


def test_delta_producing_another_release_than_indexed_is_refused_and_the_full_release_installs(ctx):
    """A genuine delta v3 -> v4 published (by a careless coordinator) under v5 in the repo:
    the statement's result is not the release the index offers."""
    v3 = ctx.tmp / f"rel-{NAME}-3-{_V3_WEIGHT}"
    v4, v5 = ctx.release(4), ctx.release(5, weight=3.5)
    publish_verified(ctx.repo, ctx.trust, v5)
    from sealfl.enclave.device.delta import delta_files, read_delta_statement
    from sealfl.platform.delta import make_delta
    out = ctx.tmp / "delta-v4"
    make_delta(ctx.enclave, ctx.trust, v3, v4, out)
    v5_root = verify_dir(ctx.trust, v5).root_digest
    ctx.repo.publish_delta(delta_files(out, read_delta_statement(ctx.trust, out)), NAME, 5, v5_root, ctx.v3_root)
    res = ctx.update()
    assert (res.action, res.via) == ("installed", "full")
    assert "not the indexed" in res.delta_refused
    _runs(ctx, 5, 3.5)
