"""Decoding a causal-LM ONNX release with its KV cache: one sequence, token by token.

Standalone on purpose (standard library, numpy and onnxruntime only, no sealfl imports):
the sandboxed LLM child (:mod:`sealfl.enclave.sandbox.llm_child`) imports it by path, and the
partners' release gate and the canary builder run the very same code in-process, so
candidates are measured the way a device runs them. In ``sealfl.common`` because the
device (enclave), the partners (clients) and the release pipeline all use it.

The graph contract (what :mod:`sealfl.platform.llm.export` writes): inputs ``input_ids``
int64 (1, s), ``attention_mask`` int64 (1, past + s), ``past_key_values.{i}.key|value``
float32 (1, kv_heads, past, head_dim); outputs ``logits`` (1, s, vocab) and
``present.{i}.key|value`` (1, kv_heads, past + s, head_dim). A generation is one prefill
call over the prompt followed by one call per new token that feeds back the presents.

Token choice (:func:`choose_token`): temperature 0 is greedy (lowest id among equal
maxima, ``numpy.argmax``); otherwise softmax(logits / temperature) in float64, restricted
to the smallest set of most likely tokens whose probability reaches ``top_p`` (nucleus
sampling, Holtzman et al., ICLR 2020), renormalised, and sampled with the request's
``numpy.random.Generator`` (PCG64 seeded from ``seed``): the same seed gives the same text.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

__all__ = ["SamplingParams", "choose_token", "KVDecoder", "MAX_NEW_TOKENS_CAP"]

MAX_NEW_TOKENS_CAP = 4096
_PAST = re.compile(r"\Apast_key_values\.(\d+)\.(key|value)\Z")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens.

    Attributes:
        temperature: 0 = greedy; otherwise in (0, 5].
        top_p: nucleus mass in (0, 1].
        max_tokens: new tokens at most, 1..4096.
        seed: seed of the sampler's PCG64 generator.
        stop: stop strings (the text ends before the first one; at most 8, each 1..256 chars).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int = 0
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        t, p, n = self.temperature, self.top_p, self.max_tokens
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= 5:
            raise ValueError(f"temperature must be a number in [0, 5], got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NEW_TOKENS_CAP:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_NEW_TOKENS_CAP}], got {n!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.stop, tuple) or len(self.stop) > 8 or \
                any(not isinstance(s, str) or not 1 <= len(s) <= 256 for s in self.stop):
            raise ValueError("stop must be at most 8 strings of 1..256 characters")

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                "seed": self.seed, "stop": list(self.stop)}

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Build from a dict (unknown keys raise ValueError)."""
        extra = set(d) - {"temperature", "top_p", "max_tokens", "seed", "stop"}
        if extra:
            raise ValueError(f"unknown sampling parameters {sorted(extra)}")
        stop = d.get("stop", ())
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise ValueError("stop must be a string or a list of strings")
        return cls(temperature=d.get("temperature", 0.0), top_p=d.get("top_p", 1.0),
                   max_tokens=d.get("max_tokens", 128), seed=d.get("seed", 0), stop=tuple(stop))


