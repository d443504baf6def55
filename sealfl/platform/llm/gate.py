"""The quality gate of a causal-LM release: each quantised variant against the fp32 merged model.

Scored (:mod:`sealfl.clients.causal_lm.scoring`) on held-out text blocks (int64 (n, L)) -- in a campaign, by each partner on its own
held-out text (only the counts below leave the partner) -- with two independent
implementations:

* the **reference**: the float32 merged model in torch (transformers), one forward pass per
  block;
* each **candidate**: the quantised ONNX bytes run the way a device runs them
  (:class:`sealfl.enclave.sandbox.decode.KVDecoder`: prefill over the first ``prefill`` tokens,
  then one token at a time with the KV cache; same onnxruntime options as the device child).

For every predicted position (``t_1 .. t_{L-1}`` of each block) it counts whether the
candidate's top-1 token equals the reference's and sums both models' negative
log-likelihood of the true next token (:class:`GateCounts`; counts from several partners
add up). The gate (:func:`check_gate`) passes a variant if its top-1 agreement is at
least ``min_top1_agreement`` and its perplexity at most ``max_perplexity_ratio`` times the
reference's (thresholds per variant in :data:`THRESHOLDS`, written into the release).

Thresholds from measurement (SmolLM2-135M, held-out text of the four manuals;
``bench/llm_quant.md``): base model int4 agreement 0.943 / perplexity ratio 1.021, int8
0.937 / 1.004; after LoRA int4 0.931 / 1.016, int8 0.944 / 1.027 and, in a one-step
campaign, int8 1.039 -- both variants are limited by the int8 activations, not by the
weights (the base's Q4_1 blocks fit both grids exactly). The bounds (0.88, 1.05) leave
room for that spread while refusing what a weaker scheme does (symmetric INT4: 0.69 and
1.29; 4-bit re-quantised adapted layers: 0.86 and 1.15).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sealfl.clients.causal_lm.scoring import candidate_scores, reference_scores
from sealfl.platform.errors import ReleaseError

__all__ = ["THRESHOLDS", "GateCounts", "reference_scores", "candidate_scores", "compare", "check_gate"]  # scores re-exported

THRESHOLDS = {
    "int4": {"min_top1_agreement": 0.88, "max_perplexity_ratio": 1.05},
    "int8": {"min_top1_agreement": 0.88, "max_perplexity_ratio": 1.05},
}


@dataclass
class GateCounts:
    """Additive counts of one candidate against the reference.

    Attributes:
        positions: predicted positions scored.
        agree: positions where the candidate's top-1 equals the reference's.
        nll_reference: summed NLL (nats) of the true next tokens under the reference.
        nll_candidate: the same under the candidate.
    """

    positions: int = 0
    agree: int = 0
    nll_reference: float = 0.0
    nll_candidate: float = 0.0

    def __add__(self, other: "GateCounts") -> "GateCounts":
        return GateCounts(self.positions + other.positions, self.agree + other.agree,
                          self.nll_reference + other.nll_reference, self.nll_candidate + other.nll_candidate)

    @property
    def agreement(self) -> float:
        return self.agree / self.positions if self.positions else float("nan")

    @property
    def perplexity_reference(self) -> float:
        return math.exp(self.nll_reference / self.positions) if self.positions else float("nan")

    @property
    def perplexity_candidate(self) -> float:
        return math.exp(self.nll_candidate / self.positions) if self.positions else float("nan")

    def to_dict(self) -> dict:
        return {"positions": self.positions, "top1_agreement": self.agreement,
                "perplexity_fp32": self.perplexity_reference, "perplexity": self.perplexity_candidate,
                "perplexity_ratio": self.perplexity_candidate / self.perplexity_reference if self.positions else None}


def compare(reference: list, candidate: list) -> GateCounts:
    """Counts of a candidate's scores against the reference's (same blocks, same order)."""
    if len(reference) != len(candidate):
        raise ReleaseError(f"{len(candidate)} candidate blocks for {len(reference)} reference blocks")
    c = GateCounts()
    for (r_top, r_nll), (c_top, c_nll) in zip(reference, candidate):
        c = c + GateCounts(int(len(r_top)), int(np.sum(r_top == c_top)), float(r_nll.sum()), float(c_nll.sum()))
    return c


def check_gate(results: dict[str, GateCounts], thresholds: dict = THRESHOLDS) -> dict:
    """The gate decision over pooled counts.

    Returns:
        ``{variant: {**counts.to_dict(), **thresholds, "passed": True}}``.

    Raises:
        ReleaseError: a variant has no threshold, no scored positions, a non-finite
            figure, agreement below or a perplexity ratio above its threshold (names the
            variant, the figure and the bound; nothing is released).
    """
    report = {}
    for name, counts in results.items():
        if name not in thresholds:
            raise ReleaseError(f"no gate thresholds for variant {name!r}")
        t = thresholds[name]
        d = counts.to_dict()
        if counts.positions < 1 or not all(math.isfinite(x) for x in (d["top1_agreement"], d["perplexity"],
                                                                        d["perplexity_fp32"])):
            raise ReleaseError(f"the {name} candidate has no finite gate figures ({d}); not releasing")
        if d["top1_agreement"] < t["min_top1_agreement"]:
            raise ReleaseError(f"{name} top-1 agreement with the fp32 merged model is {d['top1_agreement']:.3f} on "
                               f"{counts.positions} held-out positions, below {t['min_top1_agreement']}; not releasing")
        if d["perplexity_ratio"] > t["max_perplexity_ratio"]:
            raise ReleaseError(f"{name} held-out perplexity {d['perplexity']:.3f} is {d['perplexity_ratio']:.3f} x "
                               f"the fp32 merged model's {d['perplexity_fp32']:.3f} (allowed: "
                               f"{t['max_perplexity_ratio']}); not releasing")
        report[name] = {**d, **t, "passed": True}
    return report
