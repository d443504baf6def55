"""CKKS codec for encrypted weighted FedAvg (TenSEAL / Microsoft SEAL): the consortium
option ``--he ckks`` with NVIDIA FLARE's parameters, beside the default packed BFV
(:mod:`sealfl.he.bfv`, ARCHITECTURE.md).

A vector is split into chunks of ``slots`` values (``poly_modulus_degree / 2``, one
CKKS ciphertext each), encrypted with the secret key and sent **seeded**
(:mod:`sealfl.he.sealchunks`: half the bytes of TenSEAL's vectors), and framed
(:mod:`sealfl.he.framed`, magic ``b"SFC3"``; ``b"SFC2"`` frames carried TenSEAL
CKKSVector chunks; the layout byte is the :data:`~sealfl.he.framed.PACKED` /
:data:`~sealfl.he.framed.WIDE` of the caller, so statistics never pass for an update).
Partners encrypt ``n_i w_i`` (``WEIGHTING = "count"``; the BFV codec carries shares
``(n_i / N) w_i`` instead), range-checked by :func:`check_values`; the layout's packing
fields and clipping do not apply to CKKS.

Parameters default to NVFlare's HE defaults (N=8192, coefficient moduli [60, 40, 40],
scale 2^40): 4096 values per ciphertext; the decryption error of a sum of 64 partners'
values is ~1e-8 here (tests/test_ckks.py). log2 q = 140 <= 218, the HomomorphicEncryption.org
standard's 128-bit row for n = 8192 (SEAL enforces it). Additions only: no relinearisation
or Galois keys (Galois keys alone make a public context ~35 MB). The aggregator's context
holds the public key but no secret key.

What a frame from outside must satisfy before anything adds it (issue 5): (1) size
before parsing and (2) header -- :meth:`FramedCodec.split`; (3) one whole SEAL object per
chunk, a fresh ciphertext's shape (CKKS: NTT form, scale exactly ``2**scale_bits``) and
(4) a trial addition -- :mod:`sealfl.he.sealchunks`. (The former TenSEAL-vector chunks
needed a re-serialisation check: TenSEAL's protobuf parser skips unknown fields, so a
valid ciphertext followed by an unknown 64 MiB field parsed; a bare SEAL object has a
size in its header, checked against the chunk's before parsing.)

Decryptions carry noise that depends on the secret key: key holders round them before
anything leaves (:mod:`sealfl.he.decrypted`, Li and Micciancio, ePrint 2020/1533).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from sealfl.he.errors import CiphertextError
from sealfl.he.framed import PACKED, ChunkedParams, Layout, tenseal
from sealfl.he.sealchunks import SealChunkCodec

__all__ = ["MAGIC", "CKKSParams", "CKKSCodec", "context_id", "check_values", "MAX_ABS"]

MAGIC = b"SFC3"


@dataclass(frozen=True)
class CKKSParams(ChunkedParams):
    """CKKS parameters.

    Attributes:
        poly_modulus_degree: ring dimension N (power of two); slots per ciphertext = N/2.
        coeff_mod_bit_sizes: bit sizes of the coefficient modulus primes (SEAL); the last
            is the special (key-switching) prime, not part of a fresh ciphertext.
        scale_bits: log2 of the encoding scale (``global_scale = 2**scale_bits``).
    Source: NVFlare HE defaults; SEAL manual, "CKKS basics" example.
    """

    SCHEME: ClassVar[str] = "CKKS"
    EXTRA: ClassVar[str] = "scale_bits"

    poly_modulus_degree: int = 8192
    coeff_mod_bit_sizes: tuple[int, ...] = field(default=(60, 40, 40))
    scale_bits: int = 40

    @property
    def slots(self) -> int:
        """Real values one ciphertext holds (N / 2)."""
        return self.poly_modulus_degree // 2

    def values_per_slot(self, layout: Layout) -> int:
        """One real value per CKKS slot, whatever the layout."""
        return 1


def context_id(public_context_bytes: bytes) -> bytes:
    """32-byte id of a CKKS context: SHA-256 of its public serialisation (which holds the
    campaign's fresh public key, so no two key ceremonies share an id)."""
    return hashlib.sha256(b"sealfl-ckks-context\0" + public_context_bytes).digest()


#: largest ``|value|`` one partner may encrypt: a fresh ciphertext's modulus is
#: 60 + 40 = 100 bits and the scale 2^40, so sums of up to 2^18 partners stay far below
#: the 2^59 at which decoding wraps
MAX_ABS = 2.0**40


def check_values(values: np.ndarray, layout: Layout) -> np.ndarray:
    """``values`` as float64 (1-D), checked for what CKKS can carry under ``layout``.

    CKKS partners encrypt ``n_i w_i`` (the codec's ``"count"`` weighting), so the packed
    layout's clipping of shares to ±8 does not apply; every value must be finite and
    below :data:`MAX_ABS` (and below ``layout.max_abs`` for layouts that do not clip).

    Raises CiphertextError for a non-1-D vector, NaN/inf, or an out-of-range value."""
    v = np.asarray(values)
    if v.dtype.kind not in "biuf":
        raise CiphertextError(f"can only encrypt real numbers, got dtype {v.dtype}")
    v = v.astype(np.float64)
    if v.ndim != 1:
        raise CiphertextError(f"expected a 1-D vector, got shape {v.shape}")
    if not np.all(np.isfinite(v)):
        raise CiphertextError("cannot encrypt NaN or infinite values")
    limit = MAX_ABS if layout.clip is not None else min(MAX_ABS, layout.max_abs)
    if v.size and float(np.max(np.abs(v))) >= limit:
        raise CiphertextError(f"value {float(np.max(np.abs(v))):.6g} is beyond the CKKS range ±{limit:g}")
    return v


class CKKSCodec(SealChunkCodec):
    """Encrypt, add and decrypt framed CKKS vectors under one TenSEAL context.

    :meth:`generate` makes a secret context (key ceremony); :meth:`from_bytes` loads one.
    Key holders (partners, the release enclave) encrypt with the secret key (seeded
    symmetric ciphertexts). The aggregator's context (:meth:`public_context_bytes`) has
    no secret key: it adds, never decrypts.
    """

    MAGIC = MAGIC
    SCHEME = "CKKS"
    #: partners encrypt ``n_i w_i`` (:func:`sealfl.he.decrypted.update_share`)
    WEIGHTING = "count"
    NTT_FORM = True  # SEAL keeps CKKS ciphertexts in NTT form

    def __init__(self, context, params: CKKSParams, ctx_id: bytes):
        import tenseal.sealapi as sealapi

        self._ctx = context
        self.params = params
        self.context_id = ctx_id
        self._init_seal(context)
        self._encoder = sealapi.CKKSEncoder(self._seal)

    @property
    def _scale(self) -> float:
        return 2.0**self.params.scale_bits

    def _encode(self, values: list):
        import tenseal.sealapi as sealapi

        plain = sealapi.Plaintext()
        self._encoder.encode([float(x) for x in values] or [0.0], self._scale, plain)
        return plain

    def _decode(self, plain) -> list:
        return self._encoder.decode_double(plain)

    @classmethod
    def generate(cls, params: CKKSParams | None = None) -> "CKKSCodec":
        """Key ceremony: a fresh secret CKKS context (no relinearisation/Galois keys)."""
        ts = tenseal()
        params = params or CKKSParams()
        ctx = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=params.poly_modulus_degree,
                         coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes))
        ctx.global_scale = 2.0**params.scale_bits
        codec = cls(ctx, params, b"")
        codec.context_id = context_id(codec.public_context_bytes())
        return codec

    @classmethod
    def from_bytes(cls, context_bytes: bytes, params: CKKSParams, ctx_id: bytes) -> "CKKSCodec":
        """Load a serialised context. Raises CiphertextError if it is not a TenSEAL CKKS
        context with ``params`` (N, primes)."""
        ctx, _ = cls._load_context(context_bytes, params)
        ctx.global_scale = 2.0**params.scale_bits
        return cls(ctx, params, ctx_id)

    def encrypt(self, vector: np.ndarray, layout: Layout = PACKED) -> bytes:
        """Encrypt a 1-D real vector (used as float64) under ``layout`` with the secret key;
        returns a frame of seeded chunks.

        Raises SecretKeyMissingError without the secret key; CiphertextError for a non-1-D
        or non-finite vector or an out-of-range value (:func:`check_values`).
        """
        v = check_values(vector, layout)
        return self.frame(v.size, self._seeded_chunks(v, self.params.slots), layout)

    def decrypt(self, blob: bytes, expected_length: int | None = None, layout: Layout = PACKED) -> np.ndarray:
        """Decrypt a frame into float64 (length,) -- with CKKS noise: round before publishing
        (:mod:`sealfl.he.decrypted`).

        Raises SecretKeyMissingError without the secret key; CiphertextError for an
        invalid frame.
        """
        length, parts = self._decrypted_chunks(blob, expected_length, layout)
        return np.concatenate([np.asarray(p, dtype=np.float64) for p in parts])[:length]
