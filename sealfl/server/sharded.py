"""Sharded ciphertext sums: a round's update sum split by chunk range into Ray tasks.

When a round's updates are large or many (:func:`shard_count`), the aggregator does not
parse and add every partner's frame in its own process (:class:`~sealfl.server.aggregate.RunningSum`).
It keeps each reply's frame *split* (header, size and chunk-count checks passed, see
:func:`sealfl.server.validation.parse_train_reply` with ``defer_ciphertext=True``) and hands
chunk ranges ``[first, last)`` to Ray tasks (:func:`check_and_sum_range`, run by
:func:`sharded_sum`). Each task checks every partner's chunks of its range exactly as the
in-process path does (:meth:`~sealfl.he.framed.FramedCodec.load_chunks`: canonical bytes,
fresh-ciphertext shape, trial addition) and adds the ones that pass.

**A refused reply is refused whole.** A partner whose chunk 7 fails in one task may have
passed chunks 0-6 in another, whose sum then holds it. After the first pass the driver
takes the union of refusals; every range whose sum included a partner refused elsewhere
is summed again (checked bytes: parse only) over the partners accepted everywhere. The
result is the frame the single-process sum gives for the same accepted partners -- the
same bytes: BFV and CKKS addition is exact modular addition of RNS polynomials, so the
order of additions does not change a coefficient (tests/server/test_sharded.py).

**Resources.** Tasks ask for no CPU (``num_cpus=0``) and are spread over the cluster's
nodes (``scheduling_strategy="SPREAD"``): in a simulated campaign every CPU is held by an
idle partner actor while the aggregator sums, and a task asking for a CPU would wait for
ever. Ray retries a task whose node dies (``max_retries``): a sum task is a pure
function of its arguments. Each task rebuilds the aggregator's public codec (no key at
all) from the context bytes, cached per worker process by context id.

**Bytes moved once.** On Ray each range's chunks of every partner are packed into one
contiguous buffer (:class:`RangeChunks`: a uint8 array and an offsets table) and put into
the object store once (``ray.put``), by the driver; the task gets a reference and reads a
zero-copy view of it on its node (a node that does not hold it pulls exactly its range,
nothing more). A second pass over a range (refusals) reuses the stored buffer. Before,
every shard's arguments were a pickled ``{partner: [chunk bytes]}`` dict: copied into the
pickle, into the object store, and out again in the task.

Sizes: BFV at LoRA size, 460,800 values = 57 chunks of ~34 KB per partner (~1.9 MB); a
range of 64 partners is ``64 * chunks in range * 34 KB``.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from sealfl.he import codecs
from sealfl.he.codecs import Codec
from sealfl.he.errors import CiphertextError
from sealfl.he.framed import PACKED, Layout

log = logging.getLogger(__name__)

__all__ = ["SHARD_MIN_CHUNKS", "RangeSum", "RangeChunks", "chunk_ranges", "shard_count", "check_and_sum_range", "merge_ranges",
           "sharded_sum", "ray_cpus"]

#: shard a round's sum once it holds at least this many partner-chunks (partners x chunks per
#: frame); below it, task start-up and argument transfer cost more than the sum
SHARD_MIN_CHUNKS = 256
#: retries of a sum task whose worker or node died (Ray's ``max_retries``)
TASK_RETRIES = 3


def chunk_ranges(n_chunks: int, shards: int) -> list[tuple[int, int]]:
    """Split ``n_chunks`` chunk indices into at most ``shards`` contiguous ranges
    ``[first, last)`` of sizes differing by at most one, in order, none empty. Pure.
    Raises ValueError for ``n_chunks < 1`` or ``shards < 1``."""
    if n_chunks < 1 or shards < 1:
        raise ValueError(f"cannot split {n_chunks} chunks into {shards} shards")
    k = min(shards, n_chunks)
    base, extra = divmod(n_chunks, k)
    out, first = [], 0
    for i in range(k):
        last = first + base + (1 if i < extra else 0)
        out.append((first, last))
        first = last
    return out


def shard_count(setting: int, n_partners: int, n_chunks: int, cpus: int, min_chunks: int = SHARD_MIN_CHUNKS) -> int:
    """How many shards a round's sum gets. ``setting``: 1 = never shard, N > 1 = N shards
    (capped at ``n_chunks``), 0 = automatic: one shard per Ray CPU (``cpus``, 0 when Ray is
    not running here) once ``n_partners * n_chunks >= min_chunks`` and there are at least
    2 CPUs, else 1. Pure. Raises ValueError for a negative setting."""
    if setting < 0:
        raise ValueError(f"sum shards must be >= 0 (0: automatic), got {setting}")
    if setting >= 1:
        return max(1, min(int(setting), n_chunks))
    if cpus < 2 or n_chunks < 2 or n_partners * n_chunks < min_chunks:
        return 1
    return min(int(cpus), n_chunks)


@dataclass
class RangeSum:
    """What one shard returns: the serialised sum of chunks ``first..last-1`` over
    ``included`` partners (in the order given), and ``refused``: partner -> reason for the
    partners whose chunks of this range failed a check (not added)."""

    first: int
    last: int
    sums: list[bytes]
    included: list[str]
    refused: dict[str, str] = field(default_factory=dict)


@dataclass
class RangeChunks:
    """Chunks ``first..last-1`` of several partners' frames in one contiguous buffer.

    Partner ``names[j]``'s chunk ``first + i`` is ``data[offsets[j, i]:offsets[j, i + 1]]``.
    Made by :meth:`of` without copying anything; the buffer is packed on first use
    (:meth:`materialize`: one copy of those bytes), so the Ray runner packs, stores and
    starts one range while the next is still unpacked. ``select``: the partners a task sums
    (None: all of ``names``; a second pass leaves the refused ones out without copying the
    buffer). ``ref``: the buffer's Ray object reference once it is stored (:func:`_ray_map`);
    a task's copy carries ``ref`` and neither ``data`` nor ``source``.

    Attributes:
        first, last: the chunk range ``[first, last)``.
        names: partner names, in the order their chunks are packed.
        data: uint8 array (1-D) of every partner's chunks of the range, or None (not packed
            yet, or dropped once stored).
        offsets: int64 array ``(len(names), last - first + 1)`` of byte offsets into ``data``
            (None until packed).
    """

    first: int
    last: int
    names: tuple[str, ...]
    data: Any = None
    offsets: np.ndarray | None = None
    select: tuple[str, ...] | None = None
    ref: Any = field(default=None, repr=False, compare=False)
    source: Mapping[str, Sequence[bytes]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, frames: Mapping[str, Sequence[bytes]], first: int, last: int) -> "RangeChunks":
        """Chunks ``first..last-1`` of every partner's chunk list (``frames``, in its order), not packed yet."""
        return cls(first, last, tuple(frames), source=frames)

    @classmethod
    def pack(cls, frames: Mapping[str, Sequence[bytes]], first: int, last: int) -> "RangeChunks":
        """:meth:`of`, packed at once."""
        return cls.of(frames, first, last).materialize()

    def materialize(self) -> "RangeChunks":
        """Pack the buffer and the offsets from :attr:`source` if that is not done yet; returns self."""
        if self.offsets is None:
            k, frames = self.last - self.first, self.source
            pieces = [c for p in self.names for c in frames[p][self.first:self.last]]
            sizes = np.array([len(c) for c in pieces], dtype=np.int64).reshape(len(self.names), k)
            starts = np.concatenate([[0], np.cumsum(sizes)])[:-1].reshape(len(self.names), k)
            self.offsets = np.concatenate([starts, starts[:, :1] + sizes.sum(axis=1, keepdims=True)], axis=1)
            self.data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
            self.source = None
        return self

    def only(self, who: Sequence[str]) -> "RangeChunks":
        """The same buffer, summing only ``who`` (in this block's order)."""
        keep = set(who)
        return replace(self.materialize() if self.ref is None else self,
                       select=tuple(p for p in self.names if p in keep))

    def selected(self) -> tuple[str, ...]:
        """The partners a task sums."""
        return self.names if self.select is None else self.select

    def __contains__(self, name: object) -> bool:
        return name in self.selected()

    def parts(self, data=None) -> dict[str, list[memoryview]]:
        """``{partner: views of its chunks of the range}`` for the selected partners, read from
        ``data`` (default: :attr:`data`, packed if need be); no copy is made here."""
        if data is None:
            data = self.materialize().data
        buf = memoryview(data).cast("B")
        row = {p: j for j, p in enumerate(self.names)}
        out = {}
        for p in self.selected():
            o = self.offsets[row[p]]
            out[p] = [buf[int(o[i]):int(o[i + 1])] for i in range(self.last - self.first)]
        return out


