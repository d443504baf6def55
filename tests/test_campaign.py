"""Campaigns on real Ray with real Flower apps, on the real four-hospital data."""

import numpy as np
import pytest

from sealfl.clients.data import HOSPITALS, load_partitions
from sealfl.clients.task import HeartTask
from sealfl.platform.campaign import CampaignSpec, run_campaign
from sealfl.platform.consortium import create_consortium
from sealfl.platform.errors import CampaignError, SimulationError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    d = tmp_path_factory.mktemp("consortium")
    cons, _ = create_consortium(d / "c", "heart", list(HOSPITALS))
    return cons


def _round0_accuracy() -> float:
    # the initial model is all zeros: p = 0.5 for every row, so every row is called
    # "disease" and round-0 accuracy is the share of positive test rows
    y = np.concatenate([p.y_test for p in load_partitions()])
    assert np.all(HeartTask().init_params() == 0)
    return float(np.mean(y == 1.0))


def test_two_round_campaign_improves_over_round0(consortium, tmp_path):
    seen = []
    res = run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "camp"), rounds=2), on_round=seen.append)
    assert res.status["status"] == "finished"
    assert res.status["server_has_secret_key"] is False
    assert [r["round"] for r in res.rounds] == [1, 2]
    assert [r["round"] for r in seen] == [1, 2]
    assert all(r["accepted"] == sorted(HOSPITALS) for r in res.rounds)
    acc0 = _round0_accuracy()
    assert res.rounds[-1]["pooled_test_accuracy"] > acc0 + 0.1
    assert (tmp_path / "camp" / "checkpoint" / "global.npz").exists()


def _faulty_app(consortium_dir, bad_partition, mode):
    """The partner app, except that one partner sends a broken update."""
    from flwr.app import Array
    from flwr.clientapp import ClientApp

    from sealfl.clients import app as capp

    app = ClientApp()

    @app.query()
    def q(msg, ctx):
        return capp.handle_query(msg, ctx, consortium_dir)

    @app.train()
    def t(msg, ctx):
        reply = capp.handle_train(msg, ctx, consortium_dir)
        if int(ctx.node_config["partition-id"]) in bad_partition:
            good = reply.content["update"]["update_ct"].numpy()
            if mode == "garbage":
                bad = np.random.default_rng(0).integers(0, 256, len(good), dtype=np.uint8)
            else:  # truncated
                bad = good[: len(good) // 2].copy()
            reply.content["update"]["update_ct"] = Array(bad)
            # the partner itself sends it: signed with its own key, so the ciphertext checks must catch it
            from sealfl.clients.kit import kit_dir, load_kit

            capp.sign_reply(load_kit(str(kit_dir(consortium_dir, reply.content["partner"]["name"]))), msg,
                            reply.content)
        return reply

    @app.evaluate()
    def e(msg, ctx):
        return capp.handle_evaluate(msg, ctx, consortium_dir)

    return app


def test_garbage_ciphertext_is_rejected_and_round_goes_on(consortium, tmp_path):
    app = _faulty_app(str(consortium.dir), {1}, "garbage")
    res = run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "camp"), rounds=1, min_partners=3),
                       client_app=app)
    (r,) = res.rounds
    assert r["accepted"] == sorted(set(HOSPITALS) - {HOSPITALS[1]})
    assert list(r["rejected"]) == [HOSPITALS[1]]
    assert "update.update_ct" in r["rejected"][HOSPITALS[1]]
    assert r["pooled_test_accuracy"] > _round0_accuracy() + 0.1


def test_too_few_valid_partners_fails_clearly(consortium, tmp_path):
    app = _faulty_app(str(consortium.dir), {0, 1}, "truncated")
    with pytest.raises(CampaignError, match="min_partners=3"):
        run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "camp"), rounds=1, min_partners=3),
                     client_app=app)


def test_campaign_joins_a_running_ray(consortium, tmp_path):
    import ray

    ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        res = run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "camp"), rounds=1))
        assert res.status["status"] == "finished"
        assert res.ray == {"gcs_address": ctx.address_info["gcs_address"], "started_here": False}
    finally:
        ray.shutdown()


def test_bad_settings_fail_before_ray_starts(consortium, tmp_path):
    import time

    t0 = time.perf_counter()
    for kw, words in [({"min_partners": 9}, "min_partners=9"), ({"lr": float("nan")}, "learning rate"),
                      ({"ray_address": "127.0.0.1:1"}, "cannot reach the Ray cluster")]:
        with pytest.raises((CampaignError, SimulationError), match=words):
            run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "c"), rounds=1, **kw))
    assert time.perf_counter() - t0 < 30  # no Ray start-up, no minutes of GCS retries


def test_campaign_refuses_to_overwrite_a_campaign(consortium, tmp_path):
    out = tmp_path / "camp"
    out.mkdir()
    (out / "status.json").write_text('{"status": "finished"}')
    with pytest.raises(CampaignError, match="--overwrite"):
        run_campaign(CampaignSpec(str(consortium.dir), str(out), rounds=1))


def test_ctrl_c_stops_the_campaign_and_records_it(consortium, tmp_path):
    import json
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "camp"
    proc = subprocess.Popen([sys.executable, "-m", "sealfl.platform.cli", "campaign", "run", "-c", str(consortium.dir),
                             "-o", str(out), "--rounds", "500"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "rounds.jsonl").exists():
                break
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode(errors="replace")[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "interrupted" and "signal 2" in status["error"]
    assert (out / "checkpoint" / "global.npz").exists()


def test_campaign_dir_may_not_overlap_the_consortium(consortium):
    with pytest.raises(CampaignError, match="overlaps"):
        run_campaign(CampaignSpec(str(consortium.dir), str(consortium.dir / "camp"), rounds=1))