#: candidate thresholds for the nucleus (top-p < 1), relative to the most likely token's probability
_NUCLEUS_THRESHOLDS = (1e-3, 1e-6)


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of most likely tokens whose probability reaches ``top_p``:
    the first ``n`` of ``argsort(-p, kind="stable")``, found without sorting the vocabulary.
    The tokens with ``p >= t`` (``t`` a fraction of the largest ``p``,
    :data:`_NUCLEUS_THRESHOLDS`) are the first ones of that sort -- every other token has
    ``p < t`` -- so if their mass reaches ``top_p`` the nucleus lies inside them, and
    sorting just them (by index first: ties in the stable order) gives it exactly. A flat
    distribution falls back to the full sort. Sorting 49,152 probabilities cost ~2.5 ms
    per sampled token on a quiet core, more than the rest of the choice."""
    top = float(p.max())
    for rel in _NUCLEUS_THRESHOLDS:
        cand = np.flatnonzero(p >= top * rel)  # ascending indices
        if 4 * cand.size > p.size:
            break
        order = cand[np.argsort(-p[cand], kind="stable")]
        cum = np.cumsum(p[order])
        if cum[-1] >= top_p:
            return order[: int(np.searchsorted(cum, top_p)) + 1]
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    return order[: int(np.searchsorted(cum, top_p)) + 1]


def choose_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick the next token id from float logits (vocab,) (module docstring).

    Raises:
        ValueError: the logits are not a finite 1-D array.
    """
    x = np.asarray(logits).reshape(-1)
    # one sum instead of an isfinite pass over the row: NaN and infinities propagate into it
    # (a sum of finite float32 logits overflows only for |logits| ~ 1e34, a broken model anyway)
    if x.size == 0 or not np.isfinite(x.sum(dtype=np.float64)):
        raise ValueError("the model produced logits that are not finite")
    if params.temperature == 0:
        return int(np.argmax(x))  # on the float32 row itself: widening is exact, the order the same
    x = x.astype(np.float64)
    p = x - x.max()
    p /= params.temperature  # in place: the same values as (x - max) / temperature
    np.exp(p, out=p)
    p /= p.sum()
    index = None
    if params.top_p < 1.0:
        index = np.sort(_nucleus(p, params.top_p))  # in index order, as a cumulative sum visits them
        q = np.zeros_like(p)
        q[index] = p[index]
        p = p[index] / q.sum()  # the nucleus's entries of q / q.sum(): the same sum, the same values
    # numpy's Generator.choice(n, p=p) for one draw: cdf = cumsum(p), cdf /= cdf[-1], one
    # uniform double, searchsorted(side="right") -- here without its input checks (p is a
    # softmax) and, for a nucleus, over its entries only: zeros add nothing to a cumulative
    # sum, so the first entry whose cdf exceeds the draw is the same token (tested against
    # rng.choice as the oracle)
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    j = int(np.searchsorted(cdf, rng.random(), side="right"))
    return int(index[j]) if index is not None else j


