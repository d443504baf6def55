"""The packed BFV codec (sealfl.he.bfv): exact sums vs NumPy, and issue 5's rules on
sizes, layouts, canonical bytes and fresh-ciphertext shape for frames from outside."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sealfl.he.bfv import MAGIC, PACKED, WIDE, BFVCodec, BFVParams, pack, quantize, unpack
from sealfl.he.errors import CiphertextError, SecretKeyMissingError
from tests.support.faults_partner import rescale_chunk
from tests.support.he import sum_frames

#: Flower SecAgg+ defaults: clipping range 8, quantization range 2^22 -> step 16 / 2^22
SECAGG_STEP = 16.0 / 2**22


@pytest.fixture(scope="module")
def codecs():
    secret = BFVCodec.generate()
    public = BFVCodec.from_bytes(secret.public_context_bytes(), secret.params, secret.context_id)
    return secret, public


def test_kind_aggregator_context_holds_no_keys(codecs):
    secret, public = codecs
    assert not public.has_secret_key
    assert len(secret.public_context_bytes()) < 1024  # parameters only: no public, relin or Galois key
    blob = secret.encrypt(np.ones(4))
    with pytest.raises(SecretKeyMissingError):
        public.decrypt(blob, 4)
    with pytest.raises(SecretKeyMissingError):
        public.encrypt(np.ones(4))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(2, 64), length=st.integers(1, 9000), seed=st.integers(0, 2**32 - 1),
       spread=st.sampled_from([1e-3, 1.0, 7.9]))
def test_kind_weighted_sum_matches_numpy_within_secagg_step(codecs, k, length, seed, spread):
    """Random updates of 2-64 partners pre-scaled by n_i / N: the encrypted sum equals
    NumPy's sum of the same (clipped) values within K * 2^-24 <= the SecAgg+ step."""
    secret, public = codecs
    rng = np.random.default_rng(seed)
    w = np.clip(rng.normal(0, spread, (k, length)), -7.99, 7.99)
    n = rng.integers(1, 1000, k)
    scaled = w * (n / n.sum())[:, None]
    frames = [secret.encrypt(v) for v in scaled]
    got = secret.decrypt(sum_frames(public, frames, length), length)
    err = np.max(np.abs(got - scaled.sum(axis=0)))
    assert err <= k * 2.0**-24 < SECAGG_STEP * 1.0001
    assert err < SECAGG_STEP


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-(2**26) + 1, 2**26 - 1), min_size=1, max_size=50))
def test_kind_packing_is_lossless_for_every_field_value(q):
    q = np.asarray(q, dtype=np.int64)
    assert np.array_equal(unpack(pack(q, PACKED), PACKED, q.size), q)


def test_kind_wide_layout_carries_statistics_exactly(codecs):
    secret, public = codecs
    sums = [np.array([200.0, 1.2e4, 3.1e7]), np.array([123.0, -5.5e3, 2.25e7])]
    got = secret.decrypt(sum_frames(public, [secret.encrypt(s, WIDE) for s in sums], 3, WIDE), 3, WIDE)
    assert np.array_equal(got, np.rint(np.ldexp(sums[0] + sums[1], 12)) / 2**12)
    with pytest.raises(CiphertextError, match="beyond this layout's range"):
        secret.encrypt(np.array([2.0**35]), WIDE)


def test_kind_values_beyond_clip_are_clipped(codecs):
    secret, _ = codecs
    got = secret.decrypt(secret.encrypt(np.array([100.0, -100.0, 1.5])), 3)
    assert np.array_equal(got, [PACKED.clip, -PACKED.clip, 1.5])


@pytest.mark.parametrize("bad", [np.array([np.nan]), np.array([np.inf]), np.ones((2, 2))])
def test_kind_non_finite_or_non_vector_is_refused(codecs, bad):
    with pytest.raises(CiphertextError):
        codecs[0].encrypt(bad)