def check_and_sum_range(codec: Codec, length: int, first: int, parts: Mapping[str, Sequence[bytes]], *,
                        layout: Layout = PACKED, checked: bool = False) -> RangeSum:
    """Check and add chunks ``first..first+k-1`` of every partner's frame (``parts``:
    partner -> that range's chunk bytes, all of the same count ``k``).

    Each partner's chunks are parsed and checked with ``codec.load_chunks`` (``checked``:
    parse only, for bytes that passed already); a partner failing any check of the range is
    left out of the sum and named in ``refused``. Returns :class:`RangeSum` (``sums`` is
    empty when nobody passed). Raises CiphertextError if the partners' chunk counts differ
    or SEAL refuses to add checked chunks."""
    counts = {len(c) for c in parts.values()}
    if len(counts) > 1:
        raise CiphertextError(f"partners' chunk ranges differ in length: {sorted(counts)}")
    k = counts.pop() if counts else 0
    acc: list | None = None
    included: list[str] = []
    refused: dict[str, str] = {}
    for name, chunks in parts.items():
        try:
            vecs = codec.load_chunks(list(chunks), length, layout, first=first, checked=checked)
        except CiphertextError as exc:
            refused[name] = str(exc)
            continue
        acc = vecs if acc is None else [codec.add_into(a, v) for a, v in zip(acc, vecs)]
        included.append(name)
    sums = [codec.chunk_bytes(a) for a in acc] if acc is not None else []
    return RangeSum(first, first + k, sums, included, refused)