def _lazy_zeros(n: int, shape: tuple[int, ...]) -> np.ndarray:
    """``n`` zeroed float32 arrays of ``shape`` (one array (n, *shape)) in one fresh anonymous
    mapping, never malloc's: its pages become resident only when written, in 4 KiB pieces.
    ``numpy.zeros`` is not that in the child: after onnxruntime has built its session glibc
    serves 1.5 MB requests from heap memory it already touched (its mmap threshold grows
    with the large blocks freed) and, with the child's ``glibc.malloc.hugetlb=1``, in huge
    pages -- SmolLM2's 60 buffers of 2,048 positions were ~90 MB resident at once, against
    ~8 MB for a 200-token sequence this way (measured, issue 24)."""
    import mmap

    size = n * int(np.prod(shape)) * 4
    mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mm.madvise(mmap.MADV_NOHUGEPAGE)  # a 2 MiB page per touched head would undo the point
    return np.frombuffer(mm, dtype=np.float32, count=size // 4).reshape((n, *shape))


class KVDecoder:
    """One sequence's decoding state over an onnxruntime session of a causal-LM release.

    Two ways to run the graph, same logits bit for bit (checked at construction):

    * **shared buffer** (the default where the graph allows it): one preallocated KV buffer
      per past input, float32 (1, kv_heads, max_context, head_dim), bound with
      onnxruntime's ``IOBinding`` as both the ``past_key_values.*`` input and the
      ``present.*`` output: the graph's ``GroupQueryAttention`` (com.microsoft) then
      appends the new positions in place (its ``past_present_share_buffer`` mode, the one
      onnxruntime-genai decodes with) and reads only the first ``total_sequence_length``
      positions (from ``attention_mask``). No copy of the past per step, no fresh output
      memory per step; the last position's logits land in one preallocated row. The
      buffers are one anonymous mapping of their own (:func:`_lazy_zeros`, pages the
      kernel maps on first write): resident memory grows with the longest sequence
      decoded, not with ``max_context``;
    * **plain**: numpy arrays in, fresh arrays out, the presents fed back as the next
      pasts (graphs whose attention concatenates instead, e.g. a plain ``Attention``).

    At construction a short probe (a 2-token prefill and one step) runs both ways; the
    shared buffer is kept only if it gives the plain run's logits exactly, else (or if the
    graph refuses the binding) the decoder stays plain. :attr:`shared_buffer` says which.

    Args:
        session: an ``onnxruntime.InferenceSession`` of the graph contract above.
        max_context: largest total sequence length (prompt + generated) accepted (also the
            KV buffers' length).
        head_dim: size of one attention head, when the graph leaves it symbolic (the
            builder's export names it ``kv_cache_dim``; the release states it).
        io_binding: try the shared buffer (default True); False keeps the plain way.

    Raises:
        ValueError: the session does not follow the graph contract.
    """

    def __init__(self, session, max_context: int = 2048, head_dim: int | None = None,
                 io_binding: bool = True) -> None:
        self.session = session
        self.max_context = int(max_context)
        ins = {i.name: i for i in session.get_inputs()}
        outs = {o.name: o for o in session.get_outputs()}
        if "input_ids" not in ins or "attention_mask" not in ins or "logits" not in outs:
            raise ValueError("the model is not a causal LM with input_ids/attention_mask -> logits")
        self.past_names = sorted((n for n in ins if _PAST.match(n)),
                                 key=lambda n: (int(_PAST.match(n).group(1)), _PAST.match(n).group(2)))
        if not self.past_names:
            raise ValueError("the model has no past_key_values inputs (no KV cache)")
        shape = ins[self.past_names[0]].shape
        if len(shape) == 4 and isinstance(shape[3], int):
            head_dim = shape[3] if head_dim is None else head_dim
        if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(head_dim, int) or head_dim < 1 \
                or (isinstance(shape[3], int) and shape[3] != head_dim):
            raise ValueError(f"past_key_values must be (batch, kv_heads, past, head_dim) with a known head_dim, "
                             f"got {shape} and head_dim {head_dim!r}")
        self.kv_heads, self.head_dim = int(shape[1]), int(head_dim)
        self.output_names = list(outs)
        # releases built since the logits_start input (sealfl.platform.llm.head) let the
        # caller skip the head for all but the last position; older graphs compute them all
        self.has_logits_start = "logits_start" in ins
        self.present_for = {n: n.replace("past_key_values.", "present.") for n in self.past_names}
        missing = [p for p in self.present_for.values() if p not in outs]
        if missing:
            raise ValueError(f"the model lacks present outputs {missing[:3]}")
        vocab = (outs["logits"].shape or [None])[-1]
        self._vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
        self._binding = None
        self.shared_buffer = False
        self.reset()
        if io_binding:
            self.shared_buffer = self._try_shared_buffer()

    # -- the two ways to run -----------------------------------------------------------

    def _bind_shared(self) -> None:
        import onnxruntime as ort

        kv = _lazy_zeros(len(self.past_names), (1, self.kv_heads, self.max_context, self.head_dim))
        self._kv_map = kv.base  # the mapping, kept alive with the arrays
        kv = dict(zip(self.past_names, kv))
        values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in kv.items()}
        b = self.session.io_binding()
        for n, v in values.items():  # the same memory is the past and the present
            b.bind_ortvalue_input(n, v)
            b.bind_ortvalue_output(self.present_for[n], v)
        self._kv, self._kv_values, self._binding = kv, values, b  # arrays kept alive with their OrtValues
        self._mask = np.ones((1, self.max_context), dtype=np.int64)
        self._row = self._row_value = None
        if self._vocab is not None:
            self._row = np.zeros((1, 1, self._vocab), dtype=np.float32)
            self._row_value = ort.OrtValue.ortvalue_from_numpy(self._row)

    def _try_shared_buffer(self) -> bool:
        """Bind the shared buffer if a probe gives the plain logits exactly (class docstring)."""
        probe = [0, 0]
        if self.max_context < len(probe) + 1:
            return False
        try:
            plain = [self.feed(probe, last_only=True), self.feed(probe[:1], last_only=True)]
            self.reset()
            self._bind_shared()
            shared = [self.feed(probe, last_only=True), self.feed(probe[:1], last_only=True)]
        except Exception:  # noqa: BLE001 -- onnxruntime refuses the binding: stay plain
            shared = None
        ok = shared is not None and all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(plain, shared))
        if not ok:
            self._binding = None
        self.reset()
        return ok

    def _run_plain(self, arr: np.ndarray, total: int, last_only: bool) -> np.ndarray:
        feed = {"input_ids": arr, "attention_mask": np.ones((1, total), dtype=np.int64), **self.past}
        if self.has_logits_start:
            feed["logits_start"] = np.array([-1 if last_only else 0], dtype=np.int64)
        out = dict(zip(self.output_names, self.session.run(self.output_names, feed)))
        self.past = {n: out[p] for n, p in self.present_for.items()}
        return out["logits"][0]

    def _run_shared(self, arr: np.ndarray, total: int, last_only: bool) -> np.ndarray:
        b = self._binding
        b.bind_cpu_input("input_ids", arr)
        b.bind_cpu_input("attention_mask", self._mask[:, :total])
        if self.has_logits_start:
            b.bind_cpu_input("logits_start", np.array([-1 if last_only else 0], dtype=np.int64))
        one_row = arr.shape[1] == 1 or (last_only and self.has_logits_start)
        if one_row and self._row_value is not None:
            b.bind_ortvalue_output("logits", self._row_value)
            self.session.run_with_iobinding(b)
            return self._row[0]
        b.bind_output("logits", "cpu")  # every position (scoring, or a graph without logits_start)
        self.session.run_with_iobinding(b)
        return b.get_outputs()[len(self.past_names)].numpy()[0]

    # -- API ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the sequence (empty KV cache)."""
        empty = np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32)
        self.past = {n: empty for n in self.past_names} if self._binding is None else {}
        self.length = 0  # the shared buffer's positions past `length` are never read

    def feed(self, ids, last_only: bool = False, copy: bool = True) -> np.ndarray:
        """Append token ids to the sequence; return their logits, float32 (len(ids), vocab),
        or (1, vocab) for the last id only with ``last_only`` (the graph then computes the
        head for that position alone when it has the ``logits_start`` input). With
        ``copy=False`` the row may be a view of the decoder's own buffer, valid until the
        next call (the decode loop's way: nothing is copied per step).

        Raises:
            ValueError: no ids, an id outside int64, or the context would exceed ``max_context``.
        """
        arr = np.asarray(list(ids), dtype=np.int64).reshape(1, -1)
        if arr.shape[1] == 0:
            raise ValueError("no token ids to feed")
        if self.length + arr.shape[1] > self.max_context:
            raise ValueError(f"context of {self.length + arr.shape[1]} tokens exceeds the limit of {self.max_context}")
        total = self.length + arr.shape[1]
        logits = (self._run_shared if self._binding is not None else self._run_plain)(arr, total, last_only)
        self.length = total
        if logits.shape[0] != (1 if last_only and self.has_logits_start else arr.shape[1]):
            raise ValueError(f"the model returned logits for {logits.shape[0]} positions, fed {arr.shape[1]}")
        logits = logits[-1:] if last_only else logits
        aliased = self._binding is not None and self._row is not None and np.may_share_memory(logits, self._row)
        return logits.copy() if copy and aliased else logits

    def teacher_forced(self, ids, prefill: int) -> np.ndarray:
        """Logits for every position of ``ids`` computed as a device does: one prefill call
        over the first ``prefill`` tokens, then one call per token. float32 (len(ids), vocab)."""
        ids = list(ids)
        if not 1 <= prefill <= len(ids):
            raise ValueError(f"prefill must lie in [1, {len(ids)}], got {prefill}")
        self.reset()
        rows = [self.feed(ids[:prefill])]
        for t in ids[prefill:]:
            rows.append(self.feed([t]))
        self.reset()
        return np.concatenate(rows, axis=0)
