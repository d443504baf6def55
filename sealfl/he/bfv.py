"""Packed BFV codec for add-only encrypted FedAvg (TenSEAL / Microsoft SEAL): sealfl's
default codec (ARCHITECTURE.md; ``--he bfv``). CKKS (:mod:`sealfl.he.ckks`, NVIDIA FLARE's
parameters) stays available as ``--he ckks``.

What BFV gains over CKKS here: weighted FedAvg under HE needs additions only (partners pre-scale
by their weight), so the ring can be as small as security allows and the plaintext
space can be filled with fixed-point integers. BFV sums are *exact* (no decryption
noise in the result, so the Li-Micciancio key-recovery attack on published CKKS
decryptions, ePrint 2020/1533, does not apply to what key holders decrypt).

Parameters (:class:`BFVParams`, defaults measured in ``bench/codec_bench.py``):

- ring dimension N = 4096, coefficient modulus primes [32, 32, 40] bits (the 40-bit
  prime is SEAL's special key-switching prime; a fresh ciphertext lives at the first
  data level, 64 bits), plain modulus t = the largest 54-bit batching prime
  (t = 1 mod 2N; ``seal.PlainModulus.Batching(4096, 54)`` = 18014398509309953).
- **Security row:** HomomorphicEncryption.org Security Standard (Albrecht et al., 2018),
  Table 1, 128-bit classical security, ternary secret, n = 4096: log2 q <= 109. Here
  log2 q = 32 + 32 + 40 = 104. SEAL refuses (``encryption parameters are not set
  correctly``) any set above its ``sec_level_type::tc128`` table, which is that row.
- **Symmetric (secret-key) encryption**: only key holders (partners) encrypt, and they
  hold the secret key. A fresh symmetric ciphertext's noise is one error sample, so
  64 summed ciphertexts stay far below q/(2t) with a 64-bit data modulus (measured: 0
  wrong slots in 4 x 4096 sums of 64 max-range ciphertexts; t = 2^57 fails every slot).
  The aggregator's context carries **no keys at all** (~90 bytes): it can neither
  decrypt nor encrypt, only add.
- **Seeded ciphertexts** (:mod:`sealfl.he.sealchunks`): a partner's chunk of 8,192
  values travels as ~34,030 bytes instead of the expanded ~68,900 -- about 1.04x the fp32
  bytes.

Layouts (:class:`Layout`, one byte in the frame header; a frame is only ever checked
against the layout its caller expects):

- ``PACKED`` (model updates): values are clipped to ``±(8 - 2^-10)`` (Flower SecAgg+'s
  default clipping range 8), rounded to the nearest multiple of ``2^-23`` and packed two
  per slot as 27-bit signed fields: ``slot = q0 + q1 * 2^27``. FedAvg partners encrypt
  ``(n_i / N) * w_i`` with N the total declared in the statistics round and ``w_i``
  itself clipped to ±(8 - 2^-10) first (:func:`sealfl.he.decrypted.update_share`), so
  the *sum* of all partners' values stays within ``±8`` because the weights sum to at
  most 1: that normalisation is the guard for the number of partners (no guard bits are
  spent). A partner that skips the clipping can wrap the sum; so can one that lies about
  its values in any other way -- the content is not checkable without the key.
  Sum error <= K * 2^-24 for K partners; for K <= 64 that is <= 2^-18, the quantisation
  step of SecAgg+'s defaults (range 16 over 2^22 levels).
- Narrower packings of model updates (``BFVParams.pack_bits`` / ``pack_range``, a consortium
  setting: ``consortium create --pack-bits 18|13|10 [--pack-range 8|4|2|1]``;
  :func:`sealfl.he.layouts.packed_layout` has the table): ``54 // bits`` fields per slot,
  stochastic (unbiased) rounding, a per-partner clip that leaves the field room for the
  rounding of 64 partners; sum error < K steps for K partners. Each has its own layout id,
  so a frame of one width is refused by a reader of another.
- ``WIDE`` (statistics ``[n, Σx, Σx²]`` and other unnormalised sums): one value per
  slot, multiples of ``2^-12``, each partner's ``|value| < 2^34`` so 64 of them sum
  within ``±2^52 < t/2``.

Decoding is exact: the decrypted slot P (centred mod t, |P| < t/2) gives
``q0 = centred(P mod 2^27)`` and ``q1 = (P - q0) / 2^27``.

Frames: :mod:`sealfl.he.framed` with magic ``b"SFB2"``; each chunk is one SEAL
ciphertext, checked as :mod:`sealfl.he.sealchunks` describes (BFV: not NTT form,
scale 1). What cannot be checked without the secret key: that the content is in range.
A partner that encrypts out-of-range values corrupts at most the sums of the slots it
writes (and, through a carry, the neighbouring packed value): the key holders'
decrypted-value bounds (:mod:`sealfl.he.decrypted`) remain the defence.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from sealfl.common.fields import Fields
from sealfl.he.errors import CiphertextError, SecretKeyMissingError
from sealfl.he.framed import (
    DEFAULT_PACK_BITS,
    DEFAULT_PACK_RANGE,
    LAYOUTS,
    PACK_RANGES,
    PACK_WIDTHS,
    PACKED,
    WIDE,
    ChunkedParams,
    Layout,
    packed_layout,
    tenseal,
)
from sealfl.he.sealchunks import SealChunkCodec

__all__ = ["MAGIC", "BFVParams", "BFVCodec", "quantize", "pack", "unpack", "context_id",
           "Layout", "PACKED", "WIDE", "LAYOUTS", "PACK_WIDTHS", "packed_layout"]

log = logging.getLogger(__name__)

MAGIC = b"SFB2"  # "SFBV" frames carried TenSEAL BFVVector chunks (before seeded ciphertexts)


@dataclass(frozen=True)
class BFVParams(ChunkedParams):
    """BFV parameters (see the module docstring for the security row and measurements).

    Attributes:
        poly_modulus_degree: ring dimension N (slots per ciphertext = N).
        coeff_mod_bit_sizes: SEAL coefficient modulus prime sizes; the last one is the
            special (key-switching) prime, not part of a fresh ciphertext.
        plain_modulus_bits: t is SEAL's largest batching prime of this many bits.
        pack_bits: width of one packed model-update value (:func:`sealfl.he.layouts.packed_layout`:
            27 -> 2 per slot, the default; 18 -> 3, 13 -> 4, 10 -> 5, stochastically rounded).
        pack_range: the narrow packings' range ``±pack_range`` (8, 4, 2 or 1; 27 bits: 8).
            Both are written into the parameter dict only when they are not the defaults, so
            consortia made before the setting existed read (and write) as they were.

    Raises:
        CiphertextError: (on construction) an unsupported width or range.
    """

    SCHEME: ClassVar[str] = "BFV"
    EXTRA: ClassVar[str] = "plain_modulus_bits"

    poly_modulus_degree: int = 4096
    coeff_mod_bit_sizes: tuple[int, ...] = field(default=(32, 32, 40))
    plain_modulus_bits: int = 54
    pack_bits: int = DEFAULT_PACK_BITS
    pack_range: int = DEFAULT_PACK_RANGE

    def __post_init__(self) -> None:
        packed_layout(self.pack_bits, self.pack_range)  # raises CiphertextError for an unsupported packing

    @property
    def slots(self) -> int:
        """Integer slots per ciphertext (BFV batching: N)."""
        return self.poly_modulus_degree

    def resolve(self, layout: Layout) -> Layout:
        """:data:`PACKED` (the model-update role) becomes this campaign's packing width."""
        return packed_layout(self.pack_bits, self.pack_range) if layout.id == PACKED.id else layout

    def values_per_slot(self, layout: Layout) -> int:
        """Real values one slot carries: ``per_slot`` fixed-point fields of the resolved layout."""
        return self.resolve(layout).per_slot

    def to_dict(self) -> dict:
        """The common parameter dict, plus ``pack_bits`` / ``pack_range`` when not the defaults."""
        d = super().to_dict()
        if self.pack_bits != DEFAULT_PACK_BITS:
            d["pack_bits"] = self.pack_bits
        if self.pack_range != DEFAULT_PACK_RANGE:
            d["pack_range"] = self.pack_range
        return d

    @classmethod
    def from_dict(cls, d: object) -> "BFVParams":
        """:meth:`ChunkedParams.from_dict` plus the optional ``pack_bits`` (default 27) and
        ``pack_range`` (default 8).

        Raises:
            CiphertextError: not a BFV parameter dict, or an unsupported width or range
                (names the choices).
        """
        base = super().from_dict(d)
        fields = Fields("BFV parameters", CiphertextError)
        bits = fields.get(d, "pack_bits", "integer", lo=min(PACK_WIDTHS), hi=max(PACK_WIDTHS),
                          default=DEFAULT_PACK_BITS)
        value_range = fields.get(d, "pack_range", "integer", lo=min(PACK_RANGES), hi=max(PACK_RANGES),
                                 default=DEFAULT_PACK_RANGE)
        return cls(base.poly_modulus_degree, base.coeff_mod_bit_sizes, base.plain_modulus_bits, bits, value_range)


