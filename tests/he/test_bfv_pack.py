"""Narrow packed-BFV widths (``consortium create --pack-bits/--pack-range``,
sealfl.he.layouts.packed_layout): round trips per width, unbiased stochastic rounding,
the per-partner limit at ± 1, sums of up to 64 partners within the documented bound,
hostile settings refused, and the 27-bit default unchanged.

The expected steps, clips and values per slot below are written from the table in
``packed_layout``'s docstring (docs/encryption.md), not read from the code under test."""

from __future__ import annotations

import numpy as np
import pytest

from sealfl.he.bfv import PACKED, BFVCodec, BFVParams, quantize
from sealfl.he.codecs import params_for
from sealfl.he.dp import seeded_rng
from sealfl.he.errors import CiphertextError
from sealfl.he.framed import packed_layout
from tests.support.he import sum_frames

#: (bits, range) -> (values per slot, step, per-partner clip), from the documented table
TABLE = {(27, 8): (2, 2.0**-23, 8 - 2.0**-10), (18, 8): (3, 2.0**-14, 8 - 2.0**-8), (13, 8): (4, 2.0**-9, 7.875),
         (10, 8): (5, 2.0**-6, 7.0), (10, 1): (5, 2.0**-9, 0.875), (13, 2): (4, 2.0**-11, 2 - 64 * 2.0**-11)}


@pytest.fixture(scope="module")
def secret27():
    return BFVCodec.generate()


def _codec(secret27, bits, value_range):
    """A codec of another packing over the same key (key generation is the slow part)."""
    return BFVCodec.from_bytes(secret27.secret_context_bytes(), BFVParams(pack_bits=bits, pack_range=value_range),
                               secret27.context_id)


@pytest.mark.parametrize("packing", sorted(TABLE))
def test_kind_round_trip_lands_on_a_neighbouring_grid_point(secret27, packing):
    per_slot, step, clip = TABLE[packing]
    codec = _codec(secret27, *packing)
    lay = codec.params.update_layout
    assert (lay.per_slot, 2.0**-lay.frac_bits, lay.clip) == (per_slot, step, clip)
    rng = np.random.default_rng(sum(packing))
    v = np.concatenate([rng.uniform(-clip, clip, 20_000), [clip, -clip, 0.0, step, -step]])
    got = codec.decrypt(codec.encrypt(v, rng=seeded_rng(1)), v.size)
    lo, hi = np.floor(v / step) * step, np.ceil(v / step) * step
    assert np.all((got == lo) | (got == hi))  # one of the two grid points around each value
    assert np.all(np.abs(got - v) < step)
    assert got[-5:].tolist() == [clip, -clip, 0.0, step, -step]  # grid points travel exactly
    # chunks carry per_slot values per slot: 4096 * per_slot values per ciphertext
    assert codec.params.n_chunks(4096 * per_slot, PACKED) == 1 and codec.params.n_chunks(4096 * per_slot + 1,
                                                                                         PACKED) == 2


def test_kind_fewer_bits_mean_proportionally_fewer_bytes_at_lora_size(secret27):
    v = np.random.default_rng(0).uniform(-0.04, 0.04, 460_800)
    sizes = {b: len(_codec(secret27, b, 8 if b != 10 else 1).encrypt(v, rng=seeded_rng(0))) for b in (27, 13, 10)}
    fp32 = 4 * v.size
    assert sizes[27] / fp32 == pytest.approx(1.053, abs=0.01)  # today's P1.sealfl
    assert sizes[13] / fp32 < 0.55 and sizes[10] / fp32 < 0.45  # 4 and 5 values per slot


@pytest.mark.parametrize("frac", [0.0, 0.03, 0.5, 0.97])
def test_kind_stochastic_rounding_is_unbiased_over_many_draws(frac):
    """E[q] = x: the mean of 400,000 rounded copies of x lies within 5 standard errors of
    x (standard error sqrt(p (1 - p) / n) steps, p the fraction below the grid)."""
    lay = packed_layout(10, 1)
    step = 2.0**-9
    x = (37 + frac) * step
    n = 400_000
    q = quantize(np.full(n, x), lay, seeded_rng(7))
    assert set(np.unique(q).tolist()) <= {37, 38}
    se = np.sqrt(frac * (1 - frac) / n)
    assert abs(q.mean() - (37 + frac)) <= 5 * se + 1e-12
    if 0 < frac < 0.5:  # round-to-nearest would give 37 every time
        assert np.count_nonzero(q == 38) > 0


def test_kind_encrypted_mean_of_a_constant_is_the_constant(secret27):
    """End to end: the decrypted sum of 8 partners' encryptions of the same off-grid
    vector, averaged over its 40,000 entries, equals 8x within 5 standard errors."""
    codec = _codec(secret27, 13, 8)
    step, x, k, n = 2.0**-9, 0.1234, 8, 40_000
    frames = [codec.encrypt(np.full(n, x), rng=seeded_rng(100 + i)) for i in range(k)]
    got = codec.decrypt(sum_frames(codec, frames, n), n)
    p = x / step - np.floor(x / step)
    se = step * np.sqrt(k * p * (1 - p) / n)
    assert abs(got.mean() - k * x) <= 5 * se


