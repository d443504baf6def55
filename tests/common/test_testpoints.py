"""The pure parts of interruption safety, without Ray: the campaign directory's commit
protocol and parsers, the release register, /proc parsing and killing a process tree,
and the test pause points themselves."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sealfl.common.procs import (
    identity,
    identity_alive,
    kill_run,
    non_loopback,
    parse_proc_net,
    parse_stat,
    read_stat,
    run_members,
)
from sealfl.common.testpoints import TestpointError, check_environment, event_path, parse_spec
from sealfl.platform.errors import ReleaseError
from sealfl.platform.register import check_new_version, mark_issued, parse_register, read_register, reserve, unreserve
from sealfl.server import bookkeeping
from sealfl.server.bookkeeping import CampaignDir
from sealfl.server.campaign_files import Checkpoint, campaign_view, checkpoint_bytes, parse_checkpoint, parse_status
from sealfl.server.errors import CampaignDirError
from tests.support.faults import REPO, wait_until

JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5),
                        st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                              max_size=2))


def _ck(rnd: int = 2, record: dict | None = None) -> Checkpoint:
    return Checkpoint(rnd, b"\x01" * 40, 123.0, b"\x02" * 30, record if record is not None else {"round": rnd})


# -- status.json ------------------------------------------------------------------------------

def _good_status() -> dict:
    return {"status": "running", "round": 1, "num_rounds": 3, "error": None,
            "owner": {"pid": 10, "start": 5, "host": "h"}, "worker": {"pid": 11, "start": 6, "host": "h"}}


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["status", "round", "num_rounds", "error", "owner", "worker", "pid"]), value=JSON_VALUES)
def test_kind_every_status_field_of_a_wrong_type_is_refused_by_name(field, value):
    doc = {**_good_status(), field: value}
    try:
        parse_status(json.dumps(doc).encode())
    except CampaignDirError as exc:
        assert field in str(exc)
        return
    # accepted: then the value really is one the field allows
    ok = {"status": lambda v: v in ("starting", "running", "finished", "failed", "interrupted"),
          "round": lambda v: type(v) is int and v >= 0,
          "num_rounds": lambda v: v is None or (type(v) is int and v >= 1),
          "error": lambda v: v is None or isinstance(v, str),
          "owner": lambda v: v is None, "worker": lambda v: v is None,
          "pid": lambda v: v is None or (type(v) is int and v > 0)}
    assert ok[field](value), (field, value)


@pytest.mark.parametrize("data, words", [(b"\xff\xfe", "not JSON"), (b"[1]", "document must be an object, got array"),
                                         (b"{" * 100_000, "not JSON"), (b" " * (2 << 20), "bytes")])
def test_kind_status_that_is_not_a_json_object_is_refused(data, words):
    with pytest.raises(CampaignDirError, match=words):
        parse_status(data)


# -- checkpoint ----------------------------------------------------------------------------

def test_kind_checkpoint_round_trips_with_its_record():
    ck = _ck(3, {"round": 3, "pooled_test_accuracy": 0.8})
    assert parse_checkpoint(checkpoint_bytes(ck)) == ck


def test_kind_every_truncation_of_a_checkpoint_is_refused_not_crashing():
    data = checkpoint_bytes(_ck())
    for n in range(0, len(data), 7):
        with pytest.raises(CampaignDirError):
            parse_checkpoint(data[:n])


def _npz(**arrays) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


GOOD = dict(model_ct=np.ones(8, np.uint8), model_weight=np.array([5.0]), stats_ct=np.ones(4, np.uint8),
            round=np.array([2], np.int64))


@pytest.mark.parametrize("change, words", [
    ({"model_ct": np.ones(8, np.float32)}, "model_ct"),
    ({"model_weight": np.array([5.0, 1.0])}, "model_weight"),
    ({"model_weight": np.array([np.nan])}, "model_weight"),
    ({"round": np.array([0], np.int64)}, "round"),
    ({"round": np.array([2.0])}, "round"),
    ({"stats_ct": np.zeros(0, np.uint8)}, "stats_ct"),
    ({"extra": np.ones(1)}, "unexpected member"),
    ({"record": np.frombuffer(b'{"round": 1}', np.uint8)}, "record"),
    ({"record": np.frombuffer(b"not json", np.uint8)}, "record"),
])
def test_kind_checkpoint_members_of_the_wrong_shape_type_or_value_are_named(change, words):
    with pytest.raises(CampaignDirError, match=words):
        parse_checkpoint(_npz(**{**GOOD, **change}))
    missing = dict(GOOD)
    missing.pop("model_ct")
    with pytest.raises(CampaignDirError, match="missing member"):
        parse_checkpoint(_npz(**missing))


def test_kind_compressed_or_pickled_checkpoint_members_are_refused(tmp_path):
    import io

    buf = io.BytesIO()
    np.savez_compressed(buf, **GOOD)
    with pytest.raises(CampaignDirError, match="compressed"):
        parse_checkpoint(buf.getvalue())
    buf = io.BytesIO()
    np.savez(buf, **{**GOOD, "model_ct": np.array([object()], dtype=object)})
    with pytest.raises(CampaignDirError, match="model_ct"):
        parse_checkpoint(buf.getvalue())


# -- the commit protocol --------------------------------------------------------------------

class _Crash(BaseException):
    pass


def _run_rounds(cd: CampaignDir, rounds: int) -> None:
    cd.begin()
    for r in range(1, rounds + 1):
        cd.note(pooled_test_accuracy=0.5 + r / 100)
        cd.stage_checkpoint(r, bytes([r]) * 16, 10.0 * r, b"\x07" * 8)
        cd.end_round(r)


def test_kind_a_round_cut_at_any_write_recovers_to_one_committed_round(tmp_path, monkeypatch):
    """Crash at the k-th file operation of a 3-round run, for every k: after recover(),
    rounds.jsonl, status.json and the checkpoint name the same last round, its record is
    the checkpoint's, and no temporary file is left."""
    calls = {"n": 0, "crash_at": None}
    real = {"replace": os.replace, "write": os.write, "fsync": os.fsync}

    def counting(name):
        def f(*a, **kw):
            calls["n"] += 1
            if calls["n"] == calls["crash_at"]:
                raise _Crash(name)
            return real[name](*a, **kw)
        return f

    for name in real:
        monkeypatch.setattr(os, name, counting(name))
    calls["crash_at"] = None
    _run_rounds(CampaignDir(tmp_path / "probe", 3), 3)
    total = calls["n"]
    assert total > 10
    for k in range(1, total + 1):
        d = tmp_path / f"cut{k}"
        calls.update(n=0, crash_at=k)
        try:
            _run_rounds(CampaignDir(d, 3), 3)
        except _Crash:
            pass
        calls["crash_at"] = None
        cd = CampaignDir(d, 3)
        if not cd.status_path.exists():
            continue  # cut before the first status write: nothing to recover
        last = cd.recover()
        rounds = [r["round"] for r in cd.rounds()]
        assert rounds == list(range(1, last + 1)), (k, rounds, last)
        assert cd.read_status()["round"] == last
        if last:
            ck = cd.read_checkpoint()
            assert ck.round == last and ck.record == cd.rounds()[-1] and ck.model_ct == bytes([last]) * 16
        assert cd.temporaries() == []