def merge_ranges(results: Sequence[RangeSum]) -> tuple[set[str], dict[str, str], list[int]]:
    """After a first pass: ``(accepted, refused, redo)`` -- the partners every range
    included, partner -> first reason a range gave for refusing it, and the indices of
    ``results`` whose sum holds a partner refused elsewhere (sum them again over
    ``accepted``). Pure."""
    refused: dict[str, str] = {}
    for r in results:
        for name, why in r.refused.items():
            refused.setdefault(name, why)
    everyone = set().union(*(set(r.included) | set(r.refused) for r in results)) if results else set()
    accepted = everyone - set(refused)
    redo = [i for i, r in enumerate(results) if set(r.included) - accepted]
    return accepted, refused, redo


# -- Ray -----------------------------------------------------------------------------------------

_CODECS: dict[tuple, Codec] = {}


def _codec(context: bytes, params: dict, ctx_id: bytes) -> Codec:
    key = (ctx_id, hashlib.sha256(context).digest())
    if key not in _CODECS:
        _CODECS.clear()  # one campaign per worker at a time
        _CODECS[key] = codecs.from_bytes(context, codecs.params_from_dict(params), ctx_id)
    return _CODECS[key]


def _range_task(context: bytes, params: dict, ctx_id: bytes, length: int, first: int,
                parts: "dict | RangeChunks", layout_id: int, checked: bool) -> RangeSum:
    from sealfl.he.framed import LAYOUTS

    codec = _codec(context, params, ctx_id)
    if codec.has_secret_key:  # the aggregator's context never holds one; refuse to sum with one
        raise CiphertextError("a sum task was given a HE context holding a secret key")
    if isinstance(parts, RangeChunks):
        data = None
        if parts.data is None and parts.ref is not None:  # a Ray task's copy: a zero-copy view of the stored buffer
            import ray

            data = ray.get(parts.ref)
        parts = parts.parts(data)
    return check_and_sum_range(codec, length, first, parts, layout=LAYOUTS[layout_id], checked=checked)


