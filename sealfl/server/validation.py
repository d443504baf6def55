"""What a partner's reply must satisfy before any of it counts: pure checks of one reply.

One layer for every reply kind -- train (:func:`parse_train_reply`), the statistics
round (:func:`parse_stats_reply`), evaluate (:func:`parse_eval_reply`) and the release
gate's query round (:func:`parse_candidate_reply`, :func:`check_candidate_counts`). Who
sent a reply (node binding, signature, one reply per partner per round) is checked by
:mod:`sealfl.server.intake`; this module checks *what* it says. Each function takes the
reply's ``RecordDict`` (flwr 1.42) plus what is already known (limits, the partner's
earlier declarations) and returns plain parsed values, or raises :class:`ReplyError`
naming the field and the reason. Nothing here logs, reads files or keeps state.

Order of checks for a reply (the first failure is the reason given):

1. **shape**: exactly the expected records (by name and kind) and keys -- nothing more,
   so an unexpected record or key (e.g. a second ciphertext) is refused, not ignored;
2. **size before parsing**: a ciphertext ``Array`` is checked for dtype/shape metadata
   and a byte length of at most :meth:`~sealfl.he.framed.ChunkedParams.max_frame_bytes` (+ the npy header)
   before NumPy or SEAL reads it; then the frame itself
   (:meth:`sealfl.he.framed.FramedCodec.split` / ``load_chunks``: the expected value
   layout -- packed for updates, wide for statistics --, canonical, fresh-shaped, addable);
3. **numbers**: counts are ``int`` (not ``bool``, not ``float``, not ``str``) within
   ``[1, ReplyLimits.max_examples]``; ``correct`` within ``[0, n]``; losses finite within
   ``[0, ReplyLimits.max_loss]``; accuracies finite within ``[0, 1]`` and equal to
   ``correct / n`` (to 1e-9);
4. **consistency across rounds**: a train reply's ``num-examples`` equals the ``n`` that
   partner declared in the statistics round; an evaluate reply's ``n`` equals that
   partner's earlier evaluate ``n``; in the query round every candidate's ``n`` is the same
   and equals the partner's ``n`` from the campaign when it is known.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from sealfl.common import protocol as P
from sealfl.common.fields import Fields
from sealfl.he.codecs import Codec
from sealfl.he.errors import CiphertextError
from sealfl.he.framed import PACKED, WIDE, Layout
from sealfl.server.aggregate import RunningSum
from sealfl.server.errors import ReplyError, ServerError

__all__ = [
    "ReplyLimits", "TrainReply", "StatsReply", "EvalReply",
    "check_count", "check_real", "check_shape", "check_u8_array", "check_frame",
    "parse_train_reply", "parse_stats_reply", "parse_eval_reply", "parse_candidate_reply", "split_evaluation",
    "check_candidate_counts",
]

#: bytes an npy header (``np.save``, format 1.0/2.0) may add to an Array's raw data
NPY_HEADER_MAX = 4096
#: |accuracy - correct/n| a reply may show (partners send correct/n computed in float64)
ACCURACY_TOLERANCE = 1e-9


@dataclass(frozen=True)
class ReplyLimits:
    """Caps on what a partner may report (one object, like TUF's ``UpdaterConfig``).

    Attributes:
        max_examples: largest row count a partner may declare for its training or test
            split (the statistics round's ``n``, a train reply's ``num-examples``, an
            evaluate reply's ``n``). One partner's weight in FedAvg is its count over the
            total, so an unbounded count lets one partner take over the model.
        max_loss: largest loss a partner may report. Binary cross-entropy with the
            task's epsilon 1e-7 is at most -ln(1e-7) ≈ 16.1 per row; the train loss adds
            FedProx's proximal term, so the default leaves room (100).
    """

    max_examples: int = 1_000_000
    max_loss: float = 100.0

    def __post_init__(self):
        if isinstance(self.max_examples, bool) or not isinstance(self.max_examples, int) or self.max_examples < 1:
            raise ServerError(f"max_examples must be a positive int, got {self.max_examples!r}")
        if not (isinstance(self.max_loss, (int, float)) and math.isfinite(self.max_loss) and self.max_loss > 0):
            raise ServerError(f"max_loss must be a positive finite number, got {self.max_loss!r}")

    def to_dict(self) -> dict:
        """The limits as a JSON-serialisable dict (what :class:`ServerConfig` stores)."""
        return asdict(self)


@dataclass(frozen=True)
class TrainReply:
    """A checked train reply: ``frame`` (the update's ciphertext frame, bytes),
    ``chunks`` (its canonical chunks), ``n`` (int), ``loss`` (float) and ``nbytes`` (the
    frame's size in bytes). When the reply was added into a :class:`RunningSum`,
    ``frame`` is ``b""`` and ``chunks`` empty: its bytes are not kept, so a round holds
    one sum, not one update per partner."""

    frame: bytes
    chunks: list[bytes]
    n: int
    loss: float
    nbytes: int


@dataclass(frozen=True)
class StatsReply:
    """A checked statistics reply: ``frame``/``chunks`` of E([n, Σx, Σx²]) and the declared ``n``."""

    frame: bytes
    chunks: list[bytes]
    n: int


@dataclass(frozen=True)
class EvalReply:
    """A checked evaluate reply: ``n`` test rows, ``correct`` of them, ``accuracy`` = correct/n, ``loss``."""

    n: int
    correct: int
    accuracy: float
    loss: float


# ---- single values ---------------------------------------------------------------------

#: the field checker of replies: ``ReplyError(field, reason)`` (:mod:`sealfl.common.fields`)
_REPLY = Fields("reply", lambda path, problem, code: ReplyError(path, problem), detailed=True)


def check_count(value: Any, field: str, *, lo: int = 1, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``. Only Python/NumPy integers count: a bool, a
    float (even 201.0 -- a partner sends counts as ints), NaN, a string or a list is
    refused. Raises ReplyError(field, reason)."""
    return _REPLY.integer(value, field, lo=lo, hi=hi)


def check_real(value: Any, field: str, *, lo: float, hi: float) -> float:
    """``value`` as a finite float in ``[lo, hi]`` (ints are accepted as reals; bools,
    strings, lists, NaN and infinities are not). Raises ReplyError(field, reason)."""
    return _REPLY.number(value, field, lo=lo, hi=hi)


# ---- records -----------------------------------------------------------------------------

_KINDS = {"array": ArrayRecord, "metric": MetricRecord, "config": ConfigRecord}


def check_shape(content: Any, expected: Mapping[str, tuple]) -> None:
    """Check that ``content`` (a RecordDict) holds exactly the records ``expected`` names
    (``{record name: (kind, keys[, optional keys])}``, kind one of ``"array"``,
    ``"metric"``, ``"config"``), each of that kind with exactly those keys (plus any of
    the optional ones). Raises ReplyError."""
    try:
        names = set(content.keys())
    except Exception as exc:  # not a RecordDict at all
        raise ReplyError("content", f"is not a record dictionary ({type(content).__name__})") from exc
    if names != set(expected):
        extra, missing = sorted(names - set(expected)), sorted(set(expected) - names)
        raise ReplyError("content", "unexpected records " + (f"{extra}" if extra else "[]")
                         + ", missing records " + (f"{missing}" if missing else "[]"))
    for name, (kind, keys, *optional) in expected.items():
        rec = content[name]
        if not isinstance(rec, _KINDS[kind]):
            raise ReplyError(name, f"must be a {_KINDS[kind].__name__}, got {type(rec).__name__}")
        have = set(rec.keys()) - set(optional[0] if optional else ())
        if have != set(keys):
            raise ReplyError(name, f"unexpected keys {sorted(have - set(keys))}, missing keys {sorted(set(keys) - have)}")


def check_u8_array(array: Any, field: str, max_bytes: int) -> bytes:
    """The bytes carried by a uint8 ``Array`` of at most ``max_bytes`` values.

    The Array's declared dtype/shape/stype and the length of its serialised data are
    checked BEFORE it is deserialised; then the deserialised array must be 1-D uint8 of
    the declared length. Raises ReplyError.
    """
    if not isinstance(array, Array):
        raise ReplyError(field, f"must be an Array, got {type(array).__name__}")
    if array.stype != "numpy.ndarray" or array.dtype != "uint8":
        raise ReplyError(field, f"must be a numpy uint8 array, got {array.stype} {array.dtype}")
    shape = tuple(array.shape)
    if len(shape) != 1 or not isinstance(shape[0], int):
        raise ReplyError(field, f"must be 1-D, got shape {shape}")
    if shape[0] > max_bytes or len(array.data) > max_bytes + NPY_HEADER_MAX:
        raise ReplyError(field, f"{max(shape[0], len(array.data))} bytes exceed the bound of {max_bytes} bytes "
                                "(refused before parsing)")
    try:
        arr = array.numpy()
    except Exception as exc:  # np.load raises ValueError/EOFError/... on a bad npy stream
        raise ReplyError(field, f"is not a readable array ({type(exc).__name__}: {exc})") from exc
    if arr.dtype != np.uint8 or arr.shape != shape:
        raise ReplyError(field, f"data holds {arr.dtype} {arr.shape}, metadata says uint8 {shape}")
    return arr.tobytes()


def check_frame(codec: Codec, blob: bytes, length: int, field: str, layout: Layout = PACKED,
                parsed: list | None = None) -> list[bytes]:
    """A ciphertext frame of ``length`` values in ``layout`` that every sum may add:
    header, size bounds, canonical chunks, fresh-ciphertext shape, trial addition (see
    the codec module). Returns its chunks; if ``parsed`` is a list, the parsed chunks are
    appended to it. Raises ReplyError."""
    try:
        n, chunks = codec.split(blob, length, layout)
        loaded = codec.load_chunks(chunks, n, layout)
    except CiphertextError as exc:
        raise ReplyError(field, str(exc)) from exc
    if parsed is not None:
        parsed.extend(loaded)
    return chunks


# ---- reply kinds -------------------------------------------------------------------------

def _partner_shape(signed: bool) -> tuple[str, tuple]:
    """The ``partner`` record: name and signature (the signature is optional -- and not
    checked -- when the campaign has no partner keys)."""
    return (P.PARTNER, ("config", (P.NAME, P.SIGNATURE)) if signed else ("config", (P.NAME,), (P.SIGNATURE,)))


def parse_train_reply(content: Any, *, codec: Codec, length: int, limits: ReplyLimits, declared_n: int,
                      signed: bool = True, running: RunningSum | None = None,
                      defer_ciphertext: bool = False) -> TrainReply:
    """Check a train reply (see module docstring) and return it parsed.

    Args:
        content: the reply's RecordDict.
        codec: the campaign's public codec; ``length``: the model length P.
        limits: the campaign's :class:`ReplyLimits`.
        declared_n: the ``n`` this partner declared in the statistics round.
        signed: whether the ``partner`` record must carry a signature.
        running: if given, the update's parsed chunks are added to it once every check
            passed (the ciphertext is checked last), so the round's sum needs no second
            parse, and the returned reply keeps no ciphertext bytes.
        defer_ciphertext: check the frame's size, header and chunk bounds only
            (:meth:`~sealfl.he.framed.FramedCodec.split`) and return its chunks
            (``frame`` empty): the chunks' own checks (rules 3-4) then run in the sharded
            sum's tasks (:mod:`sealfl.server.sharded`), which refuse the reply whole if
            any chunk fails -- the reply does not count before they pass.
    Raises:
        ReplyError: naming the field and the reason.
    """
    check_shape(content, dict([(P.UPDATE, ("array", (P.UPDATE_CT,))),
                               (P.METRICS, ("metric", (P.NUM_EXAMPLES, P.TRAIN_LOSS))), _partner_shape(signed)]))
    m = content[P.METRICS]
    n = check_count(m[P.NUM_EXAMPLES], f"{P.METRICS}.{P.NUM_EXAMPLES}", hi=limits.max_examples)
    if n != declared_n:
        raise ReplyError(f"{P.METRICS}.{P.NUM_EXAMPLES}", f"{n} differs from the {declared_n} rows this partner "
                                                           "declared in the statistics round")
    loss = check_real(m[P.TRAIN_LOSS], f"{P.METRICS}.{P.TRAIN_LOSS}", lo=0.0, hi=limits.max_loss)
    field = f"{P.UPDATE}.{P.UPDATE_CT}"
    frame = check_u8_array(content[P.UPDATE][P.UPDATE_CT], field, codec.params.max_frame_bytes(length))
    if defer_ciphertext:
        try:
            _, chunks = codec.split(frame, length)
        except CiphertextError as exc:
            raise ReplyError(field, str(exc)) from exc
        return TrainReply(b"", chunks, n, loss, len(frame))
    parsed: list = []
    chunks = check_frame(codec, frame, length, field, parsed=parsed)
    if running is None:
        return TrainReply(frame, chunks, n, loss, len(frame))
    running.add(parsed)  # every check passed: nothing after this can refuse the reply
    return TrainReply(b"", [], n, loss, len(frame))


def parse_stats_reply(content: Any, *, codec: Codec, length: int, limits: ReplyLimits,
                      signed: bool = True) -> StatsReply:
    """Check a statistics-round reply: E([n, Σx, Σx²]) of ``length`` values and the
    declared ``n`` (an int in ``[1, max_examples]``). Raises ReplyError."""
    check_shape(content, dict([(P.STATS, ("array", (P.STATS_CT,))), (P.METRICS, ("metric", (P.NUM_EXAMPLES,))),
                               _partner_shape(signed)]))
    n = check_count(content[P.METRICS][P.NUM_EXAMPLES], f"{P.METRICS}.{P.NUM_EXAMPLES}", hi=limits.max_examples)
    field = f"{P.STATS}.{P.STATS_CT}"
    frame = check_u8_array(content[P.STATS][P.STATS_CT], field, codec.params.max_frame_bytes(length, WIDE))
    return StatsReply(frame, check_frame(codec, frame, length, field, WIDE), n)


def parse_eval_reply(content: Any, *, limits: ReplyLimits, expected_n: int | None, signed: bool = True) -> EvalReply:
    """Check an evaluate reply: ``n`` (int in ``[1, max_examples]``, equal to
    ``expected_n`` -- the partner's earlier evaluate ``n`` -- when given), ``correct``
    (int in ``[0, n]``), ``accuracy`` (= correct/n) and ``loss`` (finite, in
    ``[0, max_loss]``). Raises ReplyError."""
    check_shape(content, dict([(P.METRICS, ("metric", (P.NUM_EXAMPLES, P.ACCURACY, P.LOSS, P.CORRECT))),
                               _partner_shape(signed)]))
    m = content[P.METRICS]
    n = check_count(m[P.NUM_EXAMPLES], f"{P.METRICS}.{P.NUM_EXAMPLES}", hi=limits.max_examples)
    if expected_n is not None and n != expected_n:
        raise ReplyError(f"{P.METRICS}.{P.NUM_EXAMPLES}", f"{n} test rows, but this partner reported {expected_n} before")
    correct = check_count(m[P.CORRECT], f"{P.METRICS}.{P.CORRECT}", lo=0, hi=n)
    acc = check_real(m[P.ACCURACY], f"{P.METRICS}.{P.ACCURACY}", lo=0.0, hi=1.0)
    if abs(acc - correct / n) > ACCURACY_TOLERANCE:
        raise ReplyError(f"{P.METRICS}.{P.ACCURACY}", f"{acc} is not correct/n = {correct}/{n}")
    loss = check_real(m[P.LOSS], f"{P.METRICS}.{P.LOSS}", lo=0.0, hi=limits.max_loss)
    return EvalReply(n, correct, correct / n, loss)


def check_candidate_counts(counts: Any, candidates: Sequence[str], *, limits: ReplyLimits,
                           expected_n: int | None, where: str = P.METRICS,
                           sums: Sequence[str] = ()) -> dict[str, dict]:
    """Check ``{"<cand>.correct": int, "<cand>.n": int, ...}`` (exactly these keys, for
    every candidate, plus ``"<cand>.<s>"`` for each name ``s`` in ``sums``): each ``n`` an
    int in ``[1, max_examples]``, the same for every candidate and equal to ``expected_n``
    when given; each ``correct`` an int in ``[0, n]``; each sum (e.g. a summed NLL) a
    finite float in ``[0, max_loss * n]`` (a mean per example above ``max_loss`` is refused
    like a loss).

    Returns ``{candidate: {"correct": int, "n": int, <sum>: float}}``. Raises ReplyError.
    """
    want = {f"{c}.{k}" for c in candidates for k in ("correct", "n", *sums)}
    try:
        have = set(counts.keys())
    except Exception as exc:
        raise ReplyError(where, f"is not a mapping ({type(counts).__name__})") from exc
    if have != want:
        raise ReplyError(where, f"unexpected keys {sorted(map(str, have - want))}, missing keys {sorted(want - have)}")
    out: dict[str, dict] = {}
    for c in candidates:
        n = check_count(counts[f"{c}.n"], f"{where}.{c}.n", hi=limits.max_examples)
        correct = check_count(counts[f"{c}.correct"], f"{where}.{c}.correct", lo=0, hi=n)
        out[c] = {"correct": correct, "n": n}
        for key in sums:
            v = counts[f"{c}.{key}"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not 0 <= v <= limits.max_loss * n:
                raise ReplyError(f"{where}.{c}.{key}", f"must be a finite number in [0, {limits.max_loss * n:g}], "
                                                       f"got {v!r}")
            out[c][key] = float(v)
    ns = {c: v["n"] for c, v in out.items()}
    if len(set(ns.values())) > 1:
        raise ReplyError(f"{where}.n", f"candidates were scored on different numbers of rows: {ns}")
    if expected_n is not None and ns and next(iter(ns.values())) != expected_n:
        raise ReplyError(f"{where}.n", f"{next(iter(ns.values()))} test rows, but this partner reported "
                                       f"{expected_n} during the campaign")
    return out


def split_evaluation(content: Any) -> tuple[Any, dict | None]:
    """A train reply that also carries the evaluation of the previous round's aggregate
    (:data:`sealfl.common.protocol.EVALUATION`), split into (the train reply without it,
    the evaluation as an evaluate reply's records -- ``metrics`` and the same ``partner`` --
    or None when it has none), for :func:`parse_train_reply` and :func:`parse_eval_reply`.
    Content that is no record dictionary is returned whole (its checks refuse it)."""
    try:
        names = list(content.keys())
    except Exception:  # noqa: BLE001 - not a RecordDict: parse_train_reply names it
        return content, None
    if P.EVALUATION not in names:
        return content, None
    train = {k: content[k] for k in names if k != P.EVALUATION}
    evaluation = {P.METRICS: content[P.EVALUATION]}
    if P.PARTNER in names:
        evaluation[P.PARTNER] = content[P.PARTNER]
    return train, evaluation


def parse_candidate_reply(content: Any, candidates: Sequence[str], *, limits: ReplyLimits,
                          expected_n: int | None, signed: bool = True, sums: Sequence[str] = ()) -> dict[str, dict]:
    """Check a release-gate query reply (counts and sums per candidate, see
    :func:`check_candidate_counts`). Raises ReplyError."""
    keys = tuple(f"{c}.{k}" for c in candidates for k in ("correct", "n", *sums))
    check_shape(content, dict([(P.METRICS, ("metric", keys)), _partner_shape(signed)]))
    return check_candidate_counts(content[P.METRICS], candidates, limits=limits, expected_n=expected_n, sums=sums)