def _frames(secret: BFVCodec, other: BFVCodec):
    good = secret.encrypt(np.ones(14))
    _, (chunk,) = secret.split(good, 14)
    ckks = __import__("tenseal")
    ck_ctx = ckks.context(ckks.SCHEME_TYPE.CKKS, poly_modulus_degree=8192, coeff_mod_bit_sizes=[60, 40, 40])
    ck_ctx.global_scale = 2.0**40
    return {
        "padded-inside-chunk": secret.frame(14, [chunk + b"\0" * 64]),
        "trailing-bytes": good + b"\0",
        "huge": good + b"\0" * (secret.params.max_frame_bytes(14) + 1),
        "wrong-length": secret.encrypt(np.ones(13)),
        "wrong-layout": secret.encrypt(np.ones(14), WIDE),
        "other-campaign": other.encrypt(np.ones(14)),
        "other-key-same-id": secret.frame(14, other.split(other.encrypt(np.ones(14)))[1]),
        "bad-magic": b"XXXX" + good[4:],
        "truncated": good[:-10],
        "ckks-chunk": secret.frame(14, [ckks.ckks_vector(ck_ctx, [1.0] * 14).serialize()]),
        "garbage-chunk": secret.frame(14, [b"\x01" * 500]),
        "two-chunks": secret.frame(14, [chunk, chunk]),
        "scale-2^30": secret.frame(14, [rescale_chunk(secret, chunk, 30)]),
    }


def test_kind_every_malformed_frame_is_refused_before_it_counts(codecs):
    """Issue 5's kinds under the new codec: size before parsing, header, canonical bytes,
    fresh shape. (A ciphertext under another secret key but this campaign's parameters
    and id cannot be told apart without the key: it decrypts to noise, which the key
    holders' bounds catch -- as with CKKS.)"""
    secret, public = codecs
    other = BFVCodec.generate()
    for name, blob in _frames(secret, other).items():
        if name == "other-key-same-id":
            public.parse(blob, 14)  # same parameters: addable; content is the key holders' check
            continue
        with pytest.raises(CiphertextError):
            public.parse(blob, 14)
            pytest.fail(f"accepted the {name} frame")


def test_kind_oversized_frame_is_refused_unparsed(codecs, monkeypatch):
    secret, public = codecs
    blob = secret.encrypt(np.ones(14)) + b"\0" * (64 << 20)
    from sealfl.he.sealio import SealIO

    def boom(*a, **k):  # the parser must never be reached
        raise AssertionError("parsed an oversized frame")

    monkeypatch.setattr(SealIO, "load_ciphertext", boom)
    with pytest.raises(CiphertextError, match="exceeds the bound"):
        public.parse(blob, 14)


def test_kind_frame_bound_covers_fresh_frames(codecs):
    secret, _ = codecs
    for length in (1, 14, 8192, 8193, 20000):
        blob = secret.encrypt(np.zeros(length))
        assert len(blob) <= secret.params.max_frame_bytes(length)
        assert blob[:4] == MAGIC


def test_kind_context_with_other_parameters_is_refused(codecs):
    other = BFVCodec.generate(BFVParams(coeff_mod_bit_sizes=(36, 36, 37)))
    with pytest.raises(CiphertextError, match="differ"):
        BFVCodec.from_bytes(other.public_context_bytes(), BFVParams(), other.context_id)
    with pytest.raises(CiphertextError):
        BFVCodec.from_bytes(b"not a context", BFVParams(), b"\0" * 32)
    with pytest.raises(CiphertextError):
        BFVParams.from_dict({"scheme": "CKKS", "poly_modulus_degree": 8192})


def test_kind_quantisation_rounds_to_nearest_step():
    q = quantize(np.array([2.0**-24, 3 * 2.0**-24, -(2.0**-23)]), PACKED)
    assert list(q) == [0, 2, -1]  # half to even, like np.rint


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.binary(min_size=1, max_size=64), where=st.sampled_from(["end", "cut", "size", "compr", "magic", "reserved"]))
def test_kind_chunk_outside_one_whole_seal_object_is_refused_before_parsing(codecs, extra, where, monkeypatch):
    from sealfl.he.sealio import SEAL_HEADER, SealIO, header_problem

    secret, public = codecs
    _, (chunk,) = secret.split(secret.encrypt(np.ones(14)), 14)
    assert header_problem(chunk) is None
    fields = list(SEAL_HEADER.unpack_from(chunk))
    if where == "size":
        fields[6] += len(extra)  # header claims more than the chunk holds
    elif where == "compr":
        fields[4] = extra[0] if extra[0] != 2 else 0  # no compression / an unknown mode
    elif where == "magic":
        fields[0] = 0xA15E ^ (extra[0] | 1)
    elif where == "reserved":
        fields[5] = extra[0] | 1
    head = SEAL_HEADER.pack(*fields)
    bad = {"end": chunk + extra, "cut": chunk[:max(1, len(chunk) - len(extra))]}.get(where, head + chunk[16:])
    assert header_problem(bad) is not None
    monkeypatch.setattr(SealIO, "load_ciphertext", lambda *a: pytest.fail("parsed a non-canonical chunk"))
    with pytest.raises(CiphertextError, match="canonical form"):
        public.load_chunks([bad], 14)


