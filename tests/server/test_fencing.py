"""Run epochs fence a campaign directory: the decision (pure: fence_verdict) and the
directory operations that obey it (prepare, reopen, begin, set_status, end_round) on real
files -- a run left alive after a resume writes nothing, whatever it tries."""

import json
import threading

import pytest

from sealfl.server.bookkeeping import CampaignDir
from sealfl.server.campaign_files import fence_verdict, parse_status
from sealfl.server.errors import CampaignDirError, StaleRunError

OWNER = {"pid": 4242, "start": 7, "host": "coordinator-host"}


def test_only_the_directorys_own_epoch_may_write():
    assert fence_verdict(3, 3) is None
    assert fence_verdict(None, 0) is None  # a directory and a run from before epochs
    old = fence_verdict(3, 2)
    assert "epoch 2" in old and "taken over by run epoch 3" in old and "campaign resume" in old
    new = fence_verdict(1, 2)
    assert "epoch 2" in new and "records epoch 1" in new and "replaced" in new
    assert fence_verdict(None, 1) is not None  # the directory lost its epoch under a run of epoch 1
    for bad in (True, "3", -1, 2.0):
        assert "not a run epoch" in fence_verdict(bad, 2), bad


def test_status_json_with_a_bad_epoch_is_refused_by_name():
    with pytest.raises(CampaignDirError, match="epoch"):
        parse_status(json.dumps({"status": "running", "epoch": "two"}).encode())
    assert parse_status(json.dumps({"status": "running", "epoch": 4}).encode())["epoch"] == 4


def _files(cd: CampaignDir) -> dict:
    return {p.name: p.read_bytes() for p in (cd.status_path, cd.rounds_path, cd.checkpoint_path) if p.exists()}


def _run_round(agg: CampaignDir, rnd: int) -> None:
    agg.note(accepted=["a", "b"], train_loss=0.5)
    agg.stage_checkpoint(rnd, bytes([rnd]) * 8, 10.0, b"\x02" * 8)
    agg.end_round(rnd)


def test_a_run_left_alive_after_a_resume_writes_nothing(tmp_path):
    cd = CampaignDir(tmp_path / "camp")
    cd.prepare(3, overwrite=False, owner=OWNER)
    assert cd.read_status()["epoch"] == 1
    old = CampaignDir(cd.dir, 3, epoch=1)  # the first run's ServerApp
    old.begin()
    _run_round(old, 1)
    rnd = CampaignDir(cd.dir).reopen(OWNER)  # campaign resume while that ServerApp still lives
    status = cd.read_status()
    assert rnd == 1 and status["epoch"] == 2 and status["resumed"][-1]["epoch"] == 2
    before = _files(cd)
    with pytest.raises(StaleRunError, match="taken over by run epoch 2"):
        _run_round(old, 2)  # its round 2: checkpoint, record and status all refused
    with pytest.raises(StaleRunError):
        old.set_status(status="failed", error="late write of the stopped run")
    with pytest.raises(StaleRunError):
        old.begin()
    assert _files(cd) == before  # not a byte changed
    new = CampaignDir(cd.dir, 3, epoch=2)  # the resumed run
    new.begin(resumed_from=1)
    _run_round(new, 2)
    new.set_status(status="finished")
    status = cd.read_status()
    assert status["status"] == "finished" and status["round"] == 2 and status["resumed"][0]["from_round"] == 1
    assert [r["round"] for r in cd.rounds()] == [1, 2] and cd.read_checkpoint().model_ct == b"\x02" * 8


def test_the_aggregator_never_overwrites_what_the_coordinator_recorded(tmp_path):
    cd = CampaignDir(tmp_path / "camp")
    cd.prepare(2, overwrite=False, owner=OWNER)
    agg = CampaignDir(cd.dir, 2, epoch=1)
    agg.begin()  # read the status before the coordinator recorded its run id
    CampaignDir(cd.dir).amend_status(deployment={"superlink": "127.0.0.1:1", "run_id": 77})
    agg.set_status(server_has_secret_key=False)
    _run_round(agg, 1)
    status = cd.read_status()
    assert status["deployment"]["run_id"] == 77 and status["server_has_secret_key"] is False
    assert status["owner"] == OWNER and status["round"] == 1


