"""Ciphertext aggregation: validate each partner's frame, then add.

Validation and summation need only the aggregator's context, which holds no key at all
(:mod:`sealfl.he.ckks`, :mod:`sealfl.he.bfv`). A partner whose frame is larger than its bound, does not
parse, names another context or value layout, has the wrong length, is not canonical,
or could not be added (another level, NTT form or scale) is dropped with a log line
naming it; the caller decides whether enough partners remain. Summation then cannot
fail on a validated frame.

A round's model update is summed in the same pass that validates it
(:class:`RunningSum`): the chunks a partner's frame was parsed into for its checks are
added at once into one accumulator per chunk index, so each chunk is parsed once (with
seeded BFV ciphertexts, parsing expands the seed -- half the cost of a chunk's sum).
The accumulator is one frame's worth of parsed ciphertexts: flat in the number of
partners.

Memory (:func:`sum_chunks`, used for the statistics sum): the sum runs chunk index by chunk index, parsing one partner's chunk at a time
into a running accumulator, so besides the received frames the aggregator holds one
parsed ciphertext per partner-chunk only while it is added (flat in the number of
partners). TenSEAL holds the GIL (its issue #52); BFV addition here runs at ~4 M
parameters per second on one core (bench/codec_bench.py). Rounds whose updates are large
or many are summed by chunk range in Ray tasks instead (:mod:`sealfl.server.sharded`,
chosen by :func:`sealfl.server.sharded.shard_count`); on one 2-core box that is no faster
than in-process (bench/scale.py), it pays on a cluster with more cores.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from sealfl.he.codecs import Codec
from sealfl.he.errors import CiphertextError
from sealfl.he.framed import PACKED, Layout

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


def validate_frames(codec: Codec, frames: Mapping[str, bytes], length: int, layout: Layout = PACKED) -> Validated:
    """Parse every partner's frame (``layout``, ``length`` values) and keep the good ones.

    Each chunk is parsed once here and checked (size bound, canonical bytes, fresh
    ciphertext shape, trial addition; see the codec module), then kept as bytes.
    Returns :class:`Validated`.
    """
    good: dict[str, list[bytes]] = {}
    bad: dict[str, str] = {}
    for name, blob in frames.items():
        try:
            n, chunks = codec.split(blob, length, layout)
            codec.load_chunks(chunks, n, layout)
        except CiphertextError as exc:
            bad[name] = str(exc)
            log.warning("rejected the update of partner %s: %s", name, exc)
            continue
        good[name] = chunks
    return Validated(good, bad)


def sum_chunks(codec: Codec, valid: Validated, length: int, *, layout: Layout = PACKED) -> bytes:
    """Add the valid partners' ciphertexts slot-wise; returns one frame of ``length``
    values in ``layout``. Raises CiphertextError if there is nothing to add."""
    per_partner = list(valid.chunks.values())
    if not per_partner:
        raise CiphertextError("no valid ciphertexts to add")
    out = [codec.sum_chunk(i, [chunks[i] for chunks in per_partner], length, layout)
           for i in range(len(per_partner[0]))]
    return codec.frame(length, out, layout)


class RunningSum:
    """The slot-wise sum of the frames of partners accepted so far.

    :meth:`add` takes the parsed chunks of one *fully checked* frame (what
    ``codec.load_chunks`` returned for it); call it only once nothing else can refuse that
    reply (see :func:`sealfl.server.validation.parse_train_reply`). Memory: one parsed
    chunk per chunk index, whatever the number of partners.

    Attributes:
        partners: how many frames were added.
    """

    def __init__(self, codec: Codec, length: int, layout: Layout = PACKED):
        self.codec, self.length, self.layout = codec, int(length), layout
        self._acc: list | None = None
        self.partners = 0

    def add(self, parsed: list) -> None:
        """Add one checked frame's parsed chunks. Raises CiphertextError if their count
        differs from earlier frames' or SEAL refuses an addition (a checked chunk cannot)."""
        if self._acc is None:
            self._acc = list(parsed)
        elif len(parsed) != len(self._acc):
            raise CiphertextError(f"{len(parsed)} chunks, earlier frames had {len(self._acc)}")
        else:
            self._acc = [self.codec.add_into(a, v) for a, v in zip(self._acc, parsed)]
        self.partners += 1

    def frame(self) -> bytes:
        """The sum as one frame of ``length`` values. Raises CiphertextError if nothing was added."""
        if self._acc is None:
            raise CiphertextError("no valid ciphertexts to add")
        return self.codec.frame(self.length, [self.codec.chunk_bytes(a) for a in self._acc], self.layout)
