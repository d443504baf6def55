"""What every sealfl HE codec shares: value layouts, the frame around a vector's
ciphertext chunks, and the size/header checks a frame from outside passes before any
chunk is parsed (issue 5's rules 1-2).

A codec (:mod:`sealfl.he.ckks`, :mod:`sealfl.he.bfv`) subclasses
:class:`FramedCodec` and provides ``MAGIC``, ``encrypt``, ``load_chunks`` (rules 3-4:
parse, canonical bytes, fresh-ciphertext shape, trial addition) and ``decrypt``; its
parameters subclass :class:`ChunkedParams`.

Frame layout (little-endian)::

    MAGIC (4 B) | u8 version=1 | u8 layout id | 32 B context id | u32 length | u32 n_chunks
    then n_chunks x ( u32 nbytes | nbytes of one serialised ciphertext chunk )
"""

from __future__ import annotations

import struct
from typing import ClassVar, Sequence

from sealfl.common.fields import Fields
from sealfl.he.errors import CiphertextError, SecretKeyMissingError
from sealfl.he.layouts import (  # noqa: F401  (re-exported: the frame's layouts live in sealfl.he.layouts)
    DEFAULT_PACK_BITS,
    DEFAULT_PACK_RANGE,
    LAYOUTS,
    PACK_PARTNERS,
    PACK_RANGES,
    PACK_WIDTHS,
    PACKED,
    WIDE,
    Layout,
    packed_layout,
)

__all__ = ["Layout", "PACKED", "WIDE", "LAYOUTS", "PACK_WIDTHS", "DEFAULT_PACK_BITS", "PACK_RANGES",
           "DEFAULT_PACK_RANGE", "PACK_PARTNERS", "packed_layout", "ChunkedParams", "FramedCodec", "HEADER", "LEN",
           "tenseal"]

VERSION = 1
HEADER = struct.Struct("<4sBB32sII")
LEN = struct.Struct("<I")


def tenseal():
    """The ``tenseal`` module, imported lazily (devices never install it), with SEAL's
    types (``Modulus``, ...) registered for the codecs' parameter checks."""
    import tenseal as ts
    import tenseal.sealapi  # noqa: F401

    return ts


