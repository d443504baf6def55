"""Server optimizers at the key holders (sealfl.he.server_opt).

The independent source is Flower 1.42's own FedAvgM and FedAdam strategies: they run in
plaintext on the same partner models, and sealfl's chain (wire vectors weighted,
encrypted, summed by the aggregator, decrypted, opened and stepped at a key holder) must
land on the same global model every round, to within the grids of
:mod:`sealfl.he.decrypted`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sealfl.he.decrypted import DecryptBounds, open_model, share_to_sum, update_share, upload_clip
from sealfl.he.errors import DecryptedValueError, ServerOptError
from sealfl.he.server_opt import TAG_VALUES, ServerOpt
from tests.support.he import sum_frames

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


def _partner_models(seed=7, rounds=ROUNDS):
    """Round -> partner -> local model, float64 (P,): independent of the global model, so
    both chains see the same inputs (the optimizer's arithmetic is what is compared)."""
    rng = np.random.default_rng(seed)
    centre = rng.normal(0, 0.5, P)
    return [[np.clip(centre * (1 + 0.2 * r) + rng.normal(0, 0.3, P), -7, 7) for _ in NS] for r in range(rounds)]


def _flower(opt: ServerOpt, x0, models, subsets, rounds=ROUNDS):
    """Flower's strategy on plaintext replies: global model after each round."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAdam, FedAvgM

    if opt.name == "fedavgm":
        s = FedAvgM(server_learning_rate=opt.lr, server_momentum=opt.momentum)
        s.current_arrays = ArrayRecord({"w": Array(x0)})
    else:
        s = FedAdam(eta=opt.lr, beta_1=opt.beta_1, beta_2=opt.beta_2, tau=opt.tau)
    x, out = x0, []
    for r in range(rounds):
        if opt.name == "fedadam":
            s.current_arrays = {"w": x}  # what FedOpt.configure_train keeps: the arrays it sent
        replies = [Message(RecordDict({"arrays": ArrayRecord({"w": Array(models[r][i])}),
                                       "metrics": MetricRecord({"num-examples": NS[i]})}),
                           dst_node_id=i + 1, message_type="train") for i in subsets[r]]
        rec, _ = s.aggregate_train(r + 1, replies)
        x = rec["w"].numpy().astype(np.float64)
        out.append(x)
    return out


def _sealfl(opt: ServerOpt, x0, models, subsets, codec=None, rounds=ROUNDS):
    """sealfl's chain: each partner packs [w_i, state], weights and (with ``codec``)
    encrypts it; the aggregate is the sum over the round's partners; the key holder opens
    and steps. Global model after each round."""
    declared = sum(NS)
    weighting = codec.WEIGHTING if codec is not None else "count"
    x, state, out = x0, opt.initial_state(x0), []
    wire_len = opt.wire_length(P)
    clip = upload_clip(weighting)
    for r in range(rounds):
        shares = [update_share(opt.pack(models[r][i], state), NS[i], declared, weighting) for i in subsets[r]]
        if codec is None:
            total = np.sum(shares, axis=0)
        else:
            total = codec.decrypt(sum_frames(codec, [codec.encrypt(s) for s in shares], wire_len), wire_len)
        weight = sum(NS[i] for i in subsets[r])
        opened = open_model(share_to_sum(total, declared, weighting), weight, BOUNDS, max_total=declared)
        x, state = opt.step(opened, P, BOUNDS.param_grid_bits, clip=clip, abs_max=BOUNDS.param_abs_max)
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
    from sealfl.he.bfv import BFVCodec
    from sealfl.he.ckks import CKKSCodec

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
    assert [ServerOpt(n).wire_length(P) for n in ("fedavg", "fedavgm", "fedadam")] == [P, 3 * P + 8, 4 * P + 10]
    opt = ServerOpt()
    mean = np.rint(np.linspace(-1, 1, P) * 2**20) / 2**20  # an opened mean is on the grid
    x, state = opt.step(mean, P)
    np.testing.assert_array_equal(x, mean)
    assert state.size == 0 and opt.pack(mean, state).size == P
    a = ServerOpt("fedadam", beta_1=0.8, beta_2=0.95)
    s0 = a.initial_state(np.ones(3))
    np.testing.assert_array_equal(s0[:-TAG_VALUES], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0.8, 0.95])
    np.testing.assert_array_equal(s0[-TAG_VALUES:], _tag(a))


@pytest.mark.parametrize("config, what", [
    ({"server-opt": "fedyogi"}, "unknown server optimizer"),
    ({"server-opt": 3}, "must be a string"),
    ({"server-opt": "fedavgm", "server-momentum": 1.0}, "server-momentum"),
    ({"server-opt": "fedavgm", "server-momentum": -0.1}, "server-momentum"),
    ({"server-opt": "fedadam", "server-lr": float("nan")}, "finite"),
    ({"server-opt": "fedadam", "server-lr": 0.0}, "server-lr"),
    ({"server-opt": "fedadam", "server-lr": True}, "must be a number"),
    ({"server-opt": "fedadam", "server-tau": 0.0}, "server-tau"),
    ({"server-opt": "fedadam", "server-beta2": 1.0}, "server-beta2"),
    ({"server-opt": "fedadam", "server-beta1": "0.9"}, "must be a number"),
    ({"server-opt": "fedadam", "server-beta1": None}, "must be a number"),
    ({"server-opt": "fedadam", "server-lr": 10 ** 400}, "finite number"),
    ({"server-opt": "fedadam", "server-lr": 1e-320}, "server-lr must be in"),
    ({"server-opt": "fedadam", "server-tau": 1e-300}, "server-tau must be in"),
    ({"server-opt": "fedadam", "server-momentum": 0.9}, "server-momentum does not apply to fedadam"),
    ({"server-opt": "fedavg", "server-lr": 0.5}, "server-lr does not apply to fedavg"),
    ({"server-opt": "fedavgm", "server-tau": 0.1}, "server-tau does not apply to fedavgm"),
    (["server-opt", "fedadam"], "must be a mapping"),
    ("server-opt=fedadam", "must be a mapping"),
    (None, "must be a mapping"),
    ({"server-opt": np.array("fedadam")}, "must be a string"),
    ({"server-opt": "fedadam", "server-beta2": 0.99999}, "server-beta2 must be in"),
    ({"server-opt": "fedadam", "server-lr": 100.0000001}, "got 100.0000001"),
])
def test_bad_settings_are_refused(config, what):
    with pytest.raises(ServerOptError, match=what):
        ServerOpt.from_config(config)


def test_config_round_trip_and_defaults():
    assert ServerOpt.from_config({}) == ServerOpt()
    # any real number type and any capitalisation of the name (a hand-edited config)
    o = ServerOpt.from_config({"server-opt": " FedAdam", "server-lr": np.float32(0.25), "server-tau": np.int64(1)})
    assert (o.name, o.lr, o.tau) == ("fedadam", 0.25, 1.0) and type(o.lr) is float
    assert ServerOpt("fedadam").lr == 0.1 and ServerOpt("fedavgm").lr == 1.0  # Flower's defaults
    o = ServerOpt("fedadam", lr=0.3, beta_1=0.7, beta_2=0.95, tau=0.01)
    assert ServerOpt.from_config(o.to_config()) == o


def _tag(opt: ServerOpt) -> np.ndarray:
    """The settings tag, from the definition in sealfl.he.server_opt's docstring:
    64 bits of SHA-256 over the canonical JSON of the name and the settings used, as
    eight bytes / 256."""
    import hashlib
    import json

    used = {"fedavgm": ("lr", "momentum"), "fedadam": ("lr", "beta_1", "beta_2", "tau")}[opt.name]
    canon = json.dumps({"name": opt.name, **{k: getattr(opt, k) for k in used}}, sort_keys=True)
    return np.array(list(hashlib.sha256(b"sealfl-server-opt\0" + canon.encode()).digest()[:8])) / 256


def _adam_mean(b1=0.81, b2=0.9801, u=0.1, opt=None):
    opt = opt or ServerOpt("fedadam")
    mean = np.concatenate([np.full(P, 0.2), np.zeros(P), np.zeros(P), np.full(P, u), [b1, b2], _tag(opt)])
    return opt, mean


@pytest.mark.parametrize("b1, b2, u", [
    (1.0, 0.9801, 0.1),        # b1 = 1: the bias correction divides by zero
    (0.9999, 0.9801, 0.1),     # near 1: an enormous step
    (-0.5, 0.9801, 0.1),
    (0.95, 0.9801, 0.1),       # above β1 = 0.9: no power of it
    (0.81, 0.995, 0.1),        # above β2 = 0.99
    (0.81, 0.9801, -0.5),      # a negative root of the second moment
    (float("nan"), 0.9801, 0.1),
    (0.81, 0.9801, float("nan")),  # NaN in u itself
    (0.81, 0.9801, float("inf")),
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
    assert x.shape == (P,) and state.shape == (3 * P + 2 + TAG_VALUES,)
    assert np.all(np.isfinite(state)) and np.all(np.ldexp(state, 20) == np.rint(np.ldexp(state, 20)))
    b1, b2 = state[3 * P:3 * P + 2]
    assert math.isclose(b1, 0.81 * 0.9, abs_tol=2**-20) and math.isclose(b2, 0.9801 * 0.99, abs_tol=2**-20)
    np.testing.assert_array_equal(state[-TAG_VALUES:], _tag(opt))


@pytest.mark.parametrize("opt", [ServerOpt("fedadam", beta_1=0.5, beta_2=0.9),
                                 ServerOpt("fedadam", beta_1=0.0, beta_2=0.0, lr=0.02)], ids=["beta0.5", "beta0"])
def test_long_chains_whose_bias_powers_fall_below_the_grid_match_flower(opt, server_identity):
    """β1^(t+1) falls below the 2^-20 grid after ~20 rounds at β1 = 0.5, and is 0 from the
    start at β = 0: the decrypted power then reads 0, which is the bias correction's value
    to within the grid -- the chain goes on and stays on Flower's."""
    rounds = 30
    models = _partner_models(5, rounds)
    ref = _flower(opt, np.zeros(P), models, [list(range(len(NS)))] * rounds, rounds)
    got = _sealfl(opt, np.zeros(P), models, [list(range(len(NS)))] * rounds, rounds=rounds)
    for r in range(rounds):
        np.testing.assert_allclose(got[r], ref[r], atol=TOL, err_msg=f"round {r + 1}")


def test_a_bias_power_that_reads_zero_steps_with_no_correction():
    opt, mean = _adam_mean(b1=0.0, b2=0.0, u=0.0)
    x, state = opt.step(mean, P)
    # x = 0, Δ = 0.2, m = 0.1 * 0.2, u = sqrt(0.01 * 0.04) = 0.02: x = 0.1 * 0.02 / (0.02 + 1e-3)
    np.testing.assert_allclose(x, 0.1 * 0.02 / 0.021, atol=2**-20)
    assert list(state[3 * P:3 * P + 2]) == [0.0, 0.0]


@pytest.mark.parametrize("other", [ServerOpt("fedadam", lr=0.2), ServerOpt("fedadam", tau=0.01),
                                   ServerOpt("fedadam", beta_2=0.999)])
def test_a_state_made_with_other_settings_is_refused(other):
    """The settings tag: an aggregate whose state was made with other settings (settings
    changed between rounds, or server_config.json edited before the release) is refused."""
    _, mean = _adam_mean(opt=other)
    with pytest.raises(DecryptedValueError, match="not made with this campaign's settings"):
        ServerOpt("fedadam").step(mean, P)
    m = ServerOpt("fedavgm", momentum=0.9)
    mean = np.concatenate([np.zeros(3 * P), m.settings_tag()])
    m.step(mean, P)
    with pytest.raises(DecryptedValueError, match="not made with this campaign's settings"):
        ServerOpt("fedavgm", momentum=0.8).step(mean, P)
    # a tag off the k/256 grid (noise, not a rounding) is refused too
    mean[-1] += 2.0 ** -6
    with pytest.raises(DecryptedValueError):
        m.step(mean, P)


def test_packed_bfv_clips_the_published_model_and_state_to_the_layout_range(secret_codec):
    """Under packed BFV every upload is clipped to ±(8 - 2^-10); a large server learning
    rate must not publish a model beyond what the next aggregate can carry, and the state
    carried forward must be the published model (not a silently clipped copy)."""
    opt = ServerOpt("fedavgm", lr=20.0, momentum=0.9)
    clip = upload_clip(secret_codec.WEIGHTING)
    models = [[np.full(P, 0.5 + 0.1 * r) for _ in NS] for r in range(ROUNDS)]
    x, state = np.zeros(P), opt.initial_state(np.zeros(P))

    def one_round(r, x, state):
        shares = [update_share(opt.pack(models[r][i], state), NS[i], sum(NS), secret_codec.WEIGHTING)
                  for i in range(len(NS))]
        n = opt.wire_length(P)
        total = secret_codec.decrypt(sum_frames(secret_codec, [secret_codec.encrypt(s) for s in shares], n), n)
        opened = open_model(share_to_sum(total, sum(NS), secret_codec.WEIGHTING), sum(NS), BOUNDS, max_total=sum(NS))
        return opt.step(opened, P, BOUNDS.param_grid_bits, clip=clip, abs_max=BOUNDS.param_abs_max)

    if clip is None:  # CKKS does not clip: the model runs away and the step refuses it
        with pytest.raises(DecryptedValueError, match="diverged"):
            for r in range(ROUNDS):
                x, state = one_round(r, x, state)
        return
    for r in range(ROUNDS):
        x, state = one_round(r, x, state)
        np.testing.assert_array_equal(state[:P], x)
        assert np.max(np.abs(state[:-TAG_VALUES])) <= clip
    # the model ran into the range (lr 20 times the momentum sum is far beyond 8)
    assert np.max(np.abs(x)) == pytest.approx(clip, abs=2**-20)


def test_a_diverging_state_is_refused_at_the_step():
    opt = ServerOpt("fedavgm", lr=100.0, momentum=0.99)
    mean = np.concatenate([np.full(P, -9.0), np.full(P, 0.0), np.full(P, 5.0), opt.settings_tag()])
    with pytest.raises(DecryptedValueError, match="beyond"):
        opt.step(mean, P, abs_max=1000.0)


def test_a_poisoned_bias_power_near_one_is_refused_not_stepped():
    """With β near 1, a b a little above β would make 1 - b·β zero or negative (a math
    error, or a step in the wrong direction): the bound is β itself, to within the grid."""
    opt = ServerOpt("fedadam", beta_1=0.9999, beta_2=0.9999)
    x = np.full(P, 0.1)
    for i in (-2, -1):  # b1, then b2 (before the tag)
        state = opt.initial_state(x)
        state[3 * P + 2 + i] = 0.9999 + 2**-10
        with pytest.raises(DecryptedValueError, match="power of"):
            opt.step(opt.pack(x + 0.01, state), P)
    # honest: b = β moves the model toward x̄ (Δ > 0 -> a positive step)
    x_new, _ = opt.step(opt.pack(x + 0.01, opt.initial_state(x)), P)
    assert np.all(x_new > x)


@pytest.mark.parametrize("kw, what", [
    ({"n_params": "40"}, "n_params"), ({"n_params": 40.0}, "n_params"), ({"n_params": True}, "n_params"),
    ({"grid_bits": None}, "grid_bits"), ({"grid_bits": 2000}, "grid_bits"), ({"grid_bits": 0}, "grid_bits"),
    ({"clip": float("nan")}, "clip"), ({"clip": -1.0}, "clip"), ({"abs_max": float("nan")}, "abs_max"),
    ({"mean": ["a"] * (3 * P + 8)}, "real numbers"), ({"mean": np.ones(3 * P + 8) * 1j}, "real numbers"),
])
def test_step_refuses_arguments_no_key_holder_passes(kw, what):
    opt = ServerOpt("fedavgm", momentum=0.9)
    args = {"mean": np.concatenate([np.zeros(3 * P), opt.settings_tag()]), "n_params": P, "grid_bits": 20,
            "clip": None, "abs_max": None, **kw}
    with pytest.raises(DecryptedValueError, match=what):
        opt.step(args.pop("mean"), args.pop("n_params"), args.pop("grid_bits"), **args)


def test_fedavg_step_is_bounded_like_the_others():
    with pytest.raises(DecryptedValueError, match="beyond"):
        ServerOpt().step(np.full(P, 2000.0), P, abs_max=1000.0)


def test_negative_zero_is_zero_and_messages_show_exact_values():
    a, b = ServerOpt("fedavgm", momentum=-0.0), ServerOpt("fedavgm", momentum=0.0)
    assert a == b and np.array_equal(a.settings_tag(), b.settings_tag()) and "-0" not in a.describe()
    assert "server-lr=0.1000001" in ServerOpt("fedadam", lr=0.1000001).describe()
    with pytest.raises(ServerOptError) as info:
        ServerOpt.from_config({"server-opt": "fedadam", "server-lr": 10 ** 400})
    assert len(str(info.value)) < 300
