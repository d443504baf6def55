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

from dataclasses import dataclass
from typing import Any

import numpy as np

from sealfl.attestation.errors import CanaryError
from sealfl.common.fields import Fields

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


def _ids(fields: Fields, value: Any, path: str, vocab: int, *, lo_len: int, hi_len: int) -> tuple[int, ...]:
    fields.array(value, path, max_len=hi_len)
    if len(value) < lo_len:
        raise fields.fail(path, f"must hold at least {lo_len} token ids, got {len(value)}", "out_of_range")
    return tuple(fields.integer(x, f"{path}[{j}]", lo=0, hi=vocab - 1) for j, x in enumerate(value))


def parse_llm_canary(doc: Any) -> LLMCanary:
    """Validate an LLM canary object (module docstring).

    Raises:
        CanaryError: a key missing or extra, a wrong type, ids outside the vocabulary,
            ragged lists, a prefill outside ``1..len-1``, or bounds outside their ranges;
            the message names the field.
    """
    fields = Fields("llm canary", CanaryError)
    fields.object(doc, "")
    fields.only(doc, _KEYS)
    fields.get(doc, "schema", "choice", choices=(LLM_CANARY_SCHEMA,))
    vocab = fields.get(doc, "vocab", "integer", lo=2, hi=10_000_000)
    fields.get(doc, "reference", "string")
    agree = fields.get(doc, "min_agreement", "number", lo=0.0, hi=1.0, lo_open=True)
    diff = fields.get(doc, "max_mean_abs_diff", "number", lo=0.0, hi=1000.0, lo_open=True)
    lists = {name: fields.get(doc, name, "array", nonempty=True, max_len=MAX_SEQUENCES)
             for name in ("sequences", "prefill", "expected_top1", "expected_max_logit")}
    if len({len(v) for v in lists.values()}) != 1:
        raise CanaryError("llm canary sequences, prefill, expected_top1 and expected_max_logit differ in length")
    out_s, out_p, out_t, out_m = [], [], [], []
    for i, (s, p, t, m) in enumerate(zip(*lists.values())):
        seq = _ids(fields, s, f"sequences[{i}]", vocab, lo_len=2, hi_len=MAX_LEN)
        out_s.append(seq)
        out_p.append(fields.integer(p, f"prefill[{i}]", lo=1, hi=len(seq) - 1))
        top1 = _ids(fields, t, f"expected_top1[{i}]", vocab, lo_len=len(seq), hi_len=len(seq))
        out_t.append(top1)
        fields.array(m, f"expected_max_logit[{i}]", max_len=len(seq))
        if len(m) != len(seq):
            raise fields.fail(f"expected_max_logit[{i}]", f"must hold {len(seq)} numbers, got {len(m)}")
        out_m.append(tuple(fields.number(x, f"expected_max_logit[{i}][{j}]") for j, x in enumerate(m)))
    return LLMCanary(tuple(out_s), tuple(out_p), tuple(out_t), tuple(out_m), vocab, agree, diff, doc["reference"])


def check_llm_canary(canary: LLMCanary, results: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Decide whether the device's answers to the canary are acceptable.

    Args:
        canary: the parsed canary.
        results: per sequence, ``(top ids int (L, k), top logits float (L, k))`` sorted by
            logit, as :meth:`sealfl.enclave.sandbox.llm_runtime.LLMRuntime.score` returns them.

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