def quantize(values: np.ndarray, layout: Layout, rng: np.random.Generator | None = None) -> np.ndarray:
    """Fixed-point integers (int64) of ``values`` (float64, 1-D) under ``layout``:
    clip (``layout.clip``), then round at ``2**-frac_bits`` -- half to even, or, for a
    stochastic layout (the narrow packings), up with probability equal to the fraction
    left below the grid (``q = floor(x) + [u < x - floor(x)]``, ``u`` uniform on [0, 1)
    from ``rng``), so ``E[q] = x`` exactly and ``|q - x| < 1`` (unbiased stochastic
    rounding, e.g. Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015).

    ``rng``: the stochastic layouts' randomness (default: a fresh ChaCha20 generator keyed
    from :mod:`secrets`, :func:`sealfl.he.dp.secure_rng`); ignored otherwise.

    Raises CiphertextError for NaN/inf, or a value beyond ``layout.max_abs`` when the
    layout does not clip.
    """
    v = np.asarray(values)
    if v.dtype.kind not in "biuf":
        raise CiphertextError(f"can only encrypt real numbers, got dtype {v.dtype}")
    v = v.astype(np.float64)
    if v.ndim != 1:
        raise CiphertextError(f"expected a 1-D vector, got shape {v.shape}")
    if not np.all(np.isfinite(v)):
        raise CiphertextError("cannot encrypt NaN or infinite values")
    if layout.clip is not None:
        n_clipped = int(np.count_nonzero(np.abs(v) > layout.clip))
        if n_clipped:
            log.warning("clipped %d of %d values to ±%g before encryption", n_clipped, v.size, layout.clip)
        v = np.clip(v, -layout.clip, layout.clip)
    elif v.size and float(np.max(np.abs(v))) >= layout.max_abs:
        raise CiphertextError(f"value {float(np.max(np.abs(v))):.6g} is beyond this layout's range ±{layout.max_abs:g}")
    x = np.ldexp(v, layout.frac_bits)  # exact: a power-of-two scaling
    if not layout.stochastic:
        return np.rint(x).astype(np.int64)
    if rng is None:
        from sealfl.he.dp import secure_rng

        rng = secure_rng()
    lo = np.floor(x)
    return (lo + (rng.random(x.size) < (x - lo))).astype(np.int64)


