"""``sealfl campaign resume`` with real processes: a campaign stopped with Ctrl-C in round
2, resumed, its resumed coordinator killed with SIGKILL in round 3, resumed again, ends
with exactly the model of an uninterrupted run (packed BFV, fixed seeds: decrypted
checkpoints np.array_equal)."""

import json
import signal

import numpy as np
import pytest

from sealfl.clients.heart.data import HOSPITALS
from sealfl.platform.consortium import create_consortium
from sealfl.server.bookkeeping import CampaignDir
from tests.support.faults import assert_tree_gone, run_cli, start_cli

pytestmark = pytest.mark.slow

ROUNDS = 3


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    cons, codec = create_consortium(tmp_path_factory.mktemp("consortium") / "c", "heart", list(HOSPITALS))
    return cons, codec


def _final_model(codec, out):
    ck = CampaignDir(out).read_checkpoint()
    return ck.round, codec.decrypt(ck.model_ct), ck.model_weight


@pytest.fixture(scope="module")
def uninterrupted(consortium, tmp_path_factory):
    cons, codec = consortium
    out = tmp_path_factory.mktemp("ref") / "camp"
    r = run_cli(["campaign", "run", "-c", cons.dir, "-o", out, "--rounds", ROUNDS])
    assert r.returncode == 0, r.stderr[-3000:]
    return _final_model(codec, out)


def _paused(args, stage, tmp_path):
    """Run the CLI until pause point ``stage``; returns the run and (worker pid, run token)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = start_cli(args, stage, tmp_path)
    try:
        run.wait_paused()
        return run, run.tree()
    except BaseException:
        run.kill()
        raise


def _expect_resume(out, from_round):
    shown = json.loads(run_cli(["campaign", "status", out, "--json"]).stdout)
    assert shown["resume"] == {"possible": True, "from_round": from_round, "num_rounds": ROUNDS,
                               "message": f"resume will continue from round {from_round} of {ROUNDS} "
                                          f"(next: round {from_round + 1})"}
    table = run_cli(["campaign", "status", out])
    assert f"resume will continue from round {from_round} of {ROUNDS}" in " ".join(table.stdout.split())


def test_ctrl_c_then_sigkill_of_the_resumed_coordinator_then_resume_gives_the_uninterrupted_model(
        consortium, uninterrupted, tmp_path):
    cons, codec = consortium
    out = tmp_path / "camp"
    # 1. Ctrl-C while a partner trains round 3: exit 130, round 1 committed (round 2's evaluation
    #    travels in round 3's train replies, so round 2 is not finished yet)
    run, _ = _paused(["campaign", "run", "-c", cons.dir, "-o", out, "--rounds", ROUNDS], "train@3", tmp_path / "a")
    try:
        run.proc.send_signal(signal.SIGINT)
        rc, stderr = run.finish()
    finally:
        run.kill()
    assert rc == 130, stderr[-3000:]
    assert CampaignDir(out).read_status()["status"] == "interrupted"
    _expect_resume(out, 1)
    # 2. resume; its coordinator is killed with SIGKILL while adding round 3 (rounds 2 committed)
    run, (worker, token) = _paused(["campaign", "resume", out, "-c", cons.dir], "aggregate@3", tmp_path / "b")
    try:
        busy = run_cli(["campaign", "resume", out, "-c", cons.dir])  # its owner still runs: refused, untouched
        assert busy.returncode == 1 and "still runs" in " ".join(busy.stderr.split()), busy.stderr[-2000:]
        assert CampaignDir(out).read_status()["status"] == "running"
        run.proc.send_signal(signal.SIGKILL)
        run.finish()
    finally:
        run.kill()
    assert_tree_gone(token, worker)
    assert CampaignDir(out).view().state == "dead"
    _expect_resume(out, 2)
    # 3. resume again: to the end
    r = run_cli(["campaign", "resume", out, "-c", cons.dir])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resume will continue from round 2 of {ROUNDS}" in " ".join(r.stdout.split())
    cd = CampaignDir(out)
    status = cd.read_status()
    assert status["status"] == "finished" and status["round"] == ROUNDS
    assert [(x["from_round"], x["previous_status"]) for x in status["resumed"]] == [(1, "interrupted"), (2, "running")]
    assert [x["round"] for x in cd.rounds()] == list(range(1, ROUNDS + 1))
    rnd, model, weight = _final_model(codec, out)
    ref_rnd, ref_model, ref_weight = uninterrupted
    assert rnd == ref_rnd == ROUNDS and weight == ref_weight
    assert np.array_equal(model, ref_model)  # packed BFV, fixed seeds: bit for bit
    again = run_cli(["campaign", "resume", out, "-c", cons.dir])
    assert again.returncode == 1 and f"finished all {ROUNDS} rounds" in " ".join(again.stderr.split())
    assert "Traceback" not in again.stderr


def test_a_campaign_of_another_consortium_is_refused_and_left_as_it_was(consortium, tmp_path):
    cons, _ = consortium
    other, _ = create_consortium(tmp_path / "other", "heart", list(HOSPITALS))
    out = tmp_path / "camp"
    prepared = run_cli(["campaign", "run", "-c", cons.dir, "-o", out, "--rounds", ROUNDS, "--prepare-only"])
    assert prepared.returncode == 0, prepared.stderr[-2000:]  # its owner (that CLI) is gone: resumable by cons
    assert CampaignDir(out).plan_resume(cons.context_id).ok
    before = CampaignDir(out).status_path.read_bytes()
    r = run_cli(["campaign", "resume", out, "-c", other.dir])
    assert r.returncode == 1 and "another consortium" in " ".join(r.stderr.split()), r.stderr[-2000:]
    assert "resume will" not in r.stdout and "encrypted rounds" not in r.stdout  # refused before it is announced
    assert CampaignDir(out).status_path.read_bytes() == before
