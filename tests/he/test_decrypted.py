"""Key holders bound-check and round what they decrypt before anything leaves them:
the release enclave (model parameters, the mean/std in the ONNX file) and partners
(the model they train from, the loss and accuracy they report)."""

import json
import math

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import numpy_helper

from sealfl.clients.heart.data import HOSPITALS, load_partitions
from sealfl.clients.heart.stats import local_sums, mean_std
from sealfl.clients.heart.task import HeartTask, TrainConfig
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.enclave.release.keyholder import KeyHolder
from sealfl.he.decrypted import DecryptBounds, check_weight, open_model, open_stats, round_to_grid, share_to_sum
from sealfl.he.errors import DecryptedValueError
from sealfl.he.framed import WIDE
from sealfl.platform.campaign_outcome import finished_checkpoint
from sealfl.platform.consortium import create_consortium
from sealfl.platform.errors import ReleaseError
from sealfl.platform.release import enclave_dir, open_final_model, provision_release_enclave, release
from sealfl.server.bookkeeping import CampaignDir, save_checkpoint

B = HeartTask.decrypt_bounds
PARTS = load_partitions()
N = sum(p.n_train for p in PARTS)
SUMS = sum(local_sums(p.x_train) for p in PARTS)


@given(st.floats(min_value=-1e9, max_value=1e9), st.integers(min_value=0, max_value=30))
def test_rounded_values_carry_no_bits_below_the_grid(x, bits):
    r = float(round_to_grid(np.array([x]), bits)[0])
    scaled = r * 2.0**bits
    assert scaled == math.floor(scaled)  # a whole multiple of 2**-bits
    assert abs(r - x) <= 2.0 ** -(bits + 1)


def test_round_to_grid_refuses_non_finite_values():
    with pytest.raises(DecryptedValueError, match="not finite"):
        round_to_grid([1.0, math.nan], 12)


@pytest.mark.parametrize("weight", [math.nan, math.inf, 0, -3, 1.5, True, "490", 10**9])
def test_kind_aggregate_weight_must_be_a_whole_count(weight):
    with pytest.raises(DecryptedValueError, match="weight"):
        check_weight(weight, N)


def test_kind_out_of_bound_model_is_refused():
    with pytest.raises(DecryptedValueError, match=r"parameter 0 is 1e\+09, outside the task's bound"):
        open_model(np.full(14, 1e9), 1, B)


def test_kind_statistics_must_match_the_declared_count_and_bounds():
    with pytest.raises(DecryptedValueError, match="declared"):
        open_stats(SUMS, N + 100, B)
    bad = SUMS.copy()
    bad[1] = 1e9 * N  # mean of feature 0 = 1e9
    with pytest.raises(DecryptedValueError, match="mean of feature 0"):
        open_stats(bad, N, B)
    bad = SUMS.copy()
    bad[14] = -1.0  # Σx² of feature 0 below (Σx)²/n: negative variance
    with pytest.raises(DecryptedValueError, match="variance of feature 0"):
        open_stats(bad, N, B)
    mean, std = open_stats(SUMS, N, B)
    m2, s2 = mean_std(SUMS)  # the unrounded formula as the independent reference
    np.testing.assert_allclose(mean, m2, atol=2.0**-20)
    np.testing.assert_allclose(std, s2, atol=2.0**-19)


def test_kind_decryption_noise_never_leaves_a_key_holder():
    """BFV decryption is exact (no noise at all reaches the key holder), and what is
    published is on the task's grids."""
    from sealfl.he.bfv import BFVCodec

    codec = BFVCodec.generate()
    w = round_to_grid(np.random.default_rng(5).normal(0, 3, 14), 20)
    a, b = codec.encrypt(w), codec.encrypt(w)  # two encryptions: different randomness
    assert a != b
    raw_a, raw_b = codec.decrypt(a, 14), codec.decrypt(b, 14)
    assert np.array_equal(raw_a, raw_b)  # exact: the same values, no noise
    pa, pb = open_model(share_to_sum(raw_a, N, codec.WEIGHTING), N, B), open_model(share_to_sum(raw_b, N, codec.WEIGHTING), N, B)
    assert np.array_equal(pa, pb)
    assert np.all(pa * 2.0**20 == np.floor(pa * 2.0**20))
    np.testing.assert_allclose(pa, w, atol=2.0**-24 + 2.0**-13 / N + 2.0**-21)
    sa, sb = codec.encrypt(SUMS, WIDE), codec.encrypt(SUMS, WIDE)
    ma, da = open_stats(codec.decrypt(sa, 27, WIDE), N, B)
    mb, db = open_stats(codec.decrypt(sb, 27, WIDE), N, B)
    assert np.array_equal(ma, mb) and np.array_equal(da, db)
    assert np.all(ma * 2.0**20 == np.floor(ma * 2.0**20)) and np.all(da * 2.0**20 == np.floor(da * 2.0**20))