def test_kind_a_partial_rounds_line_and_a_lost_record_are_repaired(tmp_path):
    cd = CampaignDir(tmp_path, 5)
    _run_rounds(cd, 2)
    bookkeeping.save_checkpoint(tmp_path, 3, b"\x03" * 16, 30.0, b"\x07" * 8, {"round": 3, "x": 1})
    with open(cd.rounds_path, "ab") as fh:
        fh.write(b'{"round": 3, "pooled')  # killed mid-append
    (tmp_path / ".status.json.abc.tmp").write_text("half")
    assert cd.recover() == 3
    assert [r["round"] for r in cd.rounds()] == [1, 2, 3] and cd.rounds()[-1] == {"round": 3, "x": 1}
    assert cd.read_status()["round"] == 3 and cd.temporaries() == []


def test_kind_interrupted_status_names_the_signal_and_the_round(tmp_path):
    cd = CampaignDir(tmp_path, 5)
    _run_rounds(cd, 2)
    epoch = cd.read_status().get("epoch", 0)
    status = cd.mark_interrupted(signal.SIGTERM)
    assert status["status"] == "interrupted" and status["round"] == 2
    assert "SIGTERM" in status["error"] and "round 2" in status["error"]
    assert cd.read_status() == status and status["epoch"] == epoch + 1  # the stopped run is fenced out


# -- who is alive -------------------------------------------------------------------------

def test_kind_campaign_view_reports_a_running_campaign_with_a_dead_owner_as_dead():
    s = parse_status(json.dumps(_good_status()).encode())
    assert campaign_view(s, 1, False).state == "dead"
    assert "stopped unexpectedly" in campaign_view(s, 1, False).note
    assert campaign_view(s, 1, True).state == "running"
    assert campaign_view(s, None, None).state == "running" and "host h" in campaign_view(s, None, None).note
    assert campaign_view({**s, "status": "finished"}, 3, False).state == "finished"
    assert campaign_view(s, 2, False).round == 2


