"""HE helpers for tests: add frames the way the aggregator does (parse and check every
frame, then add chunk by chunk: :mod:`sealfl.server.aggregate`)."""

from __future__ import annotations

from collections.abc import Sequence

from sealfl.he.framed import PACKED, Layout
from sealfl.server.aggregate import sum_chunks, validate_frames


def sum_frames(codec, frames: Sequence[bytes], length: int, layout: Layout = PACKED) -> bytes:
    """The slot-wise sum of ``frames`` (``length`` values each) as one frame; raises the
    codec's CiphertextError for the first frame that does not parse or check."""
    from sealfl.he.errors import CiphertextError

    valid = validate_frames(codec, {str(i): f for i, f in enumerate(frames)}, length, layout)
    if valid.rejected:
        raise CiphertextError(next(iter(valid.rejected.values())))
    return sum_chunks(codec, valid, length, layout=layout)
