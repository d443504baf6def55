"""Campaigns on real Ray with real Flower apps, on the real four-hospital data."""

import json

import numpy as np
import pytest

from sealfl.clients.heart.data import HOSPITALS, load_partitions
from sealfl.clients.heart.task import HeartTask
from sealfl.platform.campaign import CampaignSpec, run_campaign
from sealfl.platform.consortium import create_consortium
from sealfl.platform.errors import CampaignError, SimulationError
from tests.support.faults import APP_DIR, run_processes

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
    assert res.ray["auth"] == "token" and res.ray["loopback_only"] is True
    # nothing of the run is left: Ray's agents stay in the worker's session, which must be empty
    assert run_processes("-", res.status["worker"]["pid"]) == []


def test_kind_a_ckks_consortium_trains_the_same_model_as_the_default_bfv_one(consortium, tmp_path):
    """``--he ckks`` runs the same Flower apps with the CKKS codec (partners send ``n_i w_i``,
    the default packed BFV sends shares and key holders scale by N): after 2 rounds the pooled
    accuracy equals the BFV campaign's to within one test row (both compute weighted FedAvg;
    they differ only by CKKS noise ~1e-8 and BFV's 2^-23 grid)."""
    from sealfl.he.codecs import params_for

    ckks, _ = create_consortium(tmp_path / "ckks", "heart", list(HOSPITALS), params=params_for("ckks"))
    bfv = consortium  # created without --he: the default codec
    assert bfv.he_params.to_dict()["scheme"] == "BFV" and ckks.he_params.to_dict()["scheme"] == "CKKS"
    a = run_campaign(CampaignSpec(str(ckks.dir), str(tmp_path / "ckks-camp"), rounds=2))
    b = run_campaign(CampaignSpec(str(bfv.dir), str(tmp_path / "bfv-camp"), rounds=2))
    assert b.status["status"] == "finished" and b.status["server_has_secret_key"] is False
    assert all(r["accepted"] == sorted(HOSPITALS) for r in b.rounds)
    rows = sum(len(p.y_test) for p in load_partitions())
    assert abs(a.rounds[-1]["pooled_test_accuracy"] - b.rounds[-1]["pooled_test_accuracy"]) <= 1.0 / rows + 1e-12
    assert b.rounds[-1]["pooled_test_accuracy"] > _round0_accuracy() + 0.1


def test_garbage_ciphertext_is_rejected_and_round_goes_on(consortium, tmp_path):
    res = run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "camp"), rounds=1, min_partners=3),
                       client_app="faults:make_broken_update_app",
                       client_app_kwargs={"bad_partitions": [1], "mode": "garbage"}, app_dir=APP_DIR)
    (r,) = res.rounds
    assert r["accepted"] == sorted(set(HOSPITALS) - {HOSPITALS[1]})
    assert list(r["rejected"]) == [HOSPITALS[1]]
    assert "update.update_ct" in r["rejected"][HOSPITALS[1]]
    assert r["pooled_test_accuracy"] > _round0_accuracy() + 0.1


def test_too_few_valid_partners_fails_clearly(consortium, tmp_path):
    with pytest.raises(CampaignError, match="min_partners=3"):
        run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "camp"), rounds=1, min_partners=3),
                     client_app="faults:make_broken_update_app",
                     client_app_kwargs={"bad_partitions": [0, 1], "mode": "truncated"}, app_dir=APP_DIR)
    status = json.loads((tmp_path / "camp" / "status.json").read_text())
    assert status["status"] == "failed" and "min_partners=3" in status["error"]


def test_kind_attached_cluster_protection_is_measured_and_recorded(consortium, tmp_path, caplog):
    # a Ray started without RAY_AUTH_MODE=token: the campaign runs on it, and says it is open
    import ray

    ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        gcs = ctx.address_info["gcs_address"]
        res = run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "camp"), rounds=1, ray_address=gcs))
        assert res.status["status"] == "finished"
        assert res.ray == {"gcs_address": gcs, "started_here": False, "mode": "attach", "auth": "none",
                           "loopback_only": None}
        assert res.status["ray"] == res.ray  # the campaign record says how its Ray was protected
        assert "WITHOUT authentication" in (tmp_path / "camp" / "worker.log").read_text()
        assert any("authentication 'none'" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    finally:
        ray.shutdown()


def test_bad_settings_fail_before_ray_starts(consortium, tmp_path):
    import time

    t0 = time.perf_counter()
    for kw, words in [({"min_partners": 9}, "min_partners=9"), ({"lr": float("nan")}, "learning rate"),
                      ({"timeout_s": float("nan")}, "reply timeout"), ({"timeout_s": 0}, "reply timeout"),
                      ({"timeout_s": "600"}, "reply timeout"), ({"rounds": 10**20}, "more than 100,000"),
                      ({"ray_address": "127.0.0.1:1"}, "cannot reach the Ray cluster")]:
        with pytest.raises((CampaignError, SimulationError), match=words):
            run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "c"), **{"rounds": 1, **kw}))
    assert time.perf_counter() - t0 < 30  # no Ray start-up, no minutes of GCS retries


def test_kind_a_damaged_aggregator_context_is_refused_before_ray_starts(consortium, tmp_path):
    import shutil
    import time

    for damage in ("truncate", "missing"):
        cons_dir = tmp_path / damage
        shutil.copytree(consortium.dir, cons_dir)
        pub = cons_dir / "aggregator" / "public.he"
        if damage == "truncate":
            pub.write_bytes(pub.read_bytes()[: pub.stat().st_size // 2])
        else:
            pub.unlink()
        t0 = time.perf_counter()
        with pytest.raises(CampaignError, match="public.he"):
            run_campaign(CampaignSpec(str(cons_dir), str(tmp_path / f"c-{damage}"), rounds=1))
        assert time.perf_counter() - t0 < 30 and not (tmp_path / f"c-{damage}").exists()


def test_campaign_refuses_to_overwrite_a_campaign(consortium, tmp_path):
    out = tmp_path / "camp"
    out.mkdir()
    (out / "status.json").write_text('{"status": "finished"}')
    with pytest.raises(CampaignError, match="--overwrite"):
        run_campaign(CampaignSpec(str(consortium.dir), str(out), rounds=1))


def test_campaign_dir_may_not_overlap_the_consortium(consortium):
    with pytest.raises(CampaignError, match="overlaps"):
        run_campaign(CampaignSpec(str(consortium.dir), str(consortium.dir / "camp"), rounds=1))