def test_kind_owner_liveness_checks_pid_and_start_time(tmp_path):
    me = identity()
    assert identity_alive(me) is True
    assert identity_alive({**me, "start": me["start"] + 1}) is False  # a recycled pid is another process
    assert identity_alive({**me, "host": socket.gethostname() + "-elsewhere"}) is None
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert identity_alive({"pid": int(p.stdout), "start": 1}) is False


def test_kind_prepare_refuses_a_directory_whose_campaign_still_runs(tmp_path):
    cd = CampaignDir(tmp_path / "c")
    cd.prepare(3, overwrite=False, owner=identity())  # this test process is the live owner
    with pytest.raises(CampaignDirError, match="still starting"):
        CampaignDir(tmp_path / "c").prepare(3, overwrite=True, owner=identity())
    dead = {**identity(), "start": identity()["start"] + 1}
    cd.set_status(owner=dead)
    with pytest.raises(CampaignDirError, match="--overwrite"):
        CampaignDir(tmp_path / "c").prepare(3, overwrite=False, owner=identity())
    (tmp_path / "c" / ".rounds.jsonl.x.tmp").write_text("stale")
    CampaignDir(tmp_path / "c").prepare(3, overwrite=True, owner=identity())
    assert CampaignDir(tmp_path / "c").temporaries() == []


# -- /proc ------------------------------------------------------------------------------------

def test_kind_proc_stat_with_any_process_name_parses():
    line = "4242 (a) b (c) S 1 4242 4242 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 987654 1000 10 1 2 3"
    st = parse_stat(line)
    assert (st.pid, st.comm, st.state, st.ppid, st.pgid, st.sid, st.start) == (4242, "a) b (c", "S", 1, 4242, 4242,
                                                                              987654)
    assert read_stat(os.getpid()).pid == os.getpid()


def test_kind_proc_net_addresses_decode_like_the_kernel_writes_them():
    v4 = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
          "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1\n"
          "   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1\n"
          "   2: 0100007F:0050 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 333 1\n")
    assert parse_proc_net(v4, ipv6=False) == [("127.0.0.1", 8080, "111"), ("0.0.0.0", 22, "222")]
    v6 = ("  sl  local_address                         remote_address                        st\n"
          "   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 0 0 0 0 0 444 1\n"
          "   1: 0000000000000000FFFF00000100007F:0050 00000000000000000000000000000000:0000 0A 0 0 0 0 0 555 1\n"
          "   2: 00000000000000000000000000000000:0051 00000000000000000000000000000000:0000 0A 0 0 0 0 0 666 1\n")
    got = parse_proc_net(v6, ipv6=True)
    assert got == [("::1", 8080, "444"), ("::ffff:127.0.0.1", 80, "555"), ("::", 81, "666")]
    assert socket.inet_pton(socket.AF_INET6, got[1][0]) == bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1])
    socks = {1: [("127.0.0.1", 1), ("::1", 2), ("::ffff:127.0.0.1", 3)], 2: [("::", 4)], 3: [("0.0.0.0", 5)],
             4: [("192.0.2.7", 6)]}
    assert non_loopback(socks) == [(2, "::", 4), (3, "0.0.0.0", 5), (4, "192.0.2.7", 6)]


def test_kind_kill_run_finds_processes_by_session_and_by_token(tmp_path):
    token = os.urandom(8).hex()
    # a session leader with a child in its session, and a grandchild that left the session (setsid)
    code = ("import os, subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "subprocess.Popen([sys.executable, '-c', 'import os, sys, time; os.setsid(); "
            "open(sys.argv[1], \"w\").close(); time.sleep(600)', sys.argv[1]])\n"
            "time.sleep(600)\n")
    leader = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "escaped")], start_new_session=True,
                              env={**os.environ, "SEALFL_RUN_TOKEN": token})
    try:
        wait_until((tmp_path / "escaped").exists, "the grandchild to leave the session")
        wait_until(lambda: len(run_members(token, leader.pid)) == 3, "3 processes in the run")
        assert len(run_members("other-token", leader.pid)) == 2  # the escaped grandchild carries only the token
        assert kill_run(token, leader.pid, deadline_s=30) == []
        assert run_members(token, leader.pid) == []
    finally:
        if leader.poll() is None:
            leader.kill()
        leader.wait()


