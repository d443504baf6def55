"""Server optimizers at the key holders (sealfl.common.server_opt).

The independent source is Flower 1.42's own FedAvgM and FedAdam strategies: they run in
plaintext on the same partner models, and sealfl's chain (wire vectors weighted,
encrypted, summed by the aggregator, decrypted, opened and stepped at a key holder) must
land on the same global model every round, to within the grids of
:mod:`sealfl.common.decrypted`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sealfl.common.decrypted import DecryptBounds, open_model, share_to_sum, update_share
from sealfl.common.errors import DecryptedValueError
from sealfl.common.server_opt import ServerOpt, ServerOptError

P = 40
ROUNDS = 5
NS = [120, 300, 80, 200]  # partner rows; W >= 80 keeps the sum grid's error below 2^-12 / 80 per value
BOUNDS = DecryptBounds()

#: how far sealfl may land from Flower: every opened value carries at most 2^-13/W (sum
#: grid) + 2^-21 (parameter grid) < 1e-6 of rounding; over five rounds FedAvgM's momentum
#: multiplies such an error by at most Σ_k 0.9^k < 10, FedAdam's m / (sqrt(v) + τ) by
#: about 1 / (sqrt(v) + τ) <= 100 at the |Δ| >= 0.01 the partner models below give --
#: 1e-4 leaves a margin over both, and is 1,000 times below the steps (~0.1) a wrong
#: formula (e.g. bias correction with exponent t instead of t + 1) would be off by.
TOL = 1e-4


def _partner_models(seed=7):
    """Round -> partner -> local model, float64 (P,): independent of the global model, so
    both chains see the same inputs (the optimizer's arithmetic is what is compared)."""
    rng = np.random.default_rng(seed)
    centre = rng.normal(0, 0.5, P)
    return [[np.clip(centre * (1 + 0.2 * r) + rng.normal(0, 0.3, P), -7, 7) for _ in NS] for r in range(ROUNDS)]


def _flower(opt: ServerOpt, x0, models, subsets):
    """Flower's strategy on plaintext replies: global model after each round."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAdam, FedAvgM

    if opt.name == "fedavgm":
        s = FedAvgM(server_learning_rate=opt.lr, server_momentum=opt.momentum)
        s.current_arrays = ArrayRecord({"w": Array(x0)})
    else:
        s = FedAdam(eta=opt.lr, beta_1=opt.beta_1, beta_2=opt.beta_2, tau=opt.tau)
    x, out = x0, []
    for r in range(ROUNDS):
        if opt.name == "fedadam":
            s.current_arrays = {"w": x}  # what FedOpt.configure_train keeps: the arrays it sent
        replies = [Message(RecordDict({"arrays": ArrayRecord({"w": Array(models[r][i])}),
                                       "metrics": MetricRecord({"num-examples": NS[i]})}),
                           dst_node_id=i + 1, message_type="train") for i in subsets[r]]
        rec, _ = s.aggregate_train(r + 1, replies)
        x = rec["w"].numpy().astype(np.float64)
        out.append(x)
    return out


def _sealfl(opt: ServerOpt, x0, models, subsets, codec=None):
    """sealfl's chain: each partner packs [w_i, state], weights and (with ``codec``)
    encrypts it; the aggregate is the sum over the round's partners; the key holder opens
    and steps. Global model after each round."""
    declared = sum(NS)
    weighting = codec.WEIGHTING if codec is not None else "count"
    x, state, out = x0, opt.initial_state(x0), []
    wire_len = opt.wire_length(P)
    for r in range(ROUNDS):
        shares = [update_share(opt.pack(models[r][i], state), NS[i], declared, weighting) for i in subsets[r]]
        if codec is None:
            total = np.sum(shares, axis=0)
        else:
            total = codec.decrypt(codec.sum_frames([codec.encrypt(s) for s in shares], wire_len), wire_len)
        weight = sum(NS[i] for i in subsets[r])
        opened = open_model(share_to_sum(total, declared, weighting), weight, BOUNDS, max_total=declared)
        x, state = opt.step(opened, P, BOUNDS.param_grid_bits)
        out.append(x)
    return out


OPTS = [ServerOpt("fedavgm", lr=1.0, momentum=0.9), ServerOpt("fedavgm", lr=0.5, momentum=0.0),
        ServerOpt("fedadam"), ServerOpt("fedadam", lr=0.05, beta_1=0.5, beta_2=0.9, tau=1e-2)]
ALL = [list(range(len(NS)))] * ROUNDS
#: partners 1 and 3 miss rounds: the state still comes back whole from whoever replied
SOME = [[0, 1, 2, 3], [0, 2], [1, 2, 3], [0, 3], [0, 1, 2, 3]]


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: f"{o.name}-lr{o.lr}")
@pytest.mark.parametrize("subsets", [ALL, SOME], ids=["all", "some-absent"])
def test_plaintext_chain_matches_flowers_strategy(opt, subsets, server_identity):
    models = _partner_models()
    x0 = np.zeros(P)
    ref = _flower(opt, x0, models, subsets)
    got = _sealfl(opt, x0, models, subsets)
    for r in range(ROUNDS):
        np.testing.assert_allclose(got[r], ref[r], atol=TOL, err_msg=f"round {r + 1}")
    # and the optimizer did something FedAvg would not have
    fedavg_last = np.average([models[-1][i] for i in subsets[-1]], axis=0, weights=[NS[i] for i in subsets[-1]])
    assert np.max(np.abs(got[-1] - fedavg_last)) > 100 * TOL


@pytest.fixture(scope="module", params=["bfv", "ckks"])
def secret_codec(request):
    from sealfl.common.bfv import BFVCodec
    from sealfl.common.ckks import CKKSCodec

    return {"bfv": BFVCodec, "ckks": CKKSCodec}[request.param].generate()


@pytest.mark.parametrize("opt", [OPTS[0], OPTS[2]], ids=["fedavgm", "fedadam"])
def test_encrypted_chain_matches_flowers_strategy(opt, secret_codec, server_identity):
    models = _partner_models(11)
    x0 = np.full(P, 0.25)
    ref = _flower(opt, x0, models, SOME)
    got = _sealfl(opt, x0, models, SOME, secret_codec)
    for r in range(ROUNDS):
        np.testing.assert_allclose(got[r], ref[r], atol=TOL, err_msg=f"round {r + 1}")


def test_wire_layout_and_fedavg_is_the_mean():
    assert [ServerOpt(n).wire_length(P) for n in ("fedavg", "fedavgm", "fedadam")] == [P, 3 * P, 4 * P + 2]
    opt = ServerOpt()
    mean = np.linspace(-1, 1, P)
    x, state = opt.step(mean, P)
    np.testing.assert_array_equal(x, mean)
    assert state.size == 0 and opt.pack(mean, state).size == P
    a = ServerOpt("fedadam", beta_1=0.8, beta_2=0.95)
    s0 = a.initial_state(np.ones(3))
    np.testing.assert_array_equal(s0, [1, 1, 1, 0, 0, 0, 0, 0, 0, 0.8, 0.95])


@pytest.mark.parametrize("config, what", [
    ({"server-opt": "fedyogi"}, "unknown server optimizer"),
    ({"server-opt": 3}, "must be a string"),
    ({"server-opt": "fedavgm", "server-momentum": 1.0}, "server-momentum"),
    ({"server-opt": "fedavgm", "server-momentum": -0.1}, "server-momentum"),
    ({"server-opt": "fedadam", "server-lr": float("nan")}, "finite"),
    ({"server-opt": "fedadam", "server-lr": 0.0}, "server-lr"),
    ({"server-opt": "fedadam", "server-lr": True}, "finite number"),
    ({"server-opt": "fedadam", "server-tau": 0.0}, "server-tau"),
    ({"server-opt": "fedadam", "server-beta2": 1.0}, "server-beta2"),
    ({"server-opt": "fedadam", "server-beta1": "0.9"}, "finite number"),
])
def test_bad_settings_are_refused(config, what):
    with pytest.raises(ServerOptError, match=what):
        ServerOpt.from_config(config)


def test_config_round_trip_and_defaults():
    assert ServerOpt.from_config({}) == ServerOpt()
    assert ServerOpt("fedadam").lr == 0.1 and ServerOpt("fedavgm").lr == 1.0  # Flower's defaults
    o = ServerOpt("fedadam", lr=0.3, beta_1=0.7, beta_2=0.95, tau=0.01)
    assert ServerOpt.from_config(o.to_config()) == o


def _adam_mean(b1=0.81, b2=0.9801, u=0.1):
    opt = ServerOpt("fedadam")
    mean = np.concatenate([np.full(P, 0.2), np.zeros(P), np.zeros(P), np.full(P, u), [b1, b2]])
    return opt, mean


@pytest.mark.parametrize("b1, b2, u", [
    (1.0, 0.9801, 0.1),        # b1 = 1: the bias correction divides by zero
    (0.9999, 0.9801, 0.1),     # near 1: an enormous step
    (0.0, 0.9801, 0.1),
    (-0.5, 0.9801, 0.1),
    (0.95, 0.9801, 0.1),       # above β1 = 0.9: no power of it
    (0.81, 0.995, 0.1),        # above β2 = 0.99
    (0.81, 0.9801, -0.5),      # a negative root of the second moment
    (float("nan"), 0.9801, 0.1),
])
def test_impossible_decrypted_state_is_refused(b1, b2, u):
    opt, mean = _adam_mean(b1, b2, u)
    with pytest.raises(DecryptedValueError):
        opt.step(mean, P)


def test_wrong_lengths_are_refused():
    opt, mean = _adam_mean()
    with pytest.raises(DecryptedValueError, match="values"):
        opt.step(mean[:-1], P)
    with pytest.raises(ServerOptError):
        opt.pack(np.zeros(P), np.zeros(3 * P))
    # a state that decodes fine steps to finite values on the grid
    x, state = opt.step(mean, P)
    assert x.shape == (P,) and state.shape == (3 * P + 2,)
    assert np.all(np.isfinite(state)) and np.all(np.ldexp(state, 20) == np.rint(np.ldexp(state, 20)))
    assert math.isclose(state[-2], 0.81 * 0.9, abs_tol=2**-20) and math.isclose(state[-1], 0.9801 * 0.99, abs_tol=2**-20)
