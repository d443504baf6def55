"""What a campaign report shows, read from the round records of ``rounds.jsonl``. Pure.

Every record is hostile until checked (a campaign directory is a file tree anyone may
edit): a figure that is missing, not a finite number or out of its range becomes ``None``
(a gap in the plot, "n/a" in the tables) and is counted in :attr:`Series.skipped`, never
an exception; partner names are strings of at most 200 characters, at most 1,024 partners.

Per round (``r`` = the record): pooled test accuracy (``pooled_test_accuracy``, 0..1),
mean training loss (``train_loss``), per partner accuracy and loss (``per_partner[name]``
``{"accuracy", "loss"}``; for the causal-LM task perplexity = exp(loss), as the release
gate computes it), ciphertext bytes received (``ciphertext_bytes_in``), bytes of the
aggregate (``aggregate_bytes``), seconds (``round_seconds``, ``aggregate_seconds``),
replies refused (``rejected``, ``stats_rejected``, ``eval_rejected``: partner -> reason)
and DP's ``epsilon`` when the campaign is differentially private.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Series", "series_of", "MAX_PARTNERS", "MAX_NAME"]

MAX_PARTNERS = 1024
MAX_NAME = 200
_REFUSALS = ("stats_rejected", "rejected", "eval_rejected")


@dataclass
class Series:
    """Figures per round, each list aligned with :attr:`rounds` (``None`` = not recorded).

    Attributes:
        rounds: round numbers (1-based), ascending, unique.
        pooled_accuracy, train_loss, ciphertext_mb, aggregate_mb, round_seconds,
            aggregate_seconds, epsilon: one value per round.
        partner_accuracy, partner_loss: partner -> one value per round.
        refused: partner -> reason -> count over the campaign.
        refused_per_round: replies refused in each round.
        skipped: values that were present but malformed (not shown).
    """

    rounds: list[int] = field(default_factory=list)
    pooled_accuracy: list[float | None] = field(default_factory=list)
    train_loss: list[float | None] = field(default_factory=list)
    ciphertext_mb: list[float | None] = field(default_factory=list)
    aggregate_mb: list[float | None] = field(default_factory=list)
    round_seconds: list[float | None] = field(default_factory=list)
    aggregate_seconds: list[float | None] = field(default_factory=list)
    epsilon: list[float | None] = field(default_factory=list)
    partner_accuracy: dict[str, list[float | None]] = field(default_factory=dict)
    partner_loss: dict[str, list[float | None]] = field(default_factory=dict)
    refused: dict[str, dict[str, int]] = field(default_factory=dict)
    refused_per_round: list[int] = field(default_factory=list)
    skipped: int = 0

    def to_dict(self) -> dict:
        """JSON-ready figures (the ``--json`` output of ``campaign report``)."""
        return {"rounds": self.rounds, "pooled_accuracy": self.pooled_accuracy, "train_loss": self.train_loss,
                "ciphertext_mb": self.ciphertext_mb, "aggregate_mb": self.aggregate_mb,
                "round_seconds": self.round_seconds, "aggregate_seconds": self.aggregate_seconds,
                "epsilon": self.epsilon, "partner_accuracy": self.partner_accuracy,
                "partner_loss": self.partner_loss, "refused": self.refused,
                "refused_per_round": self.refused_per_round, "skipped": self.skipped}


def _number(v: Any, lo: float = 0.0, hi: float = math.inf) -> float | None:
    if type(v) not in (int, float):
        return None
    x = float(v)
    return x if math.isfinite(x) and lo <= x <= hi else None


def _name(v: Any) -> str | None:
    return v if isinstance(v, str) and 0 < len(v) <= MAX_NAME and v.isprintable() else None


class _Reader:
    def __init__(self) -> None:
        self.skipped = 0

    def value(self, rec: Mapping, key: str, lo: float = 0.0, hi: float = math.inf, scale: float = 1.0):
        if key not in rec or rec[key] is None:
            return None
        x = _number(rec[key], lo, hi)
        if x is None:
            self.skipped += 1
            return None
        return x * scale


def series_of(records: Iterable[Mapping]) -> Series:
    """The report's figures from ``rounds.jsonl`` records (``CampaignDir.rounds()``).

    Args:
        records: parsed round records; a record whose ``round`` is not a positive integer,
            or repeats an earlier round, is left out (the last record of a round counts).

    Returns:
        a :class:`Series`; malformed values are gaps (module docstring), never errors.
    """
    by_round: dict[int, Mapping] = {}
    for rec in records:
        if isinstance(rec, Mapping) and type(rec.get("round")) is int and 0 < rec["round"] < 10**9:
            by_round[rec["round"]] = rec
    rd, s = _Reader(), Series()
    partners: list[str] = []
    for n in sorted(by_round):
        rec = by_round[n]
        s.rounds.append(n)
        s.pooled_accuracy.append(rd.value(rec, "pooled_test_accuracy", 0.0, 1.0))
        s.train_loss.append(rd.value(rec, "train_loss"))
        s.ciphertext_mb.append(rd.value(rec, "ciphertext_bytes_in", scale=1e-6))
        s.aggregate_mb.append(rd.value(rec, "aggregate_bytes", scale=1e-6))
        s.round_seconds.append(rd.value(rec, "round_seconds"))
        s.aggregate_seconds.append(rd.value(rec, "aggregate_seconds"))
        privacy = rec.get("privacy") if isinstance(rec.get("privacy"), Mapping) else rec
        s.epsilon.append(rd.value(privacy, "epsilon"))
        per = rec.get("per_partner")
        if per is not None and not isinstance(per, Mapping):
            rd.skipped += 1
            per = {}
        for raw, figures in dict(per or {}).items():
            name = _name(raw)
            if name is None or not isinstance(figures, Mapping):
                rd.skipped += 1
                continue
            if name not in partners:
                if len(partners) >= MAX_PARTNERS:
                    rd.skipped += 1
                    continue
                partners.append(name)
                gap = [None] * (len(s.rounds) - 1)
                s.partner_accuracy[name], s.partner_loss[name] = list(gap), list(gap)
            s.partner_accuracy[name].append(rd.value(figures, "accuracy", 0.0, 1.0))
            s.partner_loss[name].append(rd.value(figures, "loss"))
        for name in partners:  # a partner absent from this round: a gap
            for d in (s.partner_accuracy, s.partner_loss):
                if len(d[name]) < len(s.rounds):
                    d[name].append(None)
        count = 0
        for key in _REFUSALS:
            refusals = rec.get(key)
            if not isinstance(refusals, Mapping):
                if refusals is not None:
                    rd.skipped += 1
                continue
            for raw, reason in refusals.items():
                name = _name(raw) or "(unnamed)"
                why = (reason if isinstance(reason, str) else "unknown")[:MAX_NAME]
                if name not in s.refused and len(s.refused) >= MAX_PARTNERS:
                    rd.skipped += 1
                    continue
                per_reason = s.refused.setdefault(name, {})
                per_reason[why] = per_reason.get(why, 0) + 1
                count += 1
        s.refused_per_round.append(count)
    s.skipped = rd.skipped
    return s