# -- pause points ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec, want", [("train", ("train", None)), ("checkpoint@2", ("checkpoint", 2)),
                                        (" before-ray ", ("before-ray", None))])
def test_kind_pause_point_specs_parse(spec, want):
    assert parse_spec(spec) == want


@pytest.mark.parametrize("spec", ["trian", "train@0", "train@x", "train@", "@2", ""])
def test_kind_malformed_pause_point_specs_fail_loudly(spec, tmp_path):
    with pytest.raises(TestpointError):
        parse_spec(spec)
    with pytest.raises(TestpointError):
        check_environment({"SEALFL_PAUSE_AT": "train", "SEALFL_PAUSE_DIR": str(tmp_path / "missing")})


def test_kind_pause_point_publishes_its_event_and_blocks_only_at_its_stage(tmp_path):
    code = ("from sealfl.common.testpoints import testpoint\n"
            "testpoint('train', 1); testpoint('aggregate', 2)\n"
            "print('passed', flush=True)\n"
            "testpoint('train', 2)\n"
            "print('not reached', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": REPO, "SEALFL_PAUSE_AT": "train@2", "SEALFL_PAUSE_DIR": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "passed"
        ev = Path(event_path("train", tmp_path))
        wait_until(ev.exists, "the event file")
        assert json.loads(ev.read_text()) == {"stage": "train", "round": 2, "pid": p.pid}
        assert p.poll() is None  # still paused
    finally:
        p.kill()
        p.wait()
    assert "not reached" not in p.stdout.read()


# -- the release register ----------------------------------------------------------------------

D = "ab" * 32


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(["version", "state", "root_digest"]), value=JSON_VALUES)
def test_kind_every_register_field_of_a_wrong_type_is_refused_by_entry(field, value):
    doc = [{"version": 1, "state": "issued", "root_digest": D, "dir": "r1"}, {"version": 2, "root_digest": D}]
    doc[1][field] = value
    try:
        entries = parse_register(json.dumps(doc).encode())
    except ReleaseError as exc:
        assert "entry 1" in str(exc) or "twice" in str(exc)
        return
    assert entries[1][field] == value and field != "version" or type(value) is int


def test_kind_register_that_is_not_a_list_of_objects_is_refused():
    for data in (b"{}", b"[1]", b"not json", b'[{"version": 1, "root_digest": "' + D.encode() + b'"}] x'):
        with pytest.raises(ReleaseError):
            parse_register(data)


def test_kind_no_version_is_issued_twice_even_if_a_build_died_after_reserving(tmp_path):
    reserve(tmp_path, 3, "r3")  # ... killed here: the version stays reserved
    with pytest.raises(ReleaseError, match="reserved by a build that did not finish.*use --version 4"):
        check_new_version(read_register(tmp_path), 3)
    reserve(tmp_path, 4, "r4")
    mark_issued(tmp_path, 4, D, "r4")
    with pytest.raises(ReleaseError, match="latest release v4.*use --version 5"):
        reserve(tmp_path, 4, "again")
    reserve(tmp_path, 5, "r5")
    unreserve(tmp_path, 5)  # a build that failed before its rename gives the version back
    assert [(e["version"], e["state"]) for e in read_register(tmp_path)] == [(3, "reserved"), (4, "issued")]


def test_kind_concurrent_builds_cannot_both_reserve_a_version(tmp_path):
    won, lost = [], []
    barrier = threading.Barrier(6)

    def build(i):
        barrier.wait()
        try:
            reserve(tmp_path, 8, f"r{i}")
            won.append(i)
        except ReleaseError:
            lost.append(i)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 5
    assert [e["version"] for e in read_register(tmp_path)] == [8]


def test_kind_checkpoint_file_written_by_hand_is_still_checked(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    with zipfile.ZipFile(tmp_path / "checkpoint" / "global.npz", "w") as z:
        z.writestr("model_ct.npy", b"garbage")
    with pytest.raises(CampaignDirError, match="global.npz"):
        bookkeeping.load_checkpoint(tmp_path)


def test_kind_the_supervising_process_never_imports_ray_or_flowers_runtime():
    # Flower's simulation runtime (flwr.simulation, the vce backend) and Ray stay in the worker
    code = ("import sys\n"
            "import sealfl.platform.cli, sealfl.platform.campaign, sealfl.platform.fedeval, sealfl.platform.release\n"
            "import sealfl.platform.demo, sealfl.platform.supervisor, sealfl.platform.progress\n"
            "print(' '.join(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'flwr.simulation', \n"
            "                                                                           'flwr.server.superlink.fleet.vce')))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO}, check=True)
    assert out.stdout.split() == []

