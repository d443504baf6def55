"""Distributed DP noise inside packed BFV (sealfl.he.dp) and its accountant (sealfl.he.dp_account):
tests that break if the privacy breaks (issue 23, item 3).

Expected values are written out from the definitions (Skellam variance, Truex et al.'s k - t
sizing, the analytic Gaussian's δ(ε) of Balle & Wang 2018 via SciPy), never from the code
under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import chi2, norm

from sealfl.he import dp
from sealfl.he.bfv import BFVCodec
from sealfl.he.dp_account import Ledger, calibrate_noise_multiplier, epsilon
from sealfl.he.errors import DecryptedValueError, PrivacyError, TooLittleNoiseError

D = 64  # coordinates per aggregate
#: aggregate noise std the accountant assumes, in PACKED integer units (z * Δ_int with
#: z = 1.1, lr = 0.5, C = 1, B = 40: Δ_int = 0.5 / 40 * 2^23 + sqrt(64))
TARGET_STD = 1.1 * (0.5 * 1.0 / 40 * 2**23 + 8.0)


@pytest.fixture(scope="module")
def codec() -> BFVCodec:
    return BFVCodec.generate()


def _aggregates(codec, partners: int, rounds: int, share_var: float, seed: int, skip: int = 0) -> np.ndarray:
    """``rounds`` decrypted BFV sums (float64 (rounds, D), in integer units) of ``partners``
    uploads of zeros + noise of ``share_var``; the first ``skip`` partners add no noise."""
    rng = dp.seeded_rng(seed)
    out = np.empty((rounds, D))
    for r in range(rounds):
        chunks = []
        for i in range(partners):
            q = dp.dp_upload(np.zeros(D), 0.0 if i < skip else share_var, rng)
            chunks.append(codec.split(codec.encrypt_integers(q))[1][0])
        total = codec.decrypt(codec.frame(D + 1, [codec.sum_chunk(0, chunks, D + 1)]), D + 1)
        values, count = dp.open_counted(total, partners)
        assert count == partners
        out[r] = values * 2.0**23
    return out


def _check_variance(samples: np.ndarray, target_var: float) -> None:
    """Per coordinate: the sample variance of ``rounds`` aggregates inside the two-sided
    chi-square interval (n - 1 dof) at 1e-3 / D each (Bonferroni: 1e-3 for the whole vector);
    pooled over all coordinates inside the interval at 1e-4 (detects a 5 % variance error)."""
    r = samples.shape[0]
    var = samples.var(axis=0, ddof=1)
    a = 1e-3 / samples.shape[1]
    lo, hi = chi2.ppf(a / 2, r - 1) / (r - 1), chi2.ppf(1 - a / 2, r - 1) / (r - 1)
    ratio = var / target_var
    assert np.all((ratio > lo) & (ratio < hi)), (ratio.min(), ratio.max(), lo, hi)
    n = samples.size
    pooled = float(np.mean((samples - samples.mean(axis=0)) ** 2)) * r / (r - 1) / target_var
    plo, phi = chi2.ppf(5e-5, n - D) / (n - D), chi2.ppf(1 - 5e-5, n - D) / (n - D)
    assert plo < pooled < phi, (pooled, plo, phi)


@pytest.mark.parametrize("k,rounds", [(4, 300), (16, 300)])
def test_aggregate_noise_is_what_the_accountant_assumes(codec, k, rounds):
    cfg = dp.DPConfig(noise_multiplier=1.1, clip=1.0, min_partners=k, trust=0, sampling_rate=0.1)
    share = dp.partner_noise_variance(cfg, lr=0.5, expected_batch=40, dim=D)
    assert share == pytest.approx(TARGET_STD**2 / k, rel=1e-12)
    samples = _aggregates(codec, k, rounds, share, seed=k)
    assert abs(float(samples.mean())) < 5 * TARGET_STD / math.sqrt(samples.size)  # unbiased
    _check_variance(samples, TARGET_STD**2)


def test_t_partners_may_skip_their_share_and_the_target_still_holds(codec):
    k, t = 4, 1
    cfg = dp.DPConfig(noise_multiplier=1.1, clip=1.0, min_partners=k, trust=t)
    share = dp.partner_noise_variance(cfg, lr=0.5, expected_batch=40, dim=D)
    assert share == pytest.approx(TARGET_STD**2 / (k - t), rel=1e-12)
    # t partners skip (or collude and subtract their own noise): the k - t honest ones reach the target
    _check_variance(_aggregates(codec, k, 300, share, seed=7, skip=t), TARGET_STD**2)
    # shares sized for k (ignoring t) fall short when one partner skips: the pooled test sees it
    short = _aggregates(codec, k, 300, TARGET_STD**2 / k, seed=8, skip=1)
    with pytest.raises(AssertionError):
        _check_variance(short, TARGET_STD**2)


def test_fewer_than_k_partners_is_refused_at_the_key_holder(codec):
    rng = dp.seeded_rng(3)
    chunks = [codec.split(codec.encrypt_integers(dp.dp_upload(np.full(D, 0.25), 1e6, rng)))[1][0] for _ in range(3)]
    total = codec.decrypt(codec.frame(D + 1, [codec.sum_chunk(0, chunks, D + 1)]), D + 1)
    with pytest.raises(TooLittleNoiseError, match="only 3 partners counted.*fewer than k=4.*too little noise"):
        dp.open_counted(total, 4)
    values, count = dp.open_counted(total, 3)
    assert count == 3 and abs(float(values.mean()) - 0.75) < 1e-3
    forged = total.copy()
    forged[-1] += 2.0**-23  # not a whole number of partners
    with pytest.raises(DecryptedValueError, match="not a whole positive number"):
        dp.open_counted(forged, 1)


def test_skellam_sum_of_shares_matches_one_skellam():
    rng = dp.seeded_rng(11)
    var = 2.0e6
    one = dp.skellam(200_000, var, rng)
    summed = sum(dp.skellam(200_000, var / 8, rng) for _ in range(8))
    for x in (one, summed):
        assert x.dtype == np.int64
        assert abs(x.var() / var - 1) < 0.02  # ~6 standard errors of the variance estimate
        assert abs(float(x.mean())) < 5 * math.sqrt(var / x.size)


def test_noisy_upload_beyond_the_packed_range_is_refused():
    with pytest.raises(PrivacyError, match="too large for this update scale"):
        dp.dp_upload(np.zeros(8), (4.0 * 2**23) ** 2, dp.seeded_rng(0))
    with pytest.raises(PrivacyError, match="within ±"):
        dp.dp_upload(np.full(3, 9.0), 1.0, dp.seeded_rng(0))


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=0.0), "noise multiplier must be in"),
    (dict(noise_multiplier=float("nan")), "finite"),
    (dict(clip=-1.0), "clip norm"),
    (dict(min_partners=0), "min partners"),
    (dict(trust=4), r"trust t .* \[0, 3\]"),
    (dict(trust=-1), "trust t"),
    (dict(sampling_rate=1.5), "sampling rate"),
])
def test_nonsense_settings_are_refused(kwargs, match):
    base = dict(noise_multiplier=1.0, clip=1.0, min_partners=4, trust=1, sampling_rate=0.1)
    with pytest.raises(PrivacyError, match=match):
        dp.DPConfig(**{**base, **kwargs})


def test_skellam_excess_over_the_gaussian_is_negligible_at_sealfl_scale():
    sens = 0.5 / 40 * 2**23 + 8.0
    assert dp.skellam_rdp_excess(64.0, sens, (0.5 * sens) ** 2, 10_000) < 1e-6
    # an update scale of a few integer units: Skellam is far from the Gaussian, refused
    cfg = dp.DPConfig(noise_multiplier=1.0, clip=1.0, min_partners=4)
    with pytest.raises(PrivacyError, match="raise the learning rate or the clip norm"):
        dp.partner_noise_variance(cfg, lr=1e-6, expected_batch=1000, dim=14)


def _eps_gaussian(mu: float, delta: float) -> float:
    """ε of a μ-GDP mechanism at δ: solve δ = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) (Balle & Wang 2018)."""
    return brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0, 200,
                  xtol=1e-12)


@pytest.mark.parametrize("sigma,rounds", [(1.0, 1), (2.0, 10), (5.0, 50)])
def test_accountant_matches_the_gaussian_closed_form(sigma, rounds):
    # T Gaussian mechanisms of noise multiplier σ compose to one with μ = sqrt(T) / σ
    assert epsilon(sigma, [1.0] * rounds, 1e-5) == pytest.approx(_eps_gaussian(math.sqrt(rounds) / sigma, 1e-5),
                                                                 abs=1e-3)


def test_subsampling_and_calibration():
    full = epsilon(1.0, [1.0] * 5, 1e-5)
    sub = epsilon(1.0, [0.05] * 5, 1e-5)
    assert sub < full / 5  # privacy amplification by sampling
    z = calibrate_noise_multiplier(3.0, 1e-5, 0.05, 40)
    assert epsilon(z, [0.05] * 40, 1e-5) <= 3.0 + 1e-3
    assert epsilon(z * 0.99, [0.05] * 40, 1e-5) > 3.0


def test_ledger_stops_before_the_round_that_would_exceed_the_budget():
    led = Ledger(noise_multiplier=2.0, delta=1e-5, budget=2.0)
    rounds = 0
    while led.allows(0.2):
        led.record(0.2)
        rounds += 1
    assert rounds >= 1 and led.spent() <= 2.0
    assert epsilon(2.0, [0.2] * (rounds + 1), 1e-5) > 2.0
    block = led.privacy_block(clip=1.0, min_partners=4, trust=1)
    assert block["rounds"] == rounds and block["epsilon"] <= 2.0 and block["delta"] == 1e-5
    with pytest.raises(PrivacyError, match="delta"):
        Ledger(noise_multiplier=1.0, delta=0.0)
    with pytest.raises(PrivacyError, match="epsilon"):
        Ledger(noise_multiplier=1.0, delta=1e-5, budget=-1.0)
