"""Value layouts: how real values sit in a campaign's ciphertexts (one byte in each frame's
header, :mod:`sealfl.he.framed`), including packed BFV's packing widths
(:func:`packed_layout`, ``consortium create --pack-bits/--pack-range``)."""

from __future__ import annotations

from dataclasses import dataclass

from sealfl.he.errors import CiphertextError

__all__ = ["Layout", "PACKED", "WIDE", "LAYOUTS", "PACK_WIDTHS", "DEFAULT_PACK_BITS", "PACK_RANGES",
           "DEFAULT_PACK_RANGE", "PACK_PARTNERS", "packed_layout"]


@dataclass(frozen=True)
class Layout:
    """How real values are laid out in a campaign's ciphertexts.

    Attributes:
        id: the frame header byte (a frame is only checked against the layout its caller expects).
        per_slot: values packed into one integer slot (BFV; CKKS always holds one per slot).
        bits: width of one packed field (bits, including sign; BFV).
        frac_bits: fixed-point fraction bits (BFV: value = integer * 2**-frac_bits).
        clip: values are clipped to ``±clip`` before encryption (None: refused when out of
            range instead, see :attr:`max_abs`).
        max_abs: largest ``|value|`` one partner may encrypt (after clipping).
        stochastic: round to the grid stochastically (unbiased: ``E[q] = value * 2**frac_bits``)
            instead of to the nearest multiple (the narrow packings of :func:`packed_layout`).
    """

    id: int
    per_slot: int
    bits: int
    frac_bits: int
    clip: float | None
    max_abs: float
    stochastic: bool = False

    @property
    def int_max(self) -> int:
        """Largest ``|integer|`` one partner may encrypt: for a stochastic (narrow) packing
        the clip on the grid (``max_abs * 2**frac_bits``), which leaves the room the sum of
        :data:`PACK_PARTNERS` partners' rounding needs; otherwise the field's
        ``2**(bits-1) - 1``."""
        if self.stochastic:
            return int(self.max_abs * 2.0**self.frac_bits)
        return (1 << (self.bits - 1)) - 1


#: model updates (shares ``(n_i/N) w_i``): clipped to ±(8 - 2^-10), Flower SecAgg+'s default
#: clipping range; BFV packs two 27-bit fields per slot at step 2^-23
PACKED = Layout(id=1, per_slot=2, bits=27, frac_bits=23, clip=8.0 - 2.0**-10, max_abs=8.0 - 2.0**-10)
#: statistics ``[n, Σx, Σx²]``: one value per slot, |value| < 2^34 per partner (BFV step 2^-12)
WIDE = Layout(id=2, per_slot=1, bits=53, frac_bits=12, clip=None, max_abs=2.0**34)

#: packing widths a consortium may choose for model updates (``consortium create --pack-bits``):
#: bits per field -> values per slot. 27 is :data:`PACKED` (the default).
PACK_WIDTHS = {27: 2, 18: 3, 13: 4, 10: 5}
DEFAULT_PACK_BITS = 27
#: ranges ``±R`` a narrow packing may hold (``--pack-range``; powers of two, so the grid is exact)
PACK_RANGES = (8, 4, 2, 1)
DEFAULT_PACK_RANGE = 8
#: partners whose stochastic roundings a narrow packing's field has room for (each
#: partner's integer is within ``±int_max``; the sum of K <= 64 stays within the field)
PACK_PARTNERS = 64


def packed_layout(bits: int, value_range: int = DEFAULT_PACK_RANGE) -> Layout:
    """The model-update layout of ``bits``-bit fields holding values in ``±value_range``.

    27 bits (range 8 only) is :data:`PACKED`: two fields per slot, step 2^-23, round to
    nearest, as before the setting existed. A narrower width ``b`` packs ``54 // b`` fields
    per slot (:data:`PACK_WIDTHS`) with ``frac_bits = b - 1 - log2(R)`` (the sign and the
    integer bits of the range ``R`` take the rest) and rounds stochastically; each partner's
    values are clipped to ``R - PACK_PARTNERS * δ`` (``δ = 2**-frac_bits``) so the sum of up
    to 64 partners' rounded shares stays inside the field: ``|Σ q_i| < (R - 64 δ)/δ + 64 =
    2**(b-1)`` (each stochastic rounding moves a value by less than δ, and the shares
    ``(n_i/N) w_i`` of clipped ``w_i`` sum to at most the clip).

    =====  =====  ========  =======  =================  =============
    bits   range  per slot  step δ   per-partner clip   bytes vs 27
    =====  =====  ========  =======  =================  =============
    27     8      2         2^-23    8 - 2^-10          1
    18     8      3         2^-14    8 - 2^-8           2/3
    13     8      4         2^-9     7.875              1/2
    10     8      5         2^-6     7                  2/5
    10     1      5         2^-9     0.875              2/5
    =====  =====  ========  =======  =================  =============

    (any narrow width with any range of :data:`PACK_RANGES`: the step halves each time the
    range halves.)

    Raises:
        CiphertextError: ``bits`` is not one of :data:`PACK_WIDTHS`, ``value_range`` not one
            of :data:`PACK_RANGES`, or 27 bits with a range other than 8 (names the choices).
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in PACK_WIDTHS:
        raise CiphertextError(f"packing width {bits!r} bits is not supported; choose one of "
                              f"{sorted(PACK_WIDTHS, reverse=True)} (bits per packed value)")
    if isinstance(value_range, bool) or not isinstance(value_range, int) or value_range not in PACK_RANGES:
        raise CiphertextError(f"packing range ±{value_range!r} is not supported; choose one of {list(PACK_RANGES)}")
    if bits == DEFAULT_PACK_BITS:
        if value_range != DEFAULT_PACK_RANGE:
            raise CiphertextError(f"the 27-bit packing holds ±8 only (got ±{value_range}); choose a narrower "
                                  "--pack-bits for another range")
        return PACKED
    per_slot = PACK_WIDTHS[bits]
    frac = bits - 1 - (value_range.bit_length() - 1)
    clip = value_range - PACK_PARTNERS * 2.0**-frac
    lid = 32 + 4 * per_slot + value_range.bit_length() - 1  # 44..55: one id per (width, range)
    return Layout(id=lid, per_slot=per_slot, bits=bits, frac_bits=frac, clip=clip, max_abs=clip, stochastic=True)


LAYOUTS = {PACKED.id: PACKED, WIDE.id: WIDE}
LAYOUTS.update({lay.id: lay for lay in (packed_layout(b, r) for b in PACK_WIDTHS if b != DEFAULT_PACK_BITS
                                         for r in PACK_RANGES)})