def pack(q: np.ndarray, layout: Layout) -> np.ndarray:
    """Pack signed integers (int64, each ``|q| < 2**(bits-1)``) ``per_slot`` per slot:
    ``slot = Σ_j q[j] * 2**(bits*j)`` (int64; the last slot is zero-padded)."""
    if layout.per_slot == 1:
        return q.astype(np.int64)
    pad = (-q.size) % layout.per_slot
    q = np.concatenate([q, np.zeros(pad, dtype=np.int64)]).reshape(-1, layout.per_slot)
    out = np.zeros(q.shape[0], dtype=np.int64)
    for j in range(layout.per_slot - 1, -1, -1):
        out = (out << layout.bits) + q[:, j]
    return out


def unpack(slots: np.ndarray, layout: Layout, length: int) -> np.ndarray:
    """Inverse of :func:`pack` for centred slot values (int64); returns ``length`` ints."""
    p = np.asarray(slots, dtype=np.int64)
    if layout.per_slot == 1:
        return p[:length]
    half, full = 1 << (layout.bits - 1), 1 << layout.bits
    cols = []
    for _ in range(layout.per_slot):
        lo = ((p + half) & (full - 1)) - half
        cols.append(lo)
        p = (p - lo) >> layout.bits
    return np.stack(cols, axis=1).reshape(-1)[:length]


