"""The canary of a causal-LM release: signed prompts and the answers a device must give.
Pure; no I/O.

Schema ``sealfl.llm-canary/v1`` (inside the signed metadata of each model variant)::

    {"schema": "sealfl.llm-canary/v1",
     "sequences": [[token id, ...], ...],     # 1..16 sequences of 2..512 ids in [0, vocab)
     "prefill": [int, ...],                   # per sequence: tokens fed in the first call (1..len-1)
     "expected_top1": [[id, ...], ...],       # per sequence and position: the top-1 next token
     "expected_max_logit": [[float, ...], ...],  # ... and its logit
     "vocab": int,
     "min_agreement": float,                  # in (0, 1]
     "max_mean_abs_diff": float,              # > 0, logits
     "reference": str}

A device computes every position as a generation does -- one prefill call over the first
``prefill`` tokens, then one call per token with the KV cache -- and accepts the model only
if (:func:`check_llm_canary`) the share of positions whose top-1 token equals
``expected_top1`` is at least ``min_agreement`` AND the mean absolute difference between
its largest logit and ``expected_max_logit`` is at most ``max_mean_abs_diff``.

Why agreement and a mean instead of a per-logit tolerance: with int8 activations
(:mod:`sealfl.platform.llm.quantize`) a float32 rounding difference between CPUs can move
an activation across an int8 rounding boundary, and that difference grows through 30
layers. Measured with SmolLM2's INT4 release on one CPU between two kernel paths over the
same 4 x 96 tokens of text (all in one prefill call vs. token by token): top-1 agreement
0.930, mean |Δ max logit| 0.29, max 1.7 (INT8: 0.938, 0.27, 1.4) -- the scale of what
another CPU's float rounding does. A different model gives more: the base model's INT4 vs
the release's (3 LoRA steps apart) 0.841 / 0.72; the builder's symmetric INT4 0.617 / 1.55;
a saturating kernel or a broken KV cache far worse. :mod:`sealfl.platform.llm.canary`
sets 0.80 and 0.6 from these figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CanaryError

__all__ = ["LLM_CANARY_SCHEMA", "LLMCanary", "parse_llm_canary", "check_llm_canary"]

LLM_CANARY_SCHEMA = "sealfl.llm-canary/v1"
MAX_SEQUENCES = 16
MAX_LEN = 512
_KEYS = {"schema", "sequences", "prefill", "expected_top1", "expected_max_logit", "vocab", "min_agreement",
         "max_mean_abs_diff", "reference"}


@dataclass(frozen=True)
class LLMCanary:
    """A parsed LLM canary (fields as in the module docstring; lists of int/float)."""

    sequences: tuple[tuple[int, ...], ...]
    prefill: tuple[int, ...]
    expected_top1: tuple[tuple[int, ...], ...]
    expected_max_logit: tuple[tuple[float, ...], ...]
    vocab: int
    min_agreement: float
    max_mean_abs_diff: float
    reference: str


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise CanaryError(f"llm canary {what} must be a finite number, got {v!r}")
    return float(v)


def parse_llm_canary(doc: Any) -> LLMCanary:
    """Validate an LLM canary object (module docstring).

    Raises:
        CanaryError: a key missing or extra, a wrong type, ids outside the vocabulary,
            ragged lists, a prefill outside ``1..len-1``, or bounds outside their ranges;
            the message names the field.
    """
    if not isinstance(doc, dict):
        raise CanaryError(f"llm canary must be a JSON object, got {type(doc).__name__}")
    if set(doc) != _KEYS:
        raise CanaryError(f"llm canary keys must be {sorted(_KEYS)}, got {sorted(doc)}")
    if doc["schema"] != LLM_CANARY_SCHEMA:
        raise CanaryError(f"llm canary schema must be {LLM_CANARY_SCHEMA!r}, got {doc['schema']!r}")
    vocab = doc["vocab"]
    if not _is_int(vocab) or not 2 <= vocab <= 10_000_000:
        raise CanaryError(f"llm canary vocab must be an integer in [2, 1e7], got {vocab!r}")
    if not isinstance(doc["reference"], str) or not doc["reference"]:
        raise CanaryError("llm canary reference must be a non-empty string")
    agree = _number(doc["min_agreement"], "min_agreement")
    diff = _number(doc["max_mean_abs_diff"], "max_mean_abs_diff")
    if not 0 < agree <= 1 or not 0 < diff <= 1000:
        raise CanaryError(f"llm canary bounds out of range: min_agreement {agree} (0, 1], max_mean_abs_diff {diff} (0, 1000]")
    seqs, pre, top1, maxl = doc["sequences"], doc["prefill"], doc["expected_top1"], doc["expected_max_logit"]
    for name, v in (("sequences", seqs), ("prefill", pre), ("expected_top1", top1), ("expected_max_logit", maxl)):
        if not isinstance(v, list) or not 1 <= len(v) <= MAX_SEQUENCES:
            raise CanaryError(f"llm canary {name} must be a list of 1..{MAX_SEQUENCES} entries")
    if not len(seqs) == len(pre) == len(top1) == len(maxl):
        raise CanaryError("llm canary sequences, prefill, expected_top1 and expected_max_logit differ in length")
    out_s, out_p, out_t, out_m = [], [], [], []
    for i, (s, p, t, m) in enumerate(zip(seqs, pre, top1, maxl)):
        if not isinstance(s, list) or not 2 <= len(s) <= MAX_LEN or not all(_is_int(x) and 0 <= x < vocab for x in s):
            raise CanaryError(f"llm canary sequences[{i}] must be 2..{MAX_LEN} token ids in [0, {vocab})")
        if not _is_int(p) or not 1 <= p < len(s):
            raise CanaryError(f"llm canary prefill[{i}] must be an integer in [1, {len(s) - 1}], got {p!r}")
        if not isinstance(t, list) or len(t) != len(s) or not all(_is_int(x) and 0 <= x < vocab for x in t):
            raise CanaryError(f"llm canary expected_top1[{i}] must hold {len(s)} token ids in [0, {vocab})")
        if not isinstance(m, list) or len(m) != len(s):
            raise CanaryError(f"llm canary expected_max_logit[{i}] must hold {len(s)} numbers")
        out_s.append(tuple(s))
        out_p.append(p)
        out_t.append(tuple(t))
        out_m.append(tuple(_number(x, f"expected_max_logit[{i}]") for x in m))
    return LLMCanary(tuple(out_s), tuple(out_p), tuple(out_t), tuple(out_m), vocab, agree, diff, doc["reference"])


def check_llm_canary(canary: LLMCanary, results: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Decide whether the device's answers to the canary are acceptable.

    Args:
        canary: the parsed canary.
        results: per sequence, ``(top ids int (L, k), top logits float (L, k))`` sorted by
            logit, as :meth:`sealfl.enclave.llm_runtime.LLMRuntime.score` returns them.

    Returns:
        ``{"agreement": float, "mean_abs_diff": float, "positions": int}``.

    Raises:
        CanaryError: wrong shapes, logits that are not finite, agreement below
            ``min_agreement`` or mean difference above ``max_mean_abs_diff``.
    """
    if len(results) != len(canary.sequences):
        raise CanaryError(f"{len(results)} answers for {len(canary.sequences)} canary sequences")
    hits, diffs = [], []
    for i, ((ids, vals), seq) in enumerate(zip(results, canary.sequences)):
        ids, vals = np.asarray(ids), np.asarray(vals, dtype=np.float64)
        if ids.ndim != 2 or vals.shape != ids.shape or ids.shape[0] != len(seq) or ids.shape[1] < 1:
            raise CanaryError(f"canary sequence {i}: the model answered shape {ids.shape}, expected ({len(seq)}, k)")
        if not np.all(np.isfinite(vals)):
            raise CanaryError(f"canary sequence {i}: the model's logits are not finite")
        hits.append(ids[:, 0] == np.asarray(canary.expected_top1[i]))
        diffs.append(np.abs(vals[:, 0] - np.asarray(canary.expected_max_logit[i])))
    agreement = float(np.mean(np.concatenate(hits)))
    mean_diff = float(np.mean(np.concatenate(diffs)))
    stats = {"agreement": agreement, "mean_abs_diff": mean_diff, "positions": int(sum(map(len, hits)))}
    if agreement < canary.min_agreement or mean_diff > canary.max_mean_abs_diff:
        raise CanaryError(
            f"the model's next-token answers on this device agree with the release's canary on {agreement:.3f} of "
            f"{stats['positions']} positions (at least {canary.min_agreement:.3f} required) and its top logits differ "
            f"by {mean_diff:.3f} on average (at most {canary.max_mean_abs_diff:.3f} allowed); this device does not "
            "compute what was released")
    return stats
