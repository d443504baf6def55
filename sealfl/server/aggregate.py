"""Ciphertext aggregation: validate each partner's frame, then add (optionally Ray-sharded).

Validation and summation need only the public CKKS context. A partner whose frame is
larger than its bound, does not parse, names another context, has the wrong length, is
not canonical, or could not be added (another scale or level: the trial addition of
:meth:`sealfl.common.he.CKKSCodec.load_chunks`) is dropped with a log line naming it;
the caller decides whether enough partners remain. Summation then cannot fail on a
validated frame.

Sharding: a model of C ciphertext chunks is summed as ``shards`` Ray tasks over chunk
ranges when Ray is running and C >= ``shard_min_chunks``; TenSEAL holds the GIL (its
issue #52) so parallelism must be across processes, which Ray tasks are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

from sealfl.common.errors import CiphertextError
from sealfl.common.he import CKKSCodec

log = logging.getLogger(__name__)


@dataclass
class Validated:
    """Result of :func:`validate_frames`.

    Attributes:
        chunks: partner name -> list of chunk byte strings (valid partners only).
        rejected: partner name -> reason (one line).
    """

    chunks: dict[str, list[bytes]]
    rejected: dict[str, str]


def validate_frames(codec: CKKSCodec, frames: Mapping[str, bytes], length: int) -> Validated:
    """Parse every partner's frame under ``codec`` (public context) and keep the good ones.

    Each chunk is deserialised by SEAL once here and checked (size bound, canonical
    bytes, fresh-ciphertext shape, trial addition; see :mod:`sealfl.common.he`), then
    kept as bytes. Returns :class:`Validated`.
    """
    good: dict[str, list[bytes]] = {}
    bad: dict[str, str] = {}
    for name, blob in frames.items():
        try:
            n, chunks = codec.split(blob, length)
            codec.load_chunks(chunks, n)
        except CiphertextError as exc:
            bad[name] = str(exc)
            log.warning("rejected the update of partner %s: %s", name, exc)
            continue
        good[name] = chunks
    return Validated(good, bad)


def _sum_range(codec: CKKSCodec, per_partner: Sequence[Sequence[bytes]], lo: int, hi: int, length: int) -> list[bytes]:
    slots = codec.params.slots
    out = []
    for i in range(lo, hi):
        acc = None
        want = min(slots, length - i * slots)
        for chunks in per_partner:
            (vec,) = codec.load_chunks([chunks[i]], want)
            if acc is None:
                acc = vec
            else:
                acc += vec
        out.append(acc.serialize())
    return out


def _ray_sum(public_ctx: bytes, params: dict, ctx_id: bytes, per_partner, lo, hi, length):
    from sealfl.common.he import CKKSCodec, CKKSParams

    codec = CKKSCodec.from_bytes(public_ctx, CKKSParams.from_dict(params), ctx_id)
    return _sum_range(codec, per_partner, lo, hi, length)


def sum_chunks(codec: CKKSCodec, valid: Validated, length: int, *, shards: int = 2, shard_min_chunks: int = 8) -> bytes:
    """Add the valid partners' ciphertexts slot-wise; returns one frame of ``length`` values.

    Uses ``shards`` Ray tasks when Ray is initialised and the model has at least
    ``shard_min_chunks`` chunks; otherwise sums in this process.
    Raises CiphertextError if there is nothing to add.
    """
    per_partner = list(valid.chunks.values())
    if not per_partner:
        raise CiphertextError("no valid ciphertexts to add")
    n_chunks = len(per_partner[0])
    use_ray = False
    if n_chunks >= shard_min_chunks and shards > 1:
        try:
            import ray

            use_ray = ray.is_initialized()
        except ImportError:
            use_ray = False
    if not use_ray:
        return codec.frame(length, _sum_range(codec, per_partner, 0, n_chunks, length))
    import ray

    remote = ray.remote(_ray_sum)
    pub = ray.put(codec.public_context_bytes())
    bounds = [(n_chunks * k // shards, n_chunks * (k + 1) // shards) for k in range(shards)]
    refs = [
        remote.remote(pub, codec.params.to_dict(), codec.context_id, [c[lo:hi] for c in per_partner], 0, hi - lo,
                      length - lo * codec.params.slots)
        for lo, hi in bounds if hi > lo
    ]
    out: list[bytes] = []
    for part in ray.get(refs):
        out.extend(part)
    log.info("summed %d chunks from %d partners in %d Ray tasks", n_chunks, len(per_partner), len(refs))
    return codec.frame(length, out)