def context_id(public_context_bytes: bytes, salt: bytes) -> bytes:
    """32-byte id of a campaign's context: SHA-256 of its public serialisation and a
    random 32-byte ``salt`` drawn at the key ceremony. The public BFV context holds no
    key (only parameters), so without the salt every campaign with the same parameters
    would share an id. A label, not a proof: anyone who saw the id can write it."""
    return hashlib.sha256(b"sealfl-bfv-context\0" + public_context_bytes + salt).digest()


class BFVCodec(SealChunkCodec):
    """Encrypt, add and decrypt framed packed-BFV vectors under one TenSEAL context.

    :meth:`generate` makes a secret (symmetric) context; :meth:`from_bytes` loads one.
    The aggregator's context (:meth:`public_context_bytes`) holds no keys: it adds only.
    """

    MAGIC = MAGIC
    SCHEME = "BFV"
    SAVES_PUBLIC_KEY = False  # symmetric: the aggregator's context holds no key at all
    #: partners encrypt ``(n_i / N) w_i`` (:func:`sealfl.he.decrypted.update_share`)
    WEIGHTING = "share"

    def __init__(self, context, params: BFVParams, ctx_id: bytes):
        import tenseal.sealapi as sealapi

        self._ctx = context
        self.params = params
        self.context_id = ctx_id
        self._rng: np.random.Generator | None = None  # stochastic rounding, made on first use
        self._init_seal(context)
        self._encoder = sealapi.BatchEncoder(self._seal)

    _scale = 1.0  # BFV ciphertexts have scale 1

    def _encode(self, values: list):
        import tenseal.sealapi as sealapi

        plain = sealapi.Plaintext()
        self._encoder.encode(values or [0], plain)
        return plain

    def _decode(self, plain) -> list:
        return self._encoder.decode_int64(plain)

    @classmethod
    def generate(cls, params: BFVParams | None = None) -> "BFVCodec":
        """Key ceremony: a fresh symmetric BFV context holding the secret key."""
        ts = tenseal()
        import tenseal.sealapi as sealapi

        params = params or BFVParams()
        t = sealapi.PlainModulus.Batching(params.poly_modulus_degree, params.plain_modulus_bits).value()
        ctx = ts.context(ts.SCHEME_TYPE.BFV, poly_modulus_degree=params.poly_modulus_degree, plain_modulus=t,
                         coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
                         encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC)
        codec = cls(ctx, params, b"")
        codec.context_id = context_id(codec.public_context_bytes(), os.urandom(32))
        return codec

    @classmethod
    def from_bytes(cls, context_bytes: bytes, params: BFVParams, ctx_id: bytes) -> "BFVCodec":
        """Load a serialised context. Raises CiphertextError if it is not a TenSEAL BFV
        context with ``params`` (N, primes, plain modulus)."""
        ctx, parms = cls._load_context(context_bytes, params)
        t = parms.plain_modulus().value()
        if t.bit_length() != params.plain_modulus_bits:
            raise CiphertextError(f"context plain modulus of {t.bit_length()} bits differs from the campaign's "
                                  f"{params.to_dict()}")
        return cls(ctx, params, ctx_id)

    # ---- encrypt / frame ----------------------------------------------------------------
    def encrypt(self, vector: np.ndarray, layout: Layout = PACKED, rng: np.random.Generator | None = None) -> bytes:
        """Encrypt a 1-D real vector (used as float64) under ``layout`` (``PACKED``: the
        campaign's packing width, :attr:`BFVParams.pack_bits`); returns a frame.

        Values beyond the layout's ``clip`` are clipped with a warning (``PACKED``: ±(8 -
        2^-10); narrower packings: :func:`sealfl.he.layouts.packed_layout`); a layout without
        ``clip`` (``WIDE``) refuses them instead. Narrow packings round stochastically
        (:func:`quantize`) with ``rng``, by default this codec's own ChaCha20 generator keyed
        from :mod:`secrets` when the codec is first asked to round (one per partner process).

        Raises SecretKeyMissingError without the secret key (symmetric encryption);
        CiphertextError for a non-1-D, non-real or non-finite vector, or a value beyond a
        non-clipping layout's range.
        """
        layout = self.params.resolve(layout)
        if layout.stochastic and rng is None:
            rng = self._rounding_rng()
        q = quantize(vector, layout, rng)
        return self.frame(q.size, self._seeded_chunks(pack(q, layout), self.params.slots), layout)

    def _rounding_rng(self) -> np.random.Generator:
        """This codec's stochastic-rounding generator (ChaCha20 keyed from :mod:`secrets`)."""
        if self._rng is None:
            from sealfl.he.dp import secure_rng

            self._rng = secure_rng()
        return self._rng

    def encrypt_integers(self, q: np.ndarray, layout: Layout = PACKED) -> bytes:
        """Encrypt fixed-point integers already in ``layout``'s units (int64, 1-D; e.g. a DP
        upload with its integer noise, :func:`sealfl.he.dp.dp_upload`); returns a frame that
        :meth:`decrypt` reads like :meth:`encrypt`'s.

        Raises CiphertextError for a non-integer or non-1-D array or a value beyond
        ``layout.int_max`` (27-bit packing: the field, ``|q| < 2**26``; narrower packings:
        the per-partner clip that keeps the sum of 64 partners inside the field);
        SecretKeyMissingError without the secret key.
        """
        layout = self.params.resolve(layout)
        q = np.asarray(q)
        if q.dtype.kind not in "iu" or q.ndim != 1:
            raise CiphertextError(f"expected a 1-D integer vector, got {q.dtype} {q.shape}")
        q = q.astype(np.int64)
        if q.size and int(np.max(np.abs(q))) > layout.int_max:
            what = (f"a {layout.bits}-bit field" if not layout.stochastic else
                    f"the {layout.bits}-bit packing's per-partner range ±{layout.int_max} "
                    f"(±{layout.max_abs:g}; room for the sum of 64 partners)")
            raise CiphertextError(f"integer {int(np.max(np.abs(q)))} does not fit {what}")
        return self.frame(q.size, self._seeded_chunks(pack(q, layout), self.params.slots), layout)

    def decrypt(self, blob: bytes, expected_length: int | None = None, layout: Layout = PACKED) -> np.ndarray:
        """Decrypt a frame into float64 (length,) -- exact fixed-point values (the sum of the
        integers the partners encrypted, times ``2**-frac_bits`` of the resolved layout).

        Raises SecretKeyMissingError without the secret key; CiphertextError for an
        invalid frame.
        """
        if not self.has_secret_key:
            raise SecretKeyMissingError("this BFV context holds no secret key; only key holders can decrypt")
        layout = self.params.resolve(layout)
        length, parts = self._decrypted_chunks(blob, expected_length, layout)
        slots = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
        return np.ldexp(unpack(slots, layout, length).astype(np.float64), -layout.frac_bits)
