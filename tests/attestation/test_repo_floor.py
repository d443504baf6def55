"""The repository floor's pure decision (:func:`sealfl.attestation.repo_floor.decide_floor`) over
real TUF roots written by :class:`sealfl.platform.repo.repository.Repository` (rotated with its
own ``rotate``), and forged ones."""

from __future__ import annotations

import hashlib

import pytest
from tuf.api.metadata import Metadata

from sealfl.attestation.errors import DeviceStateError
from sealfl.attestation.repo_floor import RepoFloor, decide_floor
from sealfl.platform.repo.repository import Repository

NAME = "heart-mlp"


def _floor(root: bytes, version: int, root_version: int = 1) -> RepoFloor:
    return RepoFloor(NAME, version, root_version, hashlib.sha256(root).hexdigest())


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """roots of three repositories: ``rot`` (v1, v2 = root keys rotated, v3 = targets rotated),
    ``ts`` (v1, v2 = only the timestamp key rotated) and ``other`` (v1, v2 = its own root rotation)."""
    tmp = tmp_path_factory.mktemp("roots")
    out = {}
    for label, steps in (("rot", ("root", "targets")), ("ts", ("timestamp",)), ("other", ("root",))):
        repo = Repository.init(tmp / label, tmp / f"{label}-off")
        offline = tmp / f"{label}-off"
        for i, role in enumerate(steps):
            new = tmp / f"{label}-off{i + 2}" if role == "root" else None
            repo.rotate(role, offline, new)
            offline = new or offline
        out[label] = [repo.root_bytes(v) for v in range(1, len(steps) + 2)]
    return out


def test_first_floor_is_set_from_the_offer_never_below_the_running_version(chains):
    r1 = chains["rot"][0]
    d = decide_floor(None, [r1], NAME, 4, 3)
    assert (d.action, d.floor) == ("keep", _floor(r1, 4))
    assert decide_floor(None, [r1], NAME, 2, 3).floor.version == 3


def test_unrotated_keys_keep_the_floor_and_refuse_a_hidden_release(chains):
    r1, r2 = chains["ts"]  # only the timestamp key changed: root and targets keys still listed
    d = decide_floor(_floor(r1, 9), [r1, r2], NAME, 10, 5)
    assert (d.action, d.floor) == ("keep", _floor(r2, 10, 2))  # raised and re-anchored to the newest root
    d = decide_floor(_floor(r1, 9), [r1, r2], NAME, 6, 5)
    assert (d.action, d.check, d.floor) == ("refuse", "rollback", None)
    assert "v6" in d.reason and "offered v9 before" in d.reason
    assert decide_floor(_floor(r1, 9), [r1], NAME, 9, 9).action == "keep"


def test_floor_of_rotated_root_keys_is_rebased_to_the_new_targets_offer(chains):
    r1, r2, _ = chains["rot"]
    d = decide_floor(_floor(r1, 9), [r1, r2], NAME, 4, 3)  # v9 was vouched for by root keys v2 revoked
    assert (d.action, d.floor) == ("rebase", _floor(r2, 4, 2))
    assert "root key" in d.reason and "re-based to v4" in d.reason


def test_floor_of_a_rotated_targets_key_is_rebased(chains):
    _, r2, r3 = chains["rot"]
    d = decide_floor(_floor(r2, 9, 2), [r2, r3], NAME, 5, 5)
    assert (d.action, d.floor) == ("rebase", _floor(r3, 5, 3))
    assert "targets key" in d.reason and "root key" not in d.reason


def test_rebase_is_never_below_the_version_the_device_runs(chains):
    r1, r2, r3 = chains["rot"]
    d = decide_floor(_floor(r1, 9), [r1, r2, r3], NAME, 4, 7)
    assert (d.action, d.check, d.floor) == ("refuse", "rollback", None)
    assert "below the running v7" in d.reason


def test_a_forged_rebase_without_a_valid_root_chain_is_refused(chains):
    r1, r2, r3 = chains["rot"]
    floor = _floor(r1, 9)
    other2 = chains["other"][1]  # a valid root v2 -- of another repository's keys
    forged = {
        "root signed by other keys": [r1, other2],
        "version gap": [r1, r3],
        "chain not from the floor's root": [chains["other"][0], other2],
        "no chain past the floor's root": [r2],
        "garbage": [r1, b"{not json"],
        "empty": [],
    }
    md = Metadata.from_bytes(r2)  # v2 with only one of the old keys' signatures: below the old threshold
    old_ids = set(Metadata.from_bytes(r1).signed.roles["root"].keyids)
    for keyid in [k for k in md.signatures if k in old_ids][1:]:
        del md.signatures[keyid]
    forged["below the old threshold"] = [r1, md.to_bytes()]
    for what, chain in forged.items():
        d = decide_floor(floor, chain, NAME, 4, 3)
        assert (d.action, d.check, d.floor) == ("refuse", "chain", None), what
        assert "no valid root chain" in d.reason, what


def test_a_floor_of_another_name_does_not_apply(chains):
    r1, r2, _ = chains["rot"]
    other = RepoFloor("other-model", 50, 2, hashlib.sha256(r2).hexdigest())
    d = decide_floor(other, [r1], NAME, 4, None)
    assert (d.action, d.floor) == ("keep", _floor(r1, 4))


def test_floor_record_round_trips_and_refuses_damage(chains):
    f = _floor(chains["rot"][0], 7)
    assert RepoFloor.from_bytes(f.to_bytes()) == f
    for bad in (b"", b"[]", f.to_bytes().replace(b'"version": 7', b'"version": -1'),
                f.to_bytes().replace(b'"version": 7', b'"version": true'),
                f.to_bytes().replace(b"repo-floor/v1", b"repo-floor/v9"),
                f.to_bytes().replace(b'"name"', b'"extra": 1, "name"')):
        with pytest.raises(DeviceStateError, match="repo-floor.json"):
            RepoFloor.from_bytes(bad)