def test_kind_partners_send_seeded_ciphertexts_within_p1(codecs):
    """Issue 9's P1 at LoRA size (460,800 values): a partner's frame is at most 2x the
    fp32 bytes. A fresh symmetric ciphertext is (c0, c1) with c1 uniform; sending c1's seed
    halves it, so the aggregator's (expanded) sum chunk is about twice a partner's chunk.
    Two encryptions of the same vector differ (fresh seed and error each time)."""
    secret, public = codecs
    n = 460_800
    v = np.random.default_rng(1).normal(0, 0.01, n)
    frames = [secret.encrypt(v), secret.encrypt(v)]
    assert len(frames[0]) <= 2 * 4 * n
    assert frames[0] != frames[1]
    _, part = public.split(frames[0], n)
    _, summed = public.split(sum_frames(public, frames, n), n)
    assert len(summed[0]) > 1.8 * len(part[0])
    # expanded size from the parameters: 2 polynomials x N x 2 primes x 32-bit residues, ~zstd-packed
    assert len(summed[0]) > 2 * 4096 * 2 * 4
    np.testing.assert_allclose(secret.decrypt(sum_frames(public, frames, n), n), 2 * v, atol=2 * 2.0**-24)


def test_kind_honest_weights_beyond_the_range_never_wrap_the_sum(codecs):
    """Weights |w| >= 8 (e.g. 9 in every one of 4 equal partners) are clipped before the
    shares are made, so the packed sum cannot wrap (four shares of 2.25 used to decrypt as
    -7). Expected: NumPy's weighted average of the clipped weights."""
    from sealfl.he.decrypted import update_share

    secret, public = codecs
    w = np.array([[9.0, 0.1, -9.0, 7.99, 100.0], [9.0, 0.3, -9.0, 7.99, -3.0],
                  [9.0, 0.1, -9.0, 7.99, 2.0], [9.0, 0.5, -9.0, 7.99, 1e6]])
    n = [10, 20, 30, 40]
    frames = [secret.encrypt(update_share(w[i], n[i], sum(n), secret.WEIGHTING)) for i in range(4)]
    got = secret.decrypt(sum_frames(public, frames, 5), 5)
    expected = np.average(np.clip(w, -PACKED.clip, PACKED.clip), axis=0, weights=n)
    assert np.max(np.abs(got - expected)) <= 4 * 2.0**-24
    assert got[0] > 7.9 and got[2] < -7.9  # not wrapped to the other sign


@pytest.mark.parametrize("bad", [np.array([1 + 2j]), np.array(["1", "2"]), np.array([object()])])
def test_kind_non_real_input_is_refused_not_coerced(codecs, bad):
    from sealfl.he.ckks import CKKSCodec

    with pytest.raises(CiphertextError, match="real numbers"):
        codecs[0].encrypt(bad)
    with pytest.raises(CiphertextError, match="real numbers"):
        CKKSCodec.generate().encrypt(bad)


def test_kind_chunks_outside_their_frame_are_refused(codecs):
    secret, public = codecs
    _, chunks = secret.split(secret.encrypt(np.ones(14)), 14)
    for length, first, extra in ((-5, 0, 0), (14, -1, 0), (14, 1, 0), (14, 0, 1)):
        with pytest.raises(CiphertextError, match="do not belong"):
            public.load_chunks(chunks * (1 + extra), length, first=first)
    with pytest.raises(CiphertextError, match="u32"):
        secret.frame(-1, chunks)
    with pytest.raises(CiphertextError, match="u32"):
        secret.frame(2**32, chunks)
