"""CKKS codec for encrypted weighted FedAvg (TenSEAL / Microsoft SEAL).

A model update is a 1-D float64 vector. It is split into chunks of ``slots`` values
(``poly_modulus_degree / 2``, one CKKS ciphertext each), encrypted, and framed into one
byte string so Flower can carry it as a uint8 ``Array`` (Flower chunks only ``Array``
payloads, in 5 MiB chunks, as of flwr 1.42).

Frame layout (all integers little-endian)::

    b"SFCK" | u8 version=1 | 32 B context id | u32 vector length | u32 n_chunks
    then n_chunks x ( u32 nbytes | nbytes of TenSEAL CKKSVector serialisation )

The context id is SHA-256 of the campaign's public CKKS context bytes: it lets the
aggregator reject a ciphertext made for another campaign before it touches SEAL.
It is a label, not a proof (anyone holding the public context can write it); SEAL's own
``parms_id`` check on load rejects ciphertexts of other parameters.

Parameters default to NVFlare's HE defaults (N=8192, coeff moduli [60, 40, 40],
scale 2^40): 4096 slots, ~6e-9 absolute error on values of magnitude 200 measured here;
the max error of weighted FedAvg is far below 1e-6 (see tests/test_he.py).
Weighted FedAvg needs only ciphertext addition, so no relinearisation or Galois keys are
generated or shipped (Galois keys alone make a public context ~35 MB).

What a frame from outside must satisfy before anything adds it (:meth:`CKKSCodec.split`
then :meth:`CKKSCodec.load_chunks`), in this order:

1. **size, before parsing**: the whole frame at most :meth:`CKKSParams.max_frame_bytes`
   and each chunk at most :attr:`CKKSParams.max_chunk_bytes` (see there for the bound);
2. header: magic, version, this campaign's context id, the expected vector length and
   the chunk count that length needs;
3. per chunk: SEAL/TenSEAL parse it under this context; it holds the expected number of
   values; it is **canonical** (re-serialising the parsed vector gives back exactly the
   bytes received: TenSEAL's protobuf parser skips unknown fields, so a valid ciphertext
   followed by an unknown 64 MiB field parses -- measured with TenSEAL 0.3.18); it is a
   fresh-encryption-shaped ciphertext: 2 polynomials, NTT form, not transparent, at the
   context's first data level (``parms_id`` and prime count) and at scale exactly
   ``2**scale_bits``;
4. a **trial addition** to a fresh encryption of zeros made with the (public) context:
   SEAL's ``add`` checks exactly what summation needs (``parms_id``, NTT form, scale), so
   a chunk that passes cannot make a later sum raise (e.g. ``ValueError: scale mismatch``
   for a ciphertext encoded at scale 2^30 under the campaign's own context).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import CiphertextError, SecretKeyMissingError

MAGIC = b"SFCK"
VERSION = 1
_HEADER = struct.Struct("<4sB32sII")
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class CKKSParams:
    """CKKS parameters.

    Attributes:
        poly_modulus_degree: ring dimension N (power of two); slots per ciphertext = N/2.
        coeff_mod_bit_sizes: bit sizes of the coefficient modulus primes (SEAL).
        scale_bits: log2 of the encoding scale (``global_scale = 2**scale_bits``).
    Source: NVFlare HE defaults; SEAL manual, "CKKS basics" example.
    """

    poly_modulus_degree: int = 8192
    coeff_mod_bit_sizes: tuple[int, ...] = field(default=(60, 40, 40))
    scale_bits: int = 40

    @property
    def slots(self) -> int:
        """Number of float values one ciphertext holds (N / 2)."""
        return self.poly_modulus_degree // 2

    @property
    def data_primes(self) -> int:
        """Primes of a fresh ciphertext's modulus: all but SEAL's special (key) prime."""
        return len(self.coeff_mod_bit_sizes) - 1

    @property
    def max_chunk_bytes(self) -> int:
        """Upper bound (bytes) of one serialised chunk (a TenSEAL CKKSVector of one fresh
        ciphertext) that :meth:`CKKSCodec.load_chunks` can accept.

        A fresh ciphertext is 2 polynomials x N coefficients x ``data_primes`` residues x 8
        bytes (SEAL stores each residue as a uint64; SEAL manual, "Ciphertext"). SEAL
        compresses that with zstd, whose worst case adds ``n/256`` bytes
        (``ZSTD_COMPRESSBOUND``, zstd.h), plus SEAL's 16-byte header, the ciphertext
        metadata and TenSEAL's protobuf wrapper: 4096 bytes cover those with room to spare.
        N=8192, [60, 40, 40]: 262,144 raw -> bound 267,264; fresh chunks measured here are
        ~235,000 bytes (TenSEAL 0.3.18).
        """
        raw = 2 * self.poly_modulus_degree * self.data_primes * 8
        return raw + raw // 256 + 4096

    def max_frame_bytes(self, length: int) -> int:
        """Upper bound (bytes) of a frame holding ``length`` values: header + one u32 size
        and at most :attr:`max_chunk_bytes` per chunk."""
        n_chunks = max(1, -(-int(length) // self.slots))
        return _HEADER.size + n_chunks * (_LEN.size + self.max_chunk_bytes)

    def to_dict(self) -> dict:
        return {
            "scheme": "CKKS",
            "poly_modulus_degree": self.poly_modulus_degree,
            "coeff_mod_bit_sizes": list(self.coeff_mod_bit_sizes),
            "scale_bits": self.scale_bits,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "CKKSParams":
        return cls(int(d["poly_modulus_degree"]), tuple(int(x) for x in d["coeff_mod_bit_sizes"]), int(d["scale_bits"]))


def _ts():
    import tenseal as ts  # imported lazily: devices never install tenseal

    return ts


def context_id(public_context_bytes: bytes) -> bytes:
    """32-byte id of a CKKS context: SHA-256 of its public serialisation."""
    return hashlib.sha256(public_context_bytes).digest()


class CKKSCodec:
    """Encrypt, add and decrypt framed CKKS vectors under one TenSEAL context.

    Build with :meth:`generate` (key ceremony: holds the secret key) or
    :meth:`from_bytes` (loads a serialised context, public or secret).
    The aggregator gets a public codec: :attr:`has_secret_key` is False and
    :meth:`decrypt` raises :class:`SecretKeyMissingError`.
    """

    def __init__(self, context, params: CKKSParams, ctx_id: bytes):
        self._ctx = context
        self.params = params
        self.context_id = ctx_id
        self._zeros: dict[int, object] = {}  # vector size -> fresh encryption of zeros

    # ---- construction -------------------------------------------------------------
    @classmethod
    def generate(cls, params: CKKSParams | None = None) -> "CKKSCodec":
        """Create a fresh secret CKKS context (no relin/Galois keys)."""
        ts = _ts()
        params = params or CKKSParams()
        ctx = ts.context(
            ts.SCHEME_TYPE.CKKS,
            poly_modulus_degree=params.poly_modulus_degree,
            coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
        )
        ctx.global_scale = 2.0**params.scale_bits
        codec = cls(ctx, params, b"")
        codec.context_id = context_id(codec.public_context_bytes())
        return codec

    @classmethod
    def from_bytes(cls, context_bytes: bytes, params: CKKSParams, ctx_id: bytes) -> "CKKSCodec":
        """Load a serialised context (as written by :meth:`public_context_bytes` or
        :meth:`secret_context_bytes`).

        Raises:
            CiphertextError: the bytes are not a TenSEAL context.
        """
        ts = _ts()
        try:
            ctx = ts.context_from(context_bytes)
        except Exception as exc:  # TenSEAL raises ValueError/RuntimeError
            raise CiphertextError(f"not a TenSEAL CKKS context: {exc}") from exc
        ctx.global_scale = 2.0**params.scale_bits
        return cls(ctx, params, ctx_id)

    def public_context_bytes(self) -> bytes:
        """Serialised context without the secret key, relin or Galois keys (bytes)."""
        return self._ctx.serialize(
            save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
        )

    def secret_context_bytes(self) -> bytes:
        """Serialised context including the secret key. Handle as a secret."""
        if not self.has_secret_key:
            raise SecretKeyMissingError("this CKKS context holds no secret key")
        return self._ctx.serialize(
            save_public_key=True, save_secret_key=True, save_galois_keys=False, save_relin_keys=False
        )

    @property
    def has_secret_key(self) -> bool:
        """True if the loaded context holds the CKKS secret key (asks TenSEAL)."""
        return bool(self._ctx.is_private())

    # ---- encrypt / parse / add / decrypt ------------------------------------------
    def encrypt(self, vector: np.ndarray) -> bytes:
        """Encrypt a 1-D vector (any real dtype, used as float64) into one frame.

        Returns the framed ciphertext bytes (see module docstring).
        Raises ValueError if ``vector`` is not 1-D or is not finite.
        """
        ts = _ts()
        v = np.asarray(vector, dtype=np.float64)
        if v.ndim != 1:
            raise ValueError(f"expected a 1-D vector, got shape {v.shape}")
        if not np.all(np.isfinite(v)):
            raise ValueError("cannot encrypt NaN or infinite values")
        slots = self.params.slots
        chunks = [ts.ckks_vector(self._ctx, v[i : i + slots].tolist()).serialize() for i in range(0, max(len(v), 1), slots)]
        return self.frame(len(v), chunks)

    def frame(self, length: int, chunks: Sequence[bytes]) -> bytes:
        """Pack serialised chunks of a ``length``-value vector into one frame (bytes)."""
        parts = [_HEADER.pack(MAGIC, VERSION, self.context_id, length, len(chunks))]
        for c in chunks:
            parts.append(_LEN.pack(len(c)))
            parts.append(c)
        return b"".join(parts)

    def split(self, blob: bytes, expected_length: int | None = None) -> tuple[int, list[bytes]]:
        """Check a frame's header and return ``(vector length, chunk byte strings)``.

        Raises:
            CiphertextError: bad magic/version, another context id, a length other than
                ``expected_length``, a chunk count that does not fit the length, a frame
                or chunk larger than its bound (:meth:`CKKSParams.max_frame_bytes`,
                checked before any chunk is parsed), or truncated/trailing bytes.
        """
        blob = bytes(blob)
        if expected_length is not None and len(blob) > self.params.max_frame_bytes(expected_length):
            raise CiphertextError(f"ciphertext frame of {len(blob)} bytes exceeds the bound of "
                                  f"{self.params.max_frame_bytes(expected_length)} bytes for {expected_length} values")
        if len(blob) < _HEADER.size:
            raise CiphertextError(f"ciphertext frame too short ({len(blob)} bytes)")
        magic, version, cid, length, n = _HEADER.unpack_from(blob)
        if magic != MAGIC or version != VERSION:
            raise CiphertextError("not a sealfl CKKS frame (bad magic or version)")
        if cid != self.context_id:
            raise CiphertextError(
                f"ciphertext was made under CKKS context {cid.hex()[:16]}…, this campaign's is "
                f"{self.context_id.hex()[:16]}…"
            )
        if expected_length is not None and length != expected_length:
            raise CiphertextError(f"ciphertext holds {length} values, expected {expected_length}")
        want_chunks = max(1, -(-length // self.params.slots))
        if n != want_chunks:
            raise CiphertextError(f"{n} ciphertext chunks for {length} values, expected {want_chunks}")
        if len(blob) > self.params.max_frame_bytes(length):
            raise CiphertextError(f"ciphertext frame of {len(blob)} bytes exceeds the bound of "
                                  f"{self.params.max_frame_bytes(length)} bytes for {length} values")
        off = _HEADER.size
        chunks = []
        for i in range(n):
            if off + _LEN.size > len(blob):
                raise CiphertextError("ciphertext frame truncated")
            (size,) = _LEN.unpack_from(blob, off)
            off += _LEN.size
            if size > self.params.max_chunk_bytes:
                raise CiphertextError(f"chunk {i} is {size} bytes, more than a ciphertext of these parameters "
                                      f"can be ({self.params.max_chunk_bytes})")
            if off + size > len(blob):
                raise CiphertextError("ciphertext frame truncated")
            chunks.append(blob[off : off + size])
            off += size
        if off != len(blob):
            raise CiphertextError(f"{len(blob) - off} trailing bytes after the ciphertext frame")
        return length, chunks

    def load_chunks(self, chunks: Sequence[bytes], length: int) -> list:
        """Deserialise chunks into TenSEAL CKKSVectors and check each one (steps 3-4 of
        the module docstring): size bound, parse, value count, canonical bytes, shape of
        a fresh ciphertext (2 polynomials, NTT form, not transparent, first data level,
        scale ``2**scale_bits``) and a trial addition to an encryption of zeros.

        Returns the CKKSVectors (one per chunk). A vector returned here can be added to
        any other vector returned here for the same ``length`` and chunk index.

        Raises:
            CiphertextError: naming the chunk and the failed check.
        """
        ts = _ts()
        vecs = []
        slots = self.params.slots
        for i, c in enumerate(chunks):
            c = bytes(c)
            if len(c) > self.params.max_chunk_bytes:
                raise CiphertextError(f"chunk {i} is {len(c)} bytes, more than a ciphertext of these parameters "
                                      f"can be ({self.params.max_chunk_bytes})")
            try:
                vec = ts.ckks_vector_from(self._ctx, c)
            except Exception as exc:
                raise CiphertextError(f"chunk {i} is not a ciphertext of this CKKS context: {exc}") from exc
            want = min(slots, length - i * slots) if length else 0
            if vec.size() != max(want, 0) and not (length == 0 and vec.size() == 0):
                raise CiphertextError(f"chunk {i} holds {vec.size()} values, expected {want}")
            self._check_fresh_shape(i, vec, c)
            vecs.append(vec)
        return vecs

    def _zero(self, size: int):
        """A fresh encryption of ``size`` zeros under this context (cached; public key suffices)."""
        if size not in self._zeros:
            self._zeros[size] = _ts().ckks_vector(self._ctx, [0.0] * size)
        return self._zeros[size]

    def _check_fresh_shape(self, i: int, vec, raw: bytes) -> None:
        """Raise CiphertextError unless chunk ``i`` (parsed ``vec`` of bytes ``raw``) is
        canonical and shaped like a fresh encryption under this context."""
        try:
            canonical = vec.serialize()
        except Exception as exc:  # TenSEAL raises ValueError/RuntimeError
            raise CiphertextError(f"chunk {i} does not re-serialise: {exc}") from exc
        if canonical != raw:
            raise CiphertextError(f"chunk {i} is not in canonical form ({len(raw)} bytes received, "
                                  f"{len(canonical)} after re-serialisation): extra or altered bytes")
        cts = vec.ciphertext()
        if len(cts) != 1:
            raise CiphertextError(f"chunk {i} holds {len(cts)} ciphertexts, expected 1")
        ct = cts[0]
        zero = self._zero(vec.size()).ciphertext()[0]
        want_scale = 2.0 ** self.params.scale_bits
        problems = []
        if ct.size() != 2:
            problems.append(f"{ct.size()} polynomials (a fresh ciphertext has 2)")
        if not ct.is_ntt_form():
            problems.append("not in NTT form")
        if ct.is_transparent():
            problems.append("transparent (not encrypted)")
        if ct.coeff_modulus_size() != self.params.data_primes or list(ct.parms_id()) != list(zero.parms_id()):
            problems.append(f"at another modulus level ({ct.coeff_modulus_size()} primes, expected "
                            f"{self.params.data_primes})")
        if ct.scale != want_scale:
            problems.append(f"scale 2^{math.log2(ct.scale) if ct.scale > 0 else float('nan'):.2f}, "
                            f"expected 2^{self.params.scale_bits}")
        if problems:
            raise CiphertextError(f"chunk {i} cannot be added to this campaign's ciphertexts: " + "; ".join(problems))
        try:
            self._zero(vec.size()) + vec
        except Exception as exc:  # SEAL: ValueError "scale mismatch", "parameter mismatch", ...
            raise CiphertextError(f"chunk {i} fails a trial addition to an encryption of zeros: {exc}") from exc

    def parse(self, blob: bytes, expected_length: int | None = None) -> list:
        """:meth:`split` then :meth:`load_chunks`; returns the CKKSVectors."""
        length, chunks = self.split(blob, expected_length)
        return self.load_chunks(chunks, length)

    def add(self, blobs: Sequence[bytes], expected_length: int) -> bytes:
        """Sum framed ciphertexts slot-wise, without decrypting. Needs no secret key.

        Raises CiphertextError on the first invalid blob (callers that must tolerate bad
        partners validate each with :meth:`parse` first) or if ``blobs`` is empty.
        """
        if not blobs:
            raise CiphertextError("nothing to add")
        total = self.parse(blobs[0], expected_length)
        for b in blobs[1:]:
            for acc, v in zip(total, self.parse(b, expected_length)):
                acc += v
        return self.frame(expected_length, [v.serialize() for v in total])

    def decrypt(self, blob: bytes, expected_length: int | None = None) -> np.ndarray:
        """Decrypt a frame into a float64 vector of its stored length.

        Raises:
            SecretKeyMissingError: this context has no secret key.
            CiphertextError: the frame is invalid.
        """
        if not self.has_secret_key:
            raise SecretKeyMissingError(
                "this CKKS context holds no secret key; only key holders (partners, the "
                "release enclave) can decrypt"
            )
        length, chunks = self.split(blob, expected_length)
        vecs = self.load_chunks(chunks, length)
        out = np.concatenate([np.asarray(v.decrypt(), dtype=np.float64) for v in vecs]) if vecs else np.zeros(0)
        return out[:length]