class ChunkedParams:
    """Chunk arithmetic and the parameter dict shared by codec parameter classes.
    Subclasses have ``poly_modulus_degree``, ``coeff_mod_bit_sizes`` and the scheme's own
    parameter named :attr:`EXTRA`, set :attr:`SCHEME`, and define :attr:`slots` and
    :meth:`values_per_slot`."""

    SCHEME: ClassVar[str] = ""
    #: the scheme's third parameter (``plain_modulus_bits``, ``scale_bits``)
    EXTRA: ClassVar[str] = ""

    slots: int
    poly_modulus_degree: int
    coeff_mod_bit_sizes: tuple[int, ...]

    def resolve(self, layout: Layout) -> Layout:
        """The layout frames of ``layout``'s role really use under these parameters (default:
        ``layout`` itself; packed BFV maps :data:`PACKED` to its campaign's packing width)."""
        return layout

    @property
    def update_layout(self) -> Layout:
        """The layout of this campaign's model updates (:data:`PACKED` unless a subclass
        packs at another width)."""
        return self.resolve(PACKED)

    def to_dict(self) -> dict:
        """``{"scheme", "poly_modulus_degree", "coeff_mod_bit_sizes", EXTRA}`` (JSON)."""
        return {"scheme": self.SCHEME, "poly_modulus_degree": self.poly_modulus_degree,
                "coeff_mod_bit_sizes": list(self.coeff_mod_bit_sizes), self.EXTRA: getattr(self, self.EXTRA)}

    @classmethod
    def from_dict(cls, d: object):
        """Rebuild from :meth:`to_dict`'s object. SEAL checks the values themselves when a
        context is built; here only their JSON types and sane sizes.

        Raises:
            CiphertextError: ``d`` is not this scheme's parameter dict (names the field).
        """
        fields = Fields(f"{cls.SCHEME} parameters", CiphertextError)
        fields.object(d, "")
        fields.get(d, "scheme", "choice", choices=(cls.SCHEME,))
        n = fields.get(d, "poly_modulus_degree", "integer", lo=1024, hi=1 << 17)
        bits = fields.get(d, "coeff_mod_bit_sizes", "array", nonempty=True, max_len=32)
        primes = tuple(fields.integer(b, f"coeff_mod_bit_sizes[{i}]", lo=1, hi=61) for i, b in enumerate(bits))
        return cls(n, primes, fields.get(d, cls.EXTRA, "integer", lo=1, hi=128))

    @property
    def data_primes(self) -> int:
        """Primes of a fresh ciphertext's modulus: all but SEAL's special (key-switching) prime."""
        return len(self.coeff_mod_bit_sizes) - 1

    @property
    def max_chunk_bytes(self) -> int:
        """Upper bound (bytes) of one serialised fresh ciphertext: 2 polynomials x N x
        ``data_primes`` uint64 residues (SEAL manual, "Ciphertext"), plus zstd's worst case
        ``n/256`` (``ZSTD_COMPRESSBOUND``, zstd.h) and 4096 bytes for SEAL's header,
        metadata and TenSEAL's protobuf wrapper. CKKS defaults: 262,144 raw -> 267,264
        (fresh chunks measured ~235,000 bytes); BFV defaults: 131,072 raw -> 135,680
        (measured: a summed chunk ~68,900, a partner's seeded chunk ~34,100; TenSEAL 0.3.18)."""
        raw = 2 * self.poly_modulus_degree * self.data_primes * 8
        return raw + raw // 256 + 4096

    def values_per_slot(self, layout: Layout) -> int:
        """Real values one slot carries under ``layout``."""
        raise NotImplementedError

    def values_per_chunk(self, layout: Layout) -> int:
        """Real values one ciphertext carries under ``layout``."""
        return self.slots * self.values_per_slot(layout)

    def n_chunks(self, length: int, layout: Layout) -> int:
        """Ciphertexts a ``length``-value vector needs (at least 1)."""
        return max(1, -(-int(length) // self.values_per_chunk(layout)))

    def max_frame_bytes(self, length: int, layout: Layout = PACKED) -> int:
        """Upper bound (bytes) of a frame of ``length`` values under ``layout``."""
        return HEADER.size + self.n_chunks(length, layout) * (LEN.size + self.max_chunk_bytes)


class FramedCodec:
    """Framing, frame checks and chunk-wise sums over a subclass's ciphertexts.

    Subclasses set ``MAGIC`` (4 bytes) and ``SCHEME`` (a name for messages), have
    ``params`` (a :class:`ChunkedParams`) and ``context_id`` (32 bytes), and implement
    ``load_chunks(chunks, length, layout, first=0, *, checked=False)``.
    """

    MAGIC: bytes = b""
    SCHEME: str = ""
    #: whether the aggregator's context carries the public key (CKKS: yes; symmetric BFV: no key at all)
    SAVES_PUBLIC_KEY: bool = True
    params: ChunkedParams
    context_id: bytes
    _ctx: object

    @classmethod
    def _load_context(cls, context_bytes: bytes, params: ChunkedParams):
        """Parse a TenSEAL context and check its ring dimension and primes against
        ``params``; returns ``(context, SEAL encryption parameters)``. Raises CiphertextError."""
        ts = tenseal()
        try:
            ctx = ts.context_from(bytes(context_bytes))
            parms = ctx.seal_context().data.key_context_data().parms()
            primes = [m.value().bit_length() for m in parms.coeff_modulus()]
            n = parms.poly_modulus_degree()
        except Exception as exc:  # TenSEAL raises ValueError/RuntimeError/TypeError
            raise CiphertextError(f"not a TenSEAL {cls.SCHEME} context: {exc}") from exc
        if n != params.poly_modulus_degree or tuple(primes) != tuple(params.coeff_mod_bit_sizes):
            raise CiphertextError(f"context parameters N={n}, primes {primes} differ from the campaign's "
                                  f"{params.to_dict()}")
        return ctx, parms

    def public_context_bytes(self) -> bytes:
        """The aggregator's context: no secret, relinearisation or Galois keys (and no public
        key unless :attr:`SAVES_PUBLIC_KEY`)."""
        return self._ctx.serialize(save_public_key=self.SAVES_PUBLIC_KEY, save_secret_key=False,
                                   save_galois_keys=False, save_relin_keys=False)

    def secret_context_bytes(self) -> bytes:
        """The context including the secret key. Handle as a secret. Raises
        SecretKeyMissingError for a context without it."""
        if not self.has_secret_key:
            raise SecretKeyMissingError(f"this {self.SCHEME} context holds no secret key")
        return self._ctx.serialize(save_public_key=self.SAVES_PUBLIC_KEY, save_secret_key=True,
                                   save_galois_keys=False, save_relin_keys=False)

    @property
    def has_secret_key(self) -> bool:
        """True if the loaded context holds the secret key (asks TenSEAL)."""
        return bool(self._ctx.is_private())

    def frame(self, length: int, chunks: Sequence[bytes], layout: Layout = PACKED) -> bytes:
        """Pack serialised chunks of a ``length``-value vector into one frame (bytes).
        Raises CiphertextError for a length or chunk count outside the header's u32 fields."""
        if not (0 <= int(length) < 1 << 32 and len(chunks) < 1 << 32):
            raise CiphertextError(f"cannot frame {length!r} values in {len(chunks)} chunks (u32 header fields)")
        layout = self.params.resolve(layout)
        parts = [HEADER.pack(self.MAGIC, VERSION, layout.id, self.context_id, length, len(chunks))]
        for c in chunks:
            parts += [LEN.pack(len(c)), c]
        return b"".join(parts)

    def slots_in_chunk(self, i: int, length: int, layout: Layout) -> int:
        """Slots chunk ``i`` of a ``length``-value vector holds (at least 1)."""
        used = -(-max(int(length), 0) // self.params.values_per_slot(layout))
        return max(1, min(self.params.slots, used - i * self.params.slots)) if used else 1

    def split(self, blob: bytes, expected_length: int | None = None,
              layout: Layout = PACKED) -> tuple[int, list[bytes]]:
        """Check a frame's size and header and return ``(length, chunk bytes)``.

        Raises CiphertextError: over the size bound (checked before anything is parsed),
        bad magic/version, another layout or context, another length, a wrong chunk
        count, a chunk over its bound, truncated or trailing bytes.
        """
        blob = bytes(blob)
        p = self.params
        layout = p.resolve(layout)
        if expected_length is not None and len(blob) > p.max_frame_bytes(expected_length, layout):
            raise CiphertextError(f"ciphertext frame of {len(blob)} bytes exceeds the bound of "
                                  f"{p.max_frame_bytes(expected_length, layout)} bytes for {expected_length} values")
        if len(blob) < HEADER.size:
            raise CiphertextError(f"ciphertext frame too short ({len(blob)} bytes)")
        magic, version, lid, cid, length, n = HEADER.unpack_from(blob)
        if magic != self.MAGIC or version != VERSION:
            raise CiphertextError(f"not a sealfl {self.SCHEME} frame (bad magic or version)")
        if lid != layout.id:
            raise CiphertextError(f"frame uses value layout {lid}, expected {layout.id}")
        if cid != self.context_id:
            raise CiphertextError(f"ciphertext was made under context {cid.hex()[:16]}…, this campaign's is "
                                  f"{self.context_id.hex()[:16]}…")
        if expected_length is not None and length != expected_length:
            raise CiphertextError(f"ciphertext holds {length} values, expected {expected_length}")
        if n != p.n_chunks(length, layout):
            raise CiphertextError(f"{n} ciphertext chunks for {length} values, expected {p.n_chunks(length, layout)}")
        if len(blob) > p.max_frame_bytes(length, layout):
            raise CiphertextError(f"ciphertext frame of {len(blob)} bytes exceeds the bound of "
                                  f"{p.max_frame_bytes(length, layout)} bytes for {length} values")
        off, chunks = HEADER.size, []
        for i in range(n):
            if off + LEN.size > len(blob):
                raise CiphertextError("ciphertext frame truncated")
            (size,) = LEN.unpack_from(blob, off)
            off += LEN.size
            if size > p.max_chunk_bytes:
                raise CiphertextError(f"chunk {i} is {size} bytes, more than a ciphertext of these parameters can be "
                                      f"({p.max_chunk_bytes})")
            if off + size > len(blob):
                raise CiphertextError("ciphertext frame truncated")
            chunks.append(blob[off:off + size])
            off += size
        if off != len(blob):
            raise CiphertextError(f"{len(blob) - off} trailing bytes after the ciphertext frame")
        return length, chunks

    def load_chunks(self, chunks: Sequence[bytes], length: int, layout: Layout = PACKED, first: int = 0, *,
                    checked: bool = False) -> list:
        """Parse and check chunks ``first, first+1, ...`` of a ``length``-value frame
        (issue 5's rules 3-4): size, the codec's byte checks (:meth:`_check_bytes`), parse
        under this context, slot count, fresh-ciphertext shape and trial addition
        (:meth:`_check_parsed`). Returns the parsed vectors. Raises CiphertextError naming
        the chunk and the failed check.

        ``checked=True`` only for bytes that already passed this method in this process
        (the aggregator's sum): parse and slot count only. Raises CiphertextError also for
        a negative ``length`` or ``first``, or chunks beyond the ones a ``length``-value
        frame has."""
        if int(length) < 0 or int(first) < 0 or first + len(chunks) > self.params.n_chunks(length, layout):
            raise CiphertextError(f"chunks {first}..{first + len(chunks) - 1} do not belong to a frame of {length} "
                                  f"values ({self.params.n_chunks(max(int(length), 0), layout)} chunks)")
        out = []
        for k, c in enumerate(chunks):
            i = first + k
            c = bytes(c)
            if len(c) > self.params.max_chunk_bytes:
                raise CiphertextError(f"chunk {i} is {len(c)} bytes, more than a ciphertext of these parameters can "
                                      f"be ({self.params.max_chunk_bytes})")
            want = self.slots_in_chunk(i, length, layout)
            if not checked:
                self._check_bytes(i, c, want)
            try:
                vec = self._parse_chunk(c)
            except Exception as exc:  # TenSEAL raises ValueError/RuntimeError
                raise CiphertextError(f"chunk {i} is not a ciphertext of this {self.SCHEME} context: {exc}") from exc
            self._check_slots(i, vec, want)
            if not checked:
                self._check_parsed(i, vec, c)
            out.append(vec)
        return out

    def _check_bytes(self, i: int, raw: bytes, slots: int) -> None:
        """Checks on chunk ``i``'s bytes before they are parsed (default: none)."""

    def _check_slots(self, i: int, vec, want: int) -> None:
        """Raise CiphertextError unless parsed chunk ``i`` holds ``want`` values (TenSEAL
        vectors carry their size; raw SEAL ciphertexts override this)."""
        if vec.size() != want:
            raise CiphertextError(f"chunk {i} holds {vec.size()} slots, expected {want}")

    def _parse_chunk(self, raw: bytes):  # pragma: no cover - abstract
        """The TenSEAL vector of one chunk's bytes under this context."""
        raise NotImplementedError

    def _check_parsed(self, i: int, vec, raw: bytes) -> None:  # pragma: no cover - abstract
        """Raise CiphertextError unless parsed chunk ``i`` can be added to this campaign's ciphertexts."""
        raise NotImplementedError

    def parse(self, blob: bytes, expected_length: int | None = None, layout: Layout = PACKED) -> list:
        """:meth:`split` then :meth:`load_chunks`; returns the parsed chunk vectors."""
        length, chunks = self.split(blob, expected_length, layout)
        return self.load_chunks(chunks, length, layout)

    def add_into(self, acc, vec):
        """``acc + vec`` for two loaded chunks (in place where the library allows); returns
        the sum. Raises CiphertextError if they cannot be added."""
        try:
            return acc.add_(vec)
        except Exception as exc:  # SEAL: ValueError "parameter mismatch", ...
            raise CiphertextError(f"cannot add the ciphertexts: {exc}") from exc

    def chunk_bytes(self, vec) -> bytes:
        """A loaded chunk (e.g. a sum) serialised for a frame."""
        return vec.serialize()

    def sum_chunk(self, i: int, chunks: Sequence[bytes], length: int, layout: Layout = PACKED) -> bytes:
        """Add chunk ``i`` of several partners' frames (``chunks``, one per partner, each
        already validated by :meth:`load_chunks` -- only parsed again here) without
        decrypting; returns the serialised sum. Parses one chunk at a time into a running
        accumulator. Raises CiphertextError."""
        acc = None
        for c in chunks:
            (v,) = self.load_chunks([c], length, layout, first=i, checked=True)
            acc = v if acc is None else self.add_into(acc, v)
        if acc is None:
            raise CiphertextError("nothing to add")
        return self.chunk_bytes(acc)
