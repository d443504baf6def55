"""What ``campaign resume`` decides from a campaign's files (pure: resume_plan), and the
directory operations around it (plan_resume, reopen) on real files."""

import json

from sealfl.server.bookkeeping import CampaignDir, save_checkpoint
from sealfl.server.campaign_files import CampaignView, resume_plan


def _view(state, rnd=2, n=5):
    return CampaignView(state, rnd, n, None)


def test_a_stopped_campaign_resumes_from_its_checkpoint_round():
    for state in ("interrupted", "failed"):
        plan = resume_plan(_view(state), None, owner_alive=None)
        assert plan.ok and plan.from_round == 2 and plan.num_rounds == 5
        assert plan.message == "resume will continue from round 2 of 5 (next: round 3)"
    dead = resume_plan(_view("running"), None, owner_alive=False)  # its owner was killed with -9
    assert dead.ok and dead.from_round == 2
    fresh = resume_plan(_view("interrupted", rnd=0), None, owner_alive=None)
    assert fresh.ok and "round 1 of 5" in fresh.message


def test_resume_is_refused_with_the_reason():
    cases = [
        (resume_plan(_view("finished", 5), None, owner_alive=None), "finished all 5 rounds"),
        (resume_plan(_view("running"), None, owner_alive=True), "owner process still runs"),
        (resume_plan(_view("starting"), None, owner_alive=None), "may still run"),
        (resume_plan(_view("interrupted"), "member 'round' is missing", owner_alive=None), "checkpoint is damaged"),
        (resume_plan(_view("failed", 5), None, owner_alive=None), "already holds all 5 rounds"),
        (resume_plan(_view("interrupted"), None, owner_alive=None, campaign_context_id="aa" * 16,
                     consortium_context_id="bb" * 16), "another consortium"),
    ]
    for plan, why in cases:
        assert not plan.ok and plan.message.startswith("cannot resume: ") and why in plan.message, plan.message
    same = resume_plan(_view("interrupted"), None, owner_alive=None, campaign_context_id="aa" * 16,
                       consortium_context_id="aa" * 16)
    assert same.ok


def _stopped_campaign(tmp_path, rounds_done=2, num_rounds=4):
    cd = CampaignDir(tmp_path / "camp", num_rounds)
    cd.dir.mkdir()
    cd.write_config({"context_id": "cc" * 16, "num_rounds": num_rounds})
    for r in range(1, rounds_done + 1):
        save_checkpoint(cd.dir, r, b"\x01" * 8, 10.0, b"\x02" * 8, {"round": r, "accepted": ["a", "b"]})
        with open(cd.rounds_path, "a") as fh:
            fh.write(json.dumps({"round": r}) + "\n")
    cd.status = {"status": "interrupted", "round": rounds_done, "num_rounds": num_rounds, "error": "stopped by SIGINT",
                 "owner": {"pid": 1, "start": 1, "host": "elsewhere-host"}, "finished": 3.0, "stopped": 4.0}
    cd._write_status()
    return cd


def test_plan_resume_reads_the_directory_and_reopen_levels_it(tmp_path):
    cd = _stopped_campaign(tmp_path)
    assert cd.plan_resume("cc" * 16).ok
    assert "another consortium" in cd.plan_resume("dd" * 16).message
    with open(cd.rounds_path, "a") as fh:
        fh.write('{"round": 3, "partial')  # a kill during the append
    rnd = CampaignDir(cd.dir).reopen({"pid": 123, "start": 5, "host": "h"})
    assert rnd == 2
    status = json.loads(cd.status_path.read_text())
    assert status["status"] == "starting" and status["round"] == 2 and status["error"] is None
    assert status["owner"]["pid"] == 123 and "stopped" not in status and "finished" not in status
    assert [(r["from_round"], r["previous_status"]) for r in status["resumed"]] == [(2, "interrupted")]
    assert [r["round"] for r in cd.rounds()] == [1, 2]


def test_a_damaged_checkpoint_is_named(tmp_path):
    cd = _stopped_campaign(tmp_path)
    cd.checkpoint_path.write_bytes(b"PK\x03\x04 not a checkpoint")
    plan = cd.plan_resume("cc" * 16)
    assert not plan.ok and "checkpoint is damaged" in plan.message and "global.npz" in plan.message


def test_resume_state_reads_the_checkpoint_statistics_and_the_noised_rounds(tmp_path):
    import pytest

    from sealfl.server.app import ServerConfig, resume_state
    from sealfl.server.errors import CampaignDirError

    cd = _stopped_campaign(tmp_path, rounds_done=3, num_rounds=5)
    cd.rounds_path.write_text("".join(json.dumps(r) + "\n" for r in
                                      [{"round": 1}, {"round": 2, "skipped": "too little noise"}, {"round": 3}]))
    cd.status["stats_declared_n"] = 606
    cd._write_status()
    cfg = ServerConfig(str(cd.dir), "p", "cc" * 16, {}, 4, 3, 5, 2, 3, resume_from=3)
    st = resume_state(cd, cfg)
    assert (st.round, st.model_ct, st.model_weight, st.stats_ct) == (3, b"\x01" * 8, 10.0, b"\x02" * 8)
    assert st.declared_n == 606 and st.noised_rounds == 2  # a DP round skipped for too little noise costs nothing
    cfg.resume_from = 2  # the checkpoint moved on since the coordinator planned: refused, named
    with pytest.raises(CampaignDirError, match="holds round 3, the campaign resumes after round 2"):
        resume_state(cd, cfg)
