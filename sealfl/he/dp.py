"""Distributed differential-privacy noise inside packed BFV's fixed-point integers, and the
partner count that travels with it (issue 23).

Mechanism: the **Skellam mechanism** (Agarwal, Kairouz, Liu, "The Skellam Mechanism for
Differentially Private Federated Learning", NeurIPS 2021). ``Sk(μ) = Poisson(μ) - Poisson(μ)``
has mean 0 and variance ``2μ``, and it is *closed under summation*: the sum of independent
``Sk(μ_1) … Sk(μ_k)`` is exactly ``Sk(μ_1 + … + μ_k)``. So k partners that each add integer
noise of variance ``s²/k`` produce an aggregate whose noise is exactly Skellam of variance
``s²`` -- no approximation in the sum, which BFV adds exactly. Why Skellam rather than the
distributed discrete Gaussian (Kairouz, Liu, Steinke, ICML 2021): a sum of discrete Gaussians
is not a discrete Gaussian (their analysis bounds the gap), while the Skellam sum is exact;
Skellam sampling is two Poisson draws. Its Rényi DP (Agarwal et al., Theorem 3.5) is the
Gaussian's ``α Δ₂² / (2 s²)`` plus a term of order ``α Δ₂² / s⁴`` (:func:`skellam_rdp_excess`);
at sealfl's scale (``Δ₂`` of ~2^17 integer units or more) that term is below 1e-9 per round,
so :mod:`sealfl.he.dp_account` accounts the sampled Gaussian of the same variance and
:func:`partner_noise_variance` refuses settings where the bound exceeds
:data:`MAX_RDP_EXCESS` instead of folding it in.

Trust (Truex et al., "A Hybrid Approach to Privacy-Preserving Federated Learning", AISec
2019): with ``k`` partners counting and up to ``t`` of them that may skip their share or
collude (they know their own noise and can subtract it), each partner adds
``s² / (k - t)`` so that any ``k - t`` honest partners alone reach the target ``s²``
(:func:`share_variance`). What cannot be checked under encryption: that a partner really
added its share (or clipped its gradients) -- that is exactly what ``t`` is for.

Units (the ``PACKED`` layout of :mod:`sealfl.he.bfv`, step ``γ = 2^-23``): a partner's
upload ``u`` (real) is rounded to integers ``rint(u / γ)`` and the noise is added to those
integers before packing, so the aggregate's noise is in the same integer units BFV sums
exactly. One record changes ``u`` by at most ``Δ`` in L2 (real units) and the rounded vector by
at most ``Δ/γ + sqrt(d)`` (each coordinate's rounding error moves by < 1):
:func:`integer_sensitivity`. The noise variance is ``(z · Δ_int)²`` for noise multiplier
``z``.

Count slot: a DP upload carries one extra value after the model, ``COUNT_UNIT`` integer
units (``2^-6`` real) from every partner and no noise; the key holders read the decrypted
count (:func:`open_counted`) and refuse an aggregate of fewer than ``k`` partners
(:class:`~sealfl.he.errors.TooLittleNoiseError`). The aggregator cannot lower the count
without the key (it could only add a partner's ciphertext twice, which raises the count and
the noise with it, or drop one, which lowers the count and is refused).

Randomness: noise shares are drawn from NumPy's Poisson sampler driven by randomgen's
**ChaCha20** bit generator (20 rounds, a cryptographic stream cipher) keyed with 256 bits from
:mod:`secrets` (:func:`secure_rng`): NumPy's default PCG64 is not a CSPRNG. The Poisson
sampler itself (transformed rejection, float64) is not an exact sampler; floating-point
effects of that kind (Mironov, CCS 2012) are not analysed here. :func:`seeded_rng` is for
tests and benchmarks only (its noise is reproducible, hence no secret).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from sealfl.he.errors import PrivacyError, TooLittleNoiseError
from sealfl.he.framed import PACKED

__all__ = ["DPConfig", "COUNT_UNIT", "MAX_COUNT", "share_variance", "integer_sensitivity", "secure_rng",
           "seeded_rng", "skellam", "dp_upload", "open_counted", "skellam_rdp_excess", "step_sensitivity",
           "step_upload", "partner_noise_variance"]

#: integer units one partner adds in the count slot (2^17 = 2^-6 real under PACKED)
COUNT_UNIT = 1 << 17
#: most partners the count slot holds: the 27-bit packed field keeps |sum| < 2^26
MAX_COUNT = (1 << (PACKED.bits - 1)) // COUNT_UNIT - 1
#: largest |integer| of one packed field (sum or single upload)
_FIELD_MAX = (1 << (PACKED.bits - 1)) - 1


@dataclass(frozen=True)
class DPConfig:
    """A campaign's record-level DP settings (off unless a campaign asks for them).

    Attributes:
        noise_multiplier: z = aggregate noise std / the L2 sensitivity of one record (> 0).
        clip: per-example gradient L2 clip norm C (> 0).
        min_partners: k, fewest partners that must count in a published aggregate (>= 1).
        trust: t, partners that may skip their noise share or collude, 0 <= t < k.
        sampling_rate: q, each record's Poisson inclusion probability per round (0 < q <= 1).
    Raises PrivacyError (from :meth:`check`) naming the first setting out of range.
    """

    noise_multiplier: float
    clip: float
    min_partners: int
    trust: int = 0
    sampling_rate: float = 1.0

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise PrivacyError for nonsense values (names the setting and its range)."""
        z, c, k, t, q = self.noise_multiplier, self.clip, self.min_partners, self.trust, self.sampling_rate
        for name, v in (("noise multiplier", z), ("clip norm", c), ("sampling rate", q)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise PrivacyError(f"DP {name} must be a finite number, got {v!r}")
        if not 0 < z <= 1e4:
            raise PrivacyError(f"DP noise multiplier must be in (0, 1e4], got {z!r}")
        if not 0 < c <= 1e6:
            raise PrivacyError(f"DP clip norm must be in (0, 1e6], got {c!r}")
        if not 0 < q <= 1:
            raise PrivacyError(f"DP sampling rate must be in (0, 1], got {q!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_COUNT:
            raise PrivacyError(f"DP needs min partners k in [1, {MAX_COUNT}], got {k!r}")
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < k:
            raise PrivacyError(f"DP trust t (partners that may skip their noise or collude) must be in [0, k-1] = "
                               f"[0, {k - 1}], got {t!r}: with t >= k no partner's noise can be relied on")

    def to_config(self) -> dict:
        """Flat round-config entries (``dp-*`` keys; Flower ConfigRecord values)."""
        return {"dp-noise-multiplier": float(self.noise_multiplier), "dp-clip": float(self.clip),
                "dp-min-partners": int(self.min_partners), "dp-trust": int(self.trust),
                "dp-sampling-rate": float(self.sampling_rate)}

    @classmethod
    def from_config(cls, cfg) -> "DPConfig | None":
        """The DP settings of a round config, or None when DP is off (no ``dp-noise-multiplier``).
        Raises PrivacyError for a present but malformed setting."""
        if "dp-noise-multiplier" not in cfg:
            return None
        try:
            return cls(float(cfg["dp-noise-multiplier"]), float(cfg["dp-clip"]), int(cfg["dp-min-partners"]),
                       int(cfg.get("dp-trust", 0)), float(cfg.get("dp-sampling-rate", 1.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise PrivacyError(f"the round's DP settings are incomplete or malformed: {exc!r}") from exc


def share_variance(total_variance: float, k: int, t: int) -> float:
    """One partner's noise variance: ``total_variance / (k - t)`` -- any ``k - t`` honest
    partners together reach ``total_variance`` (Truex et al.). Raises PrivacyError unless
    ``0 <= t < k`` and the variance is finite and >= 0."""
    if not (isinstance(k, int) and isinstance(t, int) and 0 <= t < k):
        raise PrivacyError(f"need 0 <= t < k, got k={k!r}, t={t!r}")
    if not (math.isfinite(total_variance) and total_variance >= 0):
        raise PrivacyError(f"noise variance must be finite and >= 0, got {total_variance!r}")
    return float(total_variance) / (k - t)


def integer_sensitivity(delta_real: float, dim: int, frac_bits: int = PACKED.frac_bits) -> float:
    """L2 sensitivity (integer units) of a rounded upload whose real L2 sensitivity is
    ``delta_real``: ``delta_real * 2**frac_bits + sqrt(dim)`` (rounding moves each of the
    ``dim`` coordinates by less than 1 either way)."""
    return float(delta_real) * 2.0**frac_bits + math.sqrt(dim)


def secure_rng() -> np.random.Generator:
    """A NumPy Generator over ChaCha20 (randomgen, 20 rounds) keyed with 256 bits from
    :mod:`secrets`: the partners' noise source."""
    from randomgen import ChaCha

    return np.random.Generator(ChaCha(seed=secrets.randbits(256), rounds=20))


def seeded_rng(seed: int) -> np.random.Generator:
    """A reproducible ChaCha20 Generator: tests and benchmarks only (no secret noise)."""
    from randomgen import ChaCha

    return np.random.Generator(ChaCha(seed=int(seed), rounds=20))


def skellam(size: int, variance: float, rng: np.random.Generator) -> np.ndarray:
    """``size`` independent Skellam samples of variance ``variance`` (int64):
    ``Poisson(variance/2) - Poisson(variance/2)``. Raises PrivacyError for a negative or
    non-finite variance, or one too large for int64 Poisson draws (> 2^60)."""
    if not (math.isfinite(variance) and 0 <= variance <= 2.0**60):
        raise PrivacyError(f"Skellam variance must be in [0, 2^60], got {variance!r}")
    mu = variance / 2.0
    if mu == 0:
        return np.zeros(int(size), dtype=np.int64)
    return rng.poisson(mu, int(size)).astype(np.int64) - rng.poisson(mu, int(size)).astype(np.int64)


def dp_upload(values: np.ndarray, noise_variance: float, rng: np.random.Generator) -> np.ndarray:
    """What a DP partner packs and encrypts (int64 (P + 1,), PACKED integer units): ``rint(values
    / 2^-23)`` plus its Skellam share of variance ``noise_variance`` (integer units², e.g.
    :func:`share_variance`), then ``COUNT_UNIT`` in the count slot (no noise).

    ``values`` (float64 (P,)) must already lie within ±``PACKED.clip`` (the caller clips and
    weights); nothing is clipped here, since clipping the noise would change its distribution.

    Raises PrivacyError if a noisy value leaves the packed field (its noise is far larger than
    the layout's ±8: choose a smaller noise or learning rate) or ``values`` is out of range.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or not np.all(np.isfinite(v)) or (v.size and float(np.max(np.abs(v))) > PACKED.clip):
        raise PrivacyError(f"a DP upload must be a finite 1-D vector within ±{PACKED.clip:g}")
    q = np.rint(np.ldexp(v, PACKED.frac_bits)).astype(np.int64) + skellam(v.size, noise_variance, rng)
    if q.size and int(np.max(np.abs(q))) > _FIELD_MAX // 2:
        raise PrivacyError(f"a noisy upload value reached {float(np.max(np.abs(q))) * 2.0**-PACKED.frac_bits:.3g}, "
                           f"beyond half the packed layout's ±8: the noise (std "
                           f"{math.sqrt(noise_variance) * 2.0**-PACKED.frac_bits:.3g} per partner) is too large for "
                           "this update scale -- lower the learning rate or the noise multiplier")
    return np.concatenate([q, np.asarray([COUNT_UNIT], dtype=np.int64)])


def open_counted(decrypted: np.ndarray, min_partners: int) -> tuple[np.ndarray, int]:
    """Key-holder side: split a decrypted DP aggregate (float64 (P + 1,), real PACKED values)
    into (values (P,), count) and refuse it when fewer than ``min_partners`` partners counted.

    Raises:
        TooLittleNoiseError: the count is below ``min_partners`` (too little noise: not published).
        DecryptedValueError: the count slot is not a whole, positive number of partners
            (a corrupt or forged aggregate).
    """
    from sealfl.he.errors import DecryptedValueError

    d = np.asarray(decrypted, dtype=np.float64)
    if d.ndim != 1 or d.size < 2 or not math.isfinite(float(d[-1])):
        raise DecryptedValueError("a DP aggregate needs its values and a count slot")
    units = float(d[-1]) * 2.0**PACKED.frac_bits / COUNT_UNIT
    count = int(round(units))
    if units != count or count < 1:
        raise DecryptedValueError(f"the DP aggregate's count slot holds {units!r} partners, not a whole positive "
                                  "number: the aggregate is corrupt or forged -- not using it")
    if count < int(min_partners):
        raise TooLittleNoiseError(f"only {count} partners counted in this aggregate, fewer than k={min_partners}: it "
                                  "carries too little noise for the privacy guarantee -- not publishing it")
    return d[:-1], count


def skellam_rdp_excess(alpha: float, sensitivity: float, variance: float, dim: int) -> float:
    """Upper bound on how much the Skellam mechanism's Rényi DP of order ``alpha`` exceeds
    the Gaussian's ``alpha Δ² / (2 variance)`` (Agarwal et al. 2021, Theorem 3.5 with
    ``μ = variance / 2`` and ``Δ₁ <= sqrt(dim) Δ₂``): ``min(((2α - 1) Δ₂² + 6 Δ₁) / (16 μ²),
    3 Δ₁ / (4 μ))``. Units: ``sensitivity`` and ``sqrt(variance)`` in the same integer units."""
    mu = variance / 2.0
    d1 = math.sqrt(dim) * sensitivity
    return min(((2 * alpha - 1) * sensitivity**2 + 6 * d1) / (16 * mu**2), 3 * d1 / (4 * mu))


def step_sensitivity(lr: float, clip: float, expected_batch: float) -> float:
    """L2 sensitivity (real units) of one partner's DP upload ``-(lr / B) Σ_j clip_C(g_j)``
    (:func:`step_upload`) to adding or removing one record: ``lr * C / B``, with ``B`` the
    expected total batch over all partners (``q * N``)."""
    if not (lr > 0 and clip > 0 and expected_batch > 0):
        raise PrivacyError(f"need lr, clip and expected batch > 0, got {lr!r}, {clip!r}, {expected_batch!r}")
    return float(lr) * float(clip) / float(expected_batch)


def step_upload(grad_sum: np.ndarray, lr: float, expected_batch: float) -> np.ndarray:
    """A DP partner's real upload (float64): ``-(lr / B) * grad_sum`` -- its part of one
    DP-SGD step over the union of the partners' Poisson batches; the key holders add the
    decrypted sum of these to the global model they already hold."""
    return -float(lr) / float(expected_batch) * np.asarray(grad_sum, dtype=np.float64)


#: largest Skellam-over-Gaussian RDP excess a DP upload accepts, relative to the Gaussian's
#: own RDP ``α / (2 z²)``, at every order of :data:`_ORDERS` (:func:`skellam_rdp_excess`):
#: Skellam's RDP curve then stays within a factor 1 + 1e-4 of the accounted Gaussian's at those
#: orders. Heart's defaults are at ~1e-10
MAX_RDP_EXCESS = 1e-4
#: the Rényi orders checked (1.01 ... 256, geometric)
_ORDERS = tuple(float(a) for a in np.geomspace(1.01, 256.0, 64))


def partner_noise_variance(cfg: DPConfig, lr: float, expected_batch: float, dim: int, local: bool = False) -> float:
    """Integer-unit noise variance one partner adds for ``cfg``: the aggregate needs
    ``(z * Δ_int)²`` (:func:`integer_sensitivity` of :func:`step_sensitivity`), split over
    ``k - t`` partners (:func:`share_variance`); ``local=True`` is local DP, where every
    partner adds all of it itself (a baseline: the sum then has k times the variance).

    Raises PrivacyError when the update scale is so small in integer units that Skellam's
    RDP exceeds the Gaussian's by more than the fraction :data:`MAX_RDP_EXCESS` at some order
    of :data:`_ORDERS` (then the accountant's Gaussian ε would understate it): raise the learning rate or clip."""
    sens = integer_sensitivity(step_sensitivity(lr, cfg.clip, expected_batch), dim)
    total = (cfg.noise_multiplier * sens) ** 2
    excess = max(skellam_rdp_excess(a, sens, total, dim) / (a / (2 * cfg.noise_multiplier**2)) for a in _ORDERS)
    if excess > MAX_RDP_EXCESS:
        raise PrivacyError(f"the update's sensitivity is only {sens:.3g} integer units: Skellam noise would exceed "
                           f"the Gaussian's Rényi DP by a fraction {excess:.2g} (> {MAX_RDP_EXCESS:g}); raise the learning rate "
                           "or the clip norm")
    return total if local else share_variance(total, cfg.min_partners, cfg.trust)
