"""Privacy accounting of a DP campaign with Google's ``dp-accounting`` (PLD accountant).

What is accounted: every round, each record of partner i is included in its partner's
clipped gradient sum with probability ``q_i`` (Poisson sampling, the rate that partner
really used) and the aggregate carries noise of std ``z · Δ`` (:mod:`sealfl.he.dp`, Skellam
accounted as the Gaussian of the same variance -- see that module for the bound on the
difference). A record lives at one partner, so round r is a Poisson-sampled Gaussian
mechanism with rate ``max_i q_i`` (the worst partner's records), one local step per round
(a DP round uploads one clipped gradient sum: several un-noised local steps would give a
record an unbounded influence on the upload). Rounds compose (``ComposedDpEvent``); the
neighbouring relation is add-or-remove one record. ε comes from the privacy-loss
distribution (Koskela et al.; Doroshenko et al., PETS 2022), discretised at 1e-4.

Pure functions of public numbers; no randomness, no I/O.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from sealfl.he.errors import PrivacyError

__all__ = ["check_budget", "epsilon", "calibrate_noise_multiplier", "Ledger"]

#: PLD discretisation of the privacy loss (dp-accounting's default)
_PLD_INTERVAL = 1e-4


def check_budget(epsilon: float | None, delta: float) -> None:
    """Raise PrivacyError unless ``0 < delta < 1`` and ``epsilon`` is None or in (0, 100]."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise PrivacyError(f"DP delta must be in (0, 1), got {delta!r} (typically below 1/records, e.g. 1e-5)")
    if epsilon is not None and (isinstance(epsilon, bool) or not isinstance(epsilon, (int, float))
                                or not math.isfinite(epsilon) or not 0 < epsilon <= 100):
        raise PrivacyError(f"DP epsilon must be in (0, 100], got {epsilon!r}")


def _event(noise_multiplier: float, rates: list[float]):
    import dp_accounting

    gauss = dp_accounting.GaussianDpEvent(noise_multiplier)
    events = []
    for q in rates:  # consecutive equal rates compose as one self-composed event (faster)
        if events and events[-1][0] == q:
            events[-1][1] += 1
        else:
            events.append([q, 1])
    parts = [dp_accounting.SelfComposedDpEvent(gauss if q >= 1 else dp_accounting.PoissonSampledDpEvent(q, gauss), n)
             for q, n in events]
    return dp_accounting.ComposedDpEvent(parts)


def epsilon(noise_multiplier: float, rates: list[float], delta: float) -> float:
    """ε after rounds with sampling rates ``rates`` (one per round, each in (0, 1]) at noise
    multiplier ``noise_multiplier`` and ``delta``; 0.0 for no rounds. Raises PrivacyError for
    values out of range."""
    from dp_accounting import pld

    check_budget(None, delta)
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier > 0):
        raise PrivacyError(f"noise multiplier must be > 0, got {noise_multiplier!r}")
    if any(not 0 < q <= 1 for q in rates):
        raise PrivacyError(f"sampling rates must be in (0, 1], got {rates!r}")
    if not rates:
        return 0.0
    acc = pld.PLDAccountant(value_discretization_interval=_PLD_INTERVAL)
    acc.compose(_event(float(noise_multiplier), [float(q) for q in rates]))
    return float(acc.get_epsilon(delta))


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sampling_rate: float, rounds: int) -> float:
    """Smallest noise multiplier (to within 1e-3 relative, rounded up) that keeps ``rounds``
    rounds at ``sampling_rate`` within (``target_epsilon``, ``delta``) by :func:`epsilon`.
    The RDP accountant (looser, fast) gives an upper end; bisection on the PLD ε narrows it.
    Raises PrivacyError for values out of range."""
    import dp_accounting
    from dp_accounting import rdp

    check_budget(target_epsilon, delta)
    if not 0 < sampling_rate <= 1 or not isinstance(rounds, int) or not 1 <= rounds <= 100_000:
        raise PrivacyError(f"need 0 < sampling rate <= 1 and 1 <= rounds <= 100000, got {sampling_rate!r}, {rounds!r}")
    rates = [float(sampling_rate)] * rounds
    absl = logging.getLogger("absl")  # the RDP accountant warns for every order it drops at small noise
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        hi = float(dp_accounting.calibrate_dp_mechanism(
            rdp.RdpAccountant, lambda s: _event(s, rates), target_epsilon, delta,
            bracket_interval=dp_accounting.LowerEndpointAndGuess(0.05, 1.0), tol=1e-4))
    finally:
        absl.setLevel(level)
    lo = hi / 4
    if epsilon(lo, rates, delta) <= target_epsilon:
        return lo
    while hi / lo > 1 + 1e-3:
        mid = math.sqrt(lo * hi)
        if epsilon(mid, rates, delta) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass
class Ledger:
    """A campaign's privacy spend so far.

    Attributes:
        noise_multiplier: z of every round.
        delta: δ the ε is reported at.
        budget: the ``--dp-epsilon`` budget (None: no stop, only reporting).
        rates: the sampling rate (max over partners) of every published round.
    """

    noise_multiplier: float
    delta: float
    budget: float | None = None
    rates: list[float] = field(default_factory=list)

    def __post_init__(self):
        check_budget(self.budget, self.delta)

    def spent(self) -> float:
        """ε of the rounds recorded so far."""
        return epsilon(self.noise_multiplier, self.rates, self.delta)

    def allows(self, rate: float) -> bool:
        """True if one more round at ``rate`` stays within the budget (always without one)."""
        return self.budget is None or epsilon(self.noise_multiplier, self.rates + [rate], self.delta) <= self.budget

    def record(self, rate: float) -> float:
        """Add a published round at ``rate``; returns ε so far."""
        if not 0 < rate <= 1:
            raise PrivacyError(f"sampling rate must be in (0, 1], got {rate!r}")
        self.rates.append(float(rate))
        return self.spent()

    def privacy_block(self, clip: float, min_partners: int, trust: int) -> dict:
        """The ``privacy`` block of rounds.jsonl / release metadata (JSON; what an auditor reads)."""
        return {"mechanism": "skellam (distributed, inside packed BFV)", "accountant": "dp-accounting PLD",
                "neighbouring": "add or remove one record", "epsilon": self.spent(), "delta": self.delta,
                "epsilon_budget": self.budget, "noise_multiplier": self.noise_multiplier, "clip": clip,
                "rounds": len(self.rates), "max_sampling_rate": max(self.rates, default=0.0),
                "min_partners": min_partners, "trust": trust}