@pytest.mark.parametrize("packing,limit", [((13, 8), 4032), ((10, 1), 448), ((18, 8), 131_008), ((10, 8), 448)])
def test_kind_per_partner_integer_limit_is_refused_just_above_it(secret27, packing, limit):
    codec = _codec(secret27, *packing)
    step = TABLE[packing][1]
    for edge in (limit, -limit, limit - 1):
        got = codec.decrypt(codec.encrypt_integers(np.array([edge, 1], dtype=np.int64)), 2)
        assert got.tolist() == [edge * step, step]
    for over in (limit + 1, -(limit + 1)):
        with pytest.raises(CiphertextError, match=f"per-partner range ±{limit}"):
            codec.encrypt_integers(np.array([0, over], dtype=np.int64))


def test_kind_27_bit_integer_limit_is_the_field_as_before(secret27):
    assert secret27.decrypt(secret27.encrypt_integers(np.array([2**26 - 1])), 1)[0] == (2**26 - 1) * 2.0**-23
    with pytest.raises(CiphertextError, match="27-bit field"):
        secret27.encrypt_integers(np.array([2**26]))


@pytest.mark.parametrize("packing", [(13, 8), (10, 1), (10, 8)])
@pytest.mark.parametrize("k", [2, 64])
def test_kind_sum_of_k_partners_at_the_clip_never_wraps_and_errs_below_k_steps(secret27, packing, k):
    """Worst case: every partner's share is at the clip side of the range, the weights sum
    to 1 (the shares then sum to the clip), and the frames share slots: the sum of K <= 64
    stochastically rounded shares stays within K steps of the true sum, with its sign."""
    _per, step, clip = TABLE[packing]
    codec = _codec(secret27, *packing)
    w = np.full(k, 1.0 / k)
    v = np.array([clip, -clip, clip * 0.999, 0.3 * clip])
    shares = [wi * v for wi in w]
    frames = [codec.encrypt(s, rng=seeded_rng(i)) for i, s in enumerate(shares)]
    got = codec.decrypt(sum_frames(codec, frames, v.size), v.size)
    assert np.all(np.abs(got - v) < k * step)
    assert np.all(np.sign(got) == np.sign(v))
    assert np.all(np.abs(got) < clip + k * step)


@pytest.mark.parametrize("bits", [0, 1, 9, 11, 12, 26, 28, 54, 64, -13, True, 13.0, "13", None])
def test_kind_hostile_widths_are_refused(bits):
    with pytest.raises(CiphertextError, match="packing width"):
        BFVParams(pack_bits=bits)


@pytest.mark.parametrize("value_range", [0, 3, 16, -8, True, 8.0, "8"])
def test_kind_hostile_ranges_are_refused(value_range):
    with pytest.raises(CiphertextError, match="packing range"):
        BFVParams(pack_bits=13, pack_range=value_range)


@pytest.mark.parametrize("extra,match", [({"pack_bits": "13"}, "must be an integer"),
                                         ({"pack_bits": 13.0}, "must be an integer"),
                                         ({"pack_bits": True}, "must be an integer"),
                                         ({"pack_bits": 12}, "packing width"),
                                         ({"pack_bits": 28}, "must be in 10..27"),
                                         ({"pack_bits": 13, "pack_range": 3}, "packing range"),
                                         ({"pack_range": 1}, "27-bit packing holds ±8 only")])
def test_kind_hostile_parameter_files_are_refused(extra, match):
    with pytest.raises(CiphertextError, match=match):
        BFVParams.from_dict({**BFVParams().to_dict(), **extra})


def test_kind_packing_applies_to_bfv_only():
    assert params_for("bfv", 13).pack_bits == 13 and params_for("bfv", 10, 1).update_layout.frac_bits == 9
    with pytest.raises(CiphertextError, match="use --he bfv"):
        params_for("ckks", 13)


def test_kind_default_is_unchanged_and_widths_do_not_mix(secret27):
    d = BFVParams().to_dict()
    assert "pack_bits" not in d and "pack_range" not in d  # consortium files as before
    assert BFVParams.from_dict(d) == BFVParams() and BFVParams().update_layout is PACKED
    narrow = BFVParams(pack_bits=13)
    assert BFVParams.from_dict(narrow.to_dict()) == narrow
    # a 27-bit frame is refused by a 13-bit reader of the same key (and back), never misread
    codec13 = _codec(secret27, 13, 8)
    with pytest.raises(CiphertextError, match="value layout"):
        codec13.decrypt(secret27.encrypt(np.ones(3)), 3)
    with pytest.raises(CiphertextError, match="value layout"):
        secret27.decrypt(codec13.encrypt(np.ones(3)), 3)
    # the default still rounds to nearest: 1,000 copies of 5.3 steps all come back as 5 steps
    got = secret27.decrypt(secret27.encrypt(np.full(1000, 5.3 * 2.0**-23)), 1000)
    assert np.all(got == 5 * 2.0**-23)