def ray_cpus() -> int:
    """CPUs of the Ray cluster this process is connected to (0 if Ray is not running here)."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray ships with flwr[simulation]
        return 0
    if not ray.is_initialized():
        return 0
    return int(ray.cluster_resources().get("CPU", 0))


def _ray_map(calls: list[tuple]) -> list[RangeSum]:
    """Run the shards as Ray tasks on the cluster this process is connected to; without
    a running Ray (a ServerApp outside simulation that was not attached), in this process,
    one after the other (the same function, never a Ray started on the side)."""
    import ray

    if not ray.is_initialized():
        log.warning("sharded sum requested but Ray is not running in this process: summing the %d ranges here",
                    len(calls))
        return [_range_task(*c) for c in calls]
    task = ray.remote(_range_task).options(num_cpus=0, scheduling_strategy="SPREAD", max_retries=TASK_RETRIES)
    shared = {}
    refs = []
    for args in calls:
        context, block = args[0], args[5]
        if id(context) not in shared:
            shared[id(context)] = ray.put(context)
        if isinstance(block, RangeChunks):  # its buffer goes into the object store once (module docstring)
            if block.ref is None:
                block.ref = ray.put(block.materialize().data)
                block.data = None  # the store holds it now; a second pass reads it from there
            block = replace(block, data=None, source=None)
        refs.append(task.remote(shared[id(context)], *args[1:5], block, *args[6:]))
    return ray.get(refs)


def sharded_sum(codec: Codec, frames: Mapping[str, Sequence[bytes]], length: int, shards: int, *,
                layout: Layout = PACKED, run: Callable[[list[tuple]], list[RangeSum]] | None = None
                ) -> tuple[bytes | None, list[str], dict[str, str]]:
    """Check and add every partner's split frame (``frames``: partner -> all its chunk
    bytes, from ``codec.split``) in ``shards`` chunk-range tasks.

    Returns ``(frame, accepted, refused)``: the summed frame of ``length`` values over the
    ``accepted`` partners (in ``frames``' order; ``None`` if none passed) and partner ->
    reason for the refused ones -- a partner refused in any range counts in no range.
    ``run`` maps a list of task argument tuples to their :class:`RangeSum` results
    (default: Ray tasks, see module docstring). Raises CiphertextError (chunk counts
    differ) and whatever ``run`` raises (Ray: a task failing after its retries)."""
    names = list(frames)
    if not names:
        return None, [], {}
    n_chunks = {len(c) for c in frames.values()}
    if len(n_chunks) != 1:
        raise CiphertextError(f"partners' frames have different chunk counts: {sorted(n_chunks)}")
    ranges = chunk_ranges(n_chunks.pop(), shards)
    run = run or _ray_map
    context, params, ctx_id = codec.public_context_bytes(), codec.params.to_dict(), codec.context_id

    blocks = [RangeChunks.of(frames, a, b) for a, b in ranges]  # each packed (one copy) when first used

    def calls(who: Sequence[str], idx: Sequence[int], checked: bool) -> list[tuple]:
        return [(context, params, ctx_id, length, ranges[i][0], blocks[i] if len(who) == len(names)
                 else blocks[i].only(who), layout.id, checked) for i in idx]

    results = list(run(calls(names, range(len(ranges)), False)))
    accepted, refused, redo = merge_ranges(results)
    order = [p for p in names if p in accepted]
    if redo and order:
        log.info("sharded sum: %d partner(s) refused in some range; summing %d range(s) again without them",
                 len(refused), len(redo))
        for i, r in zip(redo, run(calls(order, redo, True))):
            results[i] = r
    if not order:
        return None, [], refused
    chunks = [c for r in results for c in r.sums]
    return codec.frame(length, chunks, layout), order, refused