# ---- the release enclave --------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("keyholder")
    cons, codec = create_consortium(root / "c", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    x = np.concatenate([p.x_train for p in PARTS])
    y = np.concatenate([p.y_train for p in PARTS])
    params, _ = HeartTask().train(np.zeros(14), x, y, x.mean(0), x.std(0), TrainConfig(local_epochs=3), 0)
    return {"root": root, "cons": cons, "codec": codec, "params": params}


def _campaign(built, d, model, weight, declared=N, stats=SUMS):
    codec = built["codec"]
    # the checkpoint holds what partners' updates sum to: E(Σ n_i w_i) under CKKS ("count"
    # weighting), E(Σ (n_i / N) w_i) under BFV ("share"); ``model`` is given as Σ n_i w_i
    save_checkpoint(d, 3, codec.encrypt(model / declared if codec.WEIGHTING == "share" else model), float(weight), codec.encrypt(stats, WIDE))
    CampaignDir(d, 3).set_status(status="finished", round=3, stats_declared_n=declared)
    return d


def test_kind_released_parameters_and_statistics_are_rounded(built, tmp_path):
    camp = _campaign(built, tmp_path / "camp", built["params"] * N, N)
    keys = KeyHolder(ReleaseEnclave.open(enclave_dir(built["cons"])), built["cons"].he_params,
                     bytes.fromhex(built["cons"].context_id))
    params, mean, std = open_final_model(keys, finished_checkpoint(camp), HeartTask(), camp)
    np.testing.assert_allclose(params, built["params"], atol=1e-6)
    for v in (params, mean, std):
        assert np.all(v * 2.0**20 == np.floor(v * 2.0**20))
    onnx_model = onnx.load_from_string(HeartTask().to_onnx(params, mean, std))
    init = {i.name: numpy_helper.to_array(i).astype(np.float64).ravel() for i in onnx_model.graph.initializer}
    # what goes into the file is exactly the rounded statistics (float32 keeps them: |v| < 2**3 or coarser grid)
    assert np.array_equal(init["mean"], mean.astype(np.float32).astype(np.float64))
    assert np.all(init["mean"] * 2.0**20 == np.floor(init["mean"] * 2.0**20))
    assert np.all(init["std"] * 2.0**20 == np.floor(init["std"] * 2.0**20))


@pytest.mark.parametrize("model, weight, declared, words", [
    (np.full(14, 1e9), 1, N, r"parameter 0 is \d"),          # a key holder's encryption of [1e9]*14 (clipped to 8 N)
    (np.zeros(14), N + 1, N, "weight"),                        # more weight than rows declared
    (np.zeros(14), N, N + 100, "encrypted another count"),     # statistics count differs from the declared total
])
def test_kind_out_of_bound_aggregate_is_not_released(built, tmp_path, model, weight, declared, words):
    camp = _campaign(built, tmp_path / "camp", model, weight, declared)
    releases = built["cons"].dir / "releases.json"
    before = releases.read_bytes() if releases.exists() else None
    with pytest.raises(ReleaseError, match=words) as err:
        release(built["cons"].dir, camp, tmp_path / "rel", version=7)
    assert "not releasing" in str(err.value)
    assert not (tmp_path / "rel").exists()
    assert (releases.read_bytes() if releases.exists() else None) == before


def test_release_refuses_a_campaign_without_a_declared_total(built, tmp_path):
    camp = _campaign(built, tmp_path / "camp", np.zeros(14), N)
    status = json.loads((camp / "status.json").read_text())
    del status["stats_declared_n"]
    (camp / "status.json").write_text(json.dumps(status))
    with pytest.raises(ReleaseError, match="stats_declared_n"):
        release(built["cons"].dir, camp, tmp_path / "rel", version=7)


# ---- partners ------------------------------------------------------------------------------

def _global(codec, model, weight, stats_n=N):
    from flwr.app import Array, ArrayRecord

    from sealfl.common import protocol as P

    return ArrayRecord({P.MODEL_CT: Array(P.to_u8(codec.encrypt(model / stats_n))),
                        P.MODEL_WEIGHT: Array(np.array([float(weight)])),
                        P.STATS_CT: Array(P.to_u8(codec.encrypt(SUMS, WIDE))),
                        P.STATS_N: Array(np.array([stats_n], dtype=np.int64))})


def test_kind_partner_refuses_an_out_of_bound_global_model(built):
    from sealfl.clients.global_record import decode_global
    from sealfl.clients.kit import kit_dir, load_kit

    kit = load_kit(str(kit_dir(built["cons"].dir, HOSPITALS[0])))
    with pytest.raises(DecryptedValueError, match="outside the task's bound"):
        decode_global(_global(built["codec"], np.full(14, 1e9), 1), kit)
    with pytest.raises(DecryptedValueError, match="encrypted another count"):
        decode_global(_global(built["codec"], np.zeros(14), N, stats_n=N - 1), kit)
    params, mean, std = decode_global(_global(built["codec"], built["params"] * N, N), kit)
    assert np.all(params * 2.0**20 == np.floor(params * 2.0**20))


def test_kind_partner_reports_rounded_metrics(built, monkeypatch):
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from sealfl.clients import app as capp
    from sealfl.common import protocol as P

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1, raising=False)
    msg = Message(RecordDict({P.GLOBAL: _global(built["codec"], built["params"] * N, N),
                              P.CONFIG: ConfigRecord({"server-round": 1})}), dst_node_id=5, message_type="evaluate")
    ctx = Context(run_id=1, node_id=5, node_config={"partition-id": 1}, state=RecordDict(), run_config={})
    m = capp.handle_evaluate(msg, ctx, str(built["cons"].dir)).content[P.METRICS]
    assert m[P.ACCURACY] == m[P.CORRECT] / m[P.NUM_EXAMPLES]
    assert m[P.LOSS] * 2.0**20 == math.floor(m[P.LOSS] * 2.0**20) and 0 < m[P.LOSS] < 16.2
    assert DecryptBounds().metric_grid_bits == 20
