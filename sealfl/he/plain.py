"""Plaintext stand-in for the BFV codec -- BENCHMARK ONLY (issue 9's P2/P3/P6 baseline).

``make bench`` compares an encrypted campaign with "the same ClientApp with encryption
off". This module is that switch: :class:`PlainCodec` has the interface of
:class:`sealfl.he.bfv.BFVCodec` (frames, chunks, sums, "decrypt") but carries each
partner's share ``(n_i / N) w_i`` as raw float64 -- no clipping, no fixed point -- so
the baseline is ordinary floating-point FedAvg.

How it is kept out of normal campaigns (each is enough on its own; all hold):

1. **Opt-in in every process**: constructing a :class:`PlainCodec` or parsing
   :class:`PlainParams` raises :class:`~sealfl.he.errors.CiphertextError` unless the
   environment variable :data:`ENV` equals :data:`ENV_VALUE` in *that* process (the
   aggregator's worker and every partner). Nothing in sealfl sets it; only
   ``bench/round_bench.py`` does, for its own child processes.
2. **No entry point**: the CLI has no option for it; only a Python caller passing
   ``params=PlainParams()`` to ``create_consortium`` makes such a consortium, and its
   ``consortium.json`` then says ``"scheme": "PLAINTEXT-BENCHMARK-ONLY"``.
3. **Never released**: the release enclave's key holder refuses plaintext parameters
   (:class:`sealfl.enclave.release.keyholder.KeyHolder`), so ``release build`` refuses such a campaign.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sealfl.he.errors import CiphertextError, SecretKeyMissingError
from sealfl.he.framed import PACKED, Layout

SCHEME = "PLAINTEXT-BENCHMARK-ONLY"
ENV = "SEALFL_BENCH_PLAINTEXT"
ENV_VALUE = "updates-travel-in-clear"
MAGIC = b"SFPL"
_HEADER = struct.Struct("<4sB32sII")
_LEN = struct.Struct("<I")
_SECRET, _PUBLIC = b"SFPL-secret", b"SFPL-public"


def require_opt_in() -> None:
    """Raise CiphertextError unless this process opted in (see module docstring)."""
    if os.environ.get(ENV) != ENV_VALUE:
        raise CiphertextError(f"this consortium sends updates in plaintext ({SCHEME}); that is for benchmarks only "
                              f"and this process did not opt in ({ENV}); use a consortium made by "
                              "'sealfl consortium create'")


@dataclass(frozen=True)
class PlainParams:
    """Chunking of the plaintext baseline: ``values_per_chunk`` float64 values per chunk
    (the same count as a packed BFV chunk, so both paths chunk alike)."""

    values: int = 8192

    def values_per_chunk(self, layout: Layout = PACKED) -> int:
        return self.values

    @property
    def update_layout(self) -> Layout:
        """Model updates' layout role (:data:`PACKED`; the baseline keeps float64 values)."""
        return PACKED

    @property
    def max_chunk_bytes(self) -> int:
        return 8 * self.values

    def n_chunks(self, length: int, layout: Layout = PACKED) -> int:
        return max(1, -(-int(length) // self.values))

    def max_frame_bytes(self, length: int, layout: Layout = PACKED) -> int:
        return _HEADER.size + self.n_chunks(length) * (_LEN.size + self.max_chunk_bytes)

    def to_dict(self) -> dict:
        return {"scheme": SCHEME, "values": self.values}

    @classmethod
    def from_dict(cls, d: dict) -> "PlainParams":
        require_opt_in()
        if d.get("scheme") != SCHEME or not isinstance(d.get("values"), int) or d["values"] < 1:
            raise CiphertextError(f"not {SCHEME} parameters: {d!r}")
        return cls(d["values"])


class PlainCodec:
    """The BFV codec's interface over plaintext float64 (see module docstring)."""

    WEIGHTING = "share"

    def __init__(self, params: PlainParams, ctx_id: bytes, secret: bool):
        require_opt_in()
        self.params, self.context_id, self._secret = params, ctx_id, secret

    def sibling(self) -> "PlainCodec":
        """A new codec with the same parameters, id and key status (the HE codecs' interface)."""
        return type(self)(self.params, self.context_id, self._secret)

    @classmethod
    def generate(cls, params: PlainParams | None = None) -> "PlainCodec":
        return cls(params or PlainParams(), os.urandom(32), True)

    @classmethod
    def from_bytes(cls, context_bytes: bytes, params: PlainParams, ctx_id: bytes) -> "PlainCodec":
        if bytes(context_bytes) not in (_SECRET, _PUBLIC):
            raise CiphertextError("not a plaintext-benchmark context")
        return cls(params, ctx_id, bytes(context_bytes) == _SECRET)

    def public_context_bytes(self) -> bytes:
        return _PUBLIC

    def secret_context_bytes(self) -> bytes:
        return _SECRET

    @property
    def has_secret_key(self) -> bool:
        return self._secret

    def encrypt(self, vector: np.ndarray, layout: Layout = PACKED) -> bytes:
        v = np.asarray(vector, dtype=np.float64)
        if v.ndim != 1 or not np.all(np.isfinite(v)):
            raise CiphertextError("expected a finite 1-D vector")
        n = self.params.values
        chunks = [v[i:i + n].tobytes() for i in range(0, max(v.size, 1), n)] if v.size else [b""]
        return self.frame(v.size, chunks, layout)

    def frame(self, length: int, chunks: Sequence[bytes], layout: Layout = PACKED) -> bytes:
        parts = [_HEADER.pack(MAGIC, layout.id, self.context_id, length, len(chunks))]
        for c in chunks:
            parts += [_LEN.pack(len(c)), c]
        return b"".join(parts)

    def split(self, blob: bytes, expected_length: int | None = None,
              layout: Layout = PACKED) -> tuple[int, list[bytes]]:
        blob = bytes(blob)
        if len(blob) < _HEADER.size:
            raise CiphertextError("frame too short")
        magic, lid, cid, length, n = _HEADER.unpack_from(blob)
        if magic != MAGIC or lid != layout.id or cid != self.context_id:
            raise CiphertextError("not a plaintext-benchmark frame of this campaign and layout")
        if expected_length is not None and length != expected_length:
            raise CiphertextError(f"frame holds {length} values, expected {expected_length}")
        if n != self.params.n_chunks(length) or len(blob) > self.params.max_frame_bytes(length):
            raise CiphertextError("bad chunk count or frame size")
        off, chunks = _HEADER.size, []
        for _ in range(n):
            (size,) = _LEN.unpack_from(blob, off)
            off += _LEN.size
            chunks.append(blob[off:off + size])
            off += size
        if off != len(blob):
            raise CiphertextError("truncated or trailing bytes")
        return length, chunks

    def load_chunks(self, chunks: Sequence[bytes], length: int, layout: Layout = PACKED, first: int = 0) -> list:
        out = []
        for k, c in enumerate(chunks):
            want = min(self.params.values, length - (first + k) * self.params.values) if length else 0
            if len(c) != 8 * max(want, 0):
                raise CiphertextError(f"chunk {first + k} holds {len(c)} bytes, expected {8 * max(want, 0)}")
            v = np.frombuffer(c, dtype=np.float64)
            if not np.all(np.isfinite(v)):
                raise CiphertextError(f"chunk {first + k} holds non-finite values")
            out.append(v)
        return out

    def add_into(self, acc, v):
        return acc + v

    def chunk_bytes(self, v) -> bytes:
        return np.asarray(v, dtype=np.float64).tobytes()

    def sum_chunk(self, i: int, chunks: Sequence[bytes], length: int, layout: Layout = PACKED) -> bytes:
        acc = None
        for c in chunks:
            (v,) = self.load_chunks([c], length, layout, first=i)
            acc = v.copy() if acc is None else acc + v
        if acc is None:
            raise CiphertextError("nothing to add")
        return acc.tobytes()

    def decrypt(self, blob: bytes, expected_length: int | None = None, layout: Layout = PACKED) -> np.ndarray:
        if not self._secret:
            raise SecretKeyMissingError("the aggregator's plaintext-benchmark context does not 'decrypt'")
        length, chunks = self.split(blob, expected_length, layout)
        vecs = self.load_chunks(chunks, length, layout)
        return np.concatenate(vecs)[:length] if vecs else np.zeros(0)


def is_plain(params) -> bool:
    """True for the benchmark-only plaintext parameters."""
    return isinstance(params, PlainParams)
