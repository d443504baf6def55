"""Bad partner replies on real Ray with Flower's simulation engine (fault-injecting
ClientApps from tests/support/faults_partner.py): refused by name and reason, the campaign
finishes with the others; the release gate refuses impossible counts."""

import json

import numpy as np
import pytest

from sealfl.clients.heart.data import HOSPITALS, load_partitions
from sealfl.clients.heart.stats import local_sums, mean_std
from sealfl.clients.heart.task import HeartTask
from sealfl.platform.campaign import CampaignSpec, run_campaign
from sealfl.platform.consortium import create_consortium
from sealfl.platform.errors import ReleaseError
from sealfl.platform.fedeval import federated_evaluate
from tests.support.faults import APP_DIR

pytestmark = pytest.mark.slow

C, H, S, V = HOSPITALS
N_TRAIN = {p.name: p.n_train for p in load_partitions()}


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    cons, _ = create_consortium(tmp_path_factory.mktemp("consortium") / "c", "heart", list(HOSPITALS))
    return cons


def test_kind_bad_train_replies_on_ray_are_refused_and_the_campaign_finishes(consortium, tmp_path):
    # Hungary sends num-examples = NaN, Switzerland a rescaled (scale-2^30) ciphertext: two rounds with the other two
    res = run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "camp"), rounds=2, min_partners=2),
                       client_app="faults_partner:make_app",
                       client_app_kwargs={"faults": {1: "nan-examples", 2: "scale-2^30"}}, app_dir=APP_DIR)
    assert res.status["status"] == "finished"
    for r in res.rounds:
        assert r["accepted"] == [C, V]
        assert sorted(r["rejected"]) == [H, S]
        # the default packed BFV: SEAL refuses the rescaled ciphertext when it loads it
        assert "metrics.num-examples" in r["rejected"][H] and "not a ciphertext of this BFV context" in r["rejected"][S]
        assert r["total_weight"] == N_TRAIN[C] + N_TRAIN[V]
        assert 0.0 <= r["pooled_test_accuracy"] <= 1.0


def test_kind_impostor_and_padded_reply_on_ray(consortium, tmp_path):
    # VA Long Beach claims to be Cleveland (signed with its own key); Hungary pads its
    # ciphertext with an 8 MiB unknown field inside the chunk
    res = run_campaign(CampaignSpec(str(consortium.dir), str(tmp_path / "camp"), rounds=1, min_partners=2),
                       client_app="faults_partner:make_app",
                       client_app_kwargs={"faults": {3: "impostor", 1: "padded-chunk"}, "pad_bytes": 8 << 20},
                       app_dir=APP_DIR)
    (r,) = res.rounds
    assert r["stats_partners"] == [C, H, S]
    (who, why), = r["stats_rejected"].items()
    assert who.startswith(f"{C}?") and "does not verify with partner 'Cleveland'" in why
    assert r["accepted"] == [C, S] and "exceed the bound" in r["rejected"][H]
    assert r["total_weight"] == N_TRAIN[C] + N_TRAIN[S]


def test_kind_impossible_gate_counts_stop_the_release(consortium):
    parts = load_partitions()
    mean, std = mean_std(sum(local_sums(p.x_train) for p in parts))
    model = HeartTask().to_onnx(np.zeros(14), mean, std)
    with pytest.raises(ReleaseError) as err:
        federated_evaluate(consortium, {"fp32": model, "int8": model}, client_app="faults_partner:make_app",
                           client_app_kwargs={"faults": {2: "gate-correct-above-n"}}, app_dir=APP_DIR)
    msg = str(err.value)
    assert S in msg and "int8.correct: must be in 0..60, got 900" in msg and "not releasing" in msg
    # and the honest run pools to a number that is an accuracy
    ok = federated_evaluate(consortium, {"fp32": model, "int8": model})
    assert ok["fp32"]["pooled"] == ok["fp32"]["correct"] / ok["fp32"]["n"] <= 1.0
    assert json.dumps(ok)  # plain data
