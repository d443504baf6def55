"""``device update``'s trust inputs and an unreachable mirror: a damaged trust file is named
and refused (never "up to date"), a refused connection is called unreachable, not a stall
(:mod:`sealfl.enclave.device.update_trust`, :mod:`sealfl.enclave.device.tuf_fetch`)."""

from __future__ import annotations

import socket

import pytest

from sealfl.enclave.device.boot import read_device_state
from sealfl.enclave.device.tuf_fetch import DeadlineFetcher, MirrorUnreachable
from sealfl.enclave.device.update import read_update_record, update
from sealfl.enclave.errors import UpdateError
from sealfl.platform.repo.server import RepoServer
from tests.support.tufrepo import NAME, make_repo, new_release, provision_trust, publish_verified


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: connecting is refused


def test_a_refused_connection_is_unreachable_not_a_stall(tmp_path, trust_dir):
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(MirrorUnreachable, match="refused the connection or is unreachable"):
        list(DeadlineFetcher().fetch(f"{url}/metadata/timestamp.json"))
    provision_trust(trust_dir, make_repo(tmp_path))
    with pytest.raises(UpdateError) as e:
        update(trust_dir, url, tmp_path / "device", name=NAME, backend="sim")
    msg = str(e.value)
    assert e.value.stage == "download" and "could not be reached" in msg and "check --repo" in msg, msg
    assert "SlowRetrievalError" not in msg and "no answer" not in msg


def test_damaged_trust_files_beside_a_good_device_root_are_named_not_up_to_date(tmp_path, enclave, trust_dir):
    repo = make_repo(tmp_path)
    provision_trust(trust_dir, repo)
    state = tmp_path / "device"
    publish_verified(repo, trust_dir, new_release(enclave, tmp_path / "r3", 3))
    good_root = (trust_dir / "tuf-root.json").read_bytes()
    good_policy = (trust_dir / "policy.json").read_bytes()
    with RepoServer(repo.www) as server:
        assert update(trust_dir, server.url, state, name=NAME, backend="sim").action == "installed"
        assert (state / "tuf" / "root.json").is_file()  # from now on the device reads its own root
        other_role = repo.metadata_dir / "1.targets.json"
        for file, bad, says in (("tuf-root.json", b"garbage\n", "tuf-root.json is not a TUF root"),
                                ("tuf-root.json", other_role.read_bytes(), "tuf-root.json is not a TUF root"),
                                ("tuf-root.json", good_root.replace(b'"version": 1', b'"version": 7'),
                                 "tuf-root.json is not a TUF root signed by its own keys"),
                                ("policy.json", b"{\n", "policy.json")):
            (trust_dir / file).write_bytes(bad)
            with pytest.raises(UpdateError, match=says) as e:
                update(trust_dir, server.url, state)
            assert e.value.stage == "trust" and "up to date" not in str(e.value)
            assert read_update_record(state)["result"] == "refused"
            (trust_dir / "tuf-root.json").write_bytes(good_root)
            (trust_dir / "policy.json").write_bytes(good_policy)
        assert update(trust_dir, server.url, state).action == "current"
    assert read_device_state(state).last_good.version == 3