def test_overwrite_takes_the_next_epoch_so_an_old_run_of_the_replaced_campaign_is_fenced(tmp_path):
    cd = CampaignDir(tmp_path / "camp")
    cd.prepare(2, overwrite=False, owner=OWNER)
    CampaignDir(cd.dir).reopen(OWNER)  # epoch 2
    old = CampaignDir(cd.dir, 2, epoch=2)
    old.begin()
    old.set_status(status="failed", error="x")  # allowed: its own epoch
    cd.prepare(2, overwrite=True, owner=OWNER)
    assert cd.read_status()["epoch"] == 3
    with pytest.raises(StaleRunError):
        old.set_status(status="failed", error="a write into the new campaign")
    assert cd.read_status()["status"] == "starting"


def test_a_resume_waits_for_a_round_commit_in_progress(tmp_path):
    """The commit holds the directory's lock: reopen cannot interleave with it."""
    import fcntl
    import os

    cd = CampaignDir(tmp_path / "camp")
    cd.prepare(3, overwrite=False, owner=OWNER)
    fd = os.open(cd.dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what end_round holds while it commits
    done = threading.Event()
    t = threading.Thread(target=lambda: (CampaignDir(cd.dir).reopen(OWNER), done.set()))
    t.start()
    try:
        assert not done.wait(0.5) and cd.read_status()["epoch"] == 1
    finally:
        os.close(fd)
    t.join(30)
    assert done.is_set() and cd.read_status()["epoch"] == 2


def test_a_run_stopped_by_its_coordinator_cannot_overwrite_the_interruption(tmp_path):
    """Ctrl-C of a deployed campaign: the coordinator stops the run and records it interrupted;
    the ServerApp, which ends some time after ``flwr stop``, must not replace that record with
    its own "failed" (seen: ``error: SystemExit: 0``)."""
    import signal

    cd = CampaignDir(tmp_path / "camp")
    cd.prepare(5, overwrite=False, owner=OWNER)
    run = CampaignDir(cd.dir, 5, epoch=1)
    run.begin()
    _run_round(run, 1)
    _run_round(run, 2)
    status = CampaignDir(cd.dir).mark_interrupted(signal.SIGINT)
    assert status["status"] == "interrupted" and status["round"] == 2 and status["epoch"] == 2
    before = _files(cd)
    with pytest.raises(StaleRunError):
        run.set_status(status="failed", error="SystemExit: 0")
    with pytest.raises(StaleRunError):
        _run_round(run, 3)
    assert _files(cd) == before and cd.read_status()["status"] == "interrupted"
    assert CampaignDir(cd.dir).reopen(OWNER) == 2 and cd.read_status()["epoch"] == 3  # resume takes the next one


def test_a_stopped_run_that_committed_the_last_round_is_completed_not_run_again(tmp_path):
    """The coordinator died in the last round; its ServerApp committed that round before the
    resume stopped it: the resume levels the directory at the last round and records the
    campaign finished (a new run would start after the last round: refused as nonsense)."""
    cd = CampaignDir(tmp_path / "camp")
    cd.prepare(2, overwrite=False, owner=OWNER)
    run = CampaignDir(cd.dir, 2, epoch=1)
    run.begin()
    _run_round(run, 1)
    with pytest.raises(CampaignDirError, match="round 1 of 2; not complete"):
        CampaignDir(cd.dir).mark_complete("too early")
    _run_round(run, 2)  # committed, but the run never wrote "finished"
    coordinator = CampaignDir(cd.dir)
    assert coordinator.reopen(OWNER) == 2
    status = coordinator.mark_complete("all 2 rounds were committed by the run that was stopped")
    assert status["status"] == "finished" and status["round"] == 2 and "committed" in status["note"]
    assert cd.read_status()["status"] == "finished" and [r["round"] for r in cd.rounds()] == [1, 2]
    with pytest.raises(StaleRunError):  # and the stopped run is fenced out as by any resume
        run.set_status(status="failed", error="late")
