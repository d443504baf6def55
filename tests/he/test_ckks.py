"""CKKS codec (the `--he ckks` option): weighted FedAvg under encryption equals plaintext FedAvg;
the aggregator cannot decrypt; bad frames are refused (issue 5's rules, on the framing
shared with the BFV codec)."""

import numpy as np
import pytest

from sealfl.he.ckks import MAX_ABS, CKKSCodec, CKKSParams
from sealfl.he.decrypted import DecryptBounds, open_model, share_to_sum, update_share
from sealfl.he.errors import CiphertextError, SecretKeyMissingError
from sealfl.he.framed import HEADER, PACKED, WIDE
from sealfl.server.aggregate import sum_chunks, validate_frames
from tests.support.he import sum_frames


@pytest.fixture(scope="module")
def codecs():
    secret = CKKSCodec.generate()
    public = CKKSCodec.from_bytes(secret.public_context_bytes(), secret.params, secret.context_id)
    return secret, public


def test_encrypted_weighted_fedavg_matches_numpy(codecs):
    secret, public = codecs
    rng = np.random.default_rng(7)
    length = 5000  # spans two ciphertext chunks (4096 slots each)
    models = [rng.normal(0, 1.5, length) for _ in range(4)]
    counts = np.array([201.0, 172.0, 31.0, 86.0])
    frames = {f"p{i}": secret.encrypt(m * n) for i, (m, n) in enumerate(zip(models, counts))}
    valid = validate_frames(public, frames, length)
    assert not valid.rejected
    agg = sum_chunks(public, valid, length)
    got = secret.decrypt(agg, length) / counts.sum()
    # independent expected value: numpy's weighted average
    expected = np.average(np.stack(models), axis=0, weights=counts)
    assert np.max(np.abs(got - expected)) <= 1e-6


def test_aggregator_context_cannot_decrypt(codecs):
    secret, public = codecs
    assert secret.has_secret_key and not public.has_secret_key
    blob = secret.encrypt(np.arange(10.0))
    with pytest.raises(SecretKeyMissingError):
        public.decrypt(blob)
    with pytest.raises(SecretKeyMissingError):  # updates are encrypted with the secret key
        public.encrypt(np.arange(10.0))
    # and the library itself refuses: the aggregator's context yields no secret key
    public.parse(blob)
    with pytest.raises(ValueError, match="Secret key"):
        public._ctx.secret_key()


def test_public_context_bytes_hold_no_secret(codecs):
    secret, _ = codecs
    reloaded = CKKSCodec.from_bytes(secret.public_context_bytes(), secret.params, secret.context_id)
    assert not reloaded.has_secret_key
    with pytest.raises(SecretKeyMissingError):
        reloaded.secret_context_bytes()


def test_bad_frames_are_rejected_by_name(codecs):
    secret, public = codecs
    good = secret.encrypt(np.ones(14))
    other = CKKSCodec.generate(CKKSParams(4096, (40, 20, 40), 21))
    frames = {
        "good": good,
        "garbage": b"\x00" * 300,
        "wrong-length": secret.encrypt(np.ones(13)),
        "truncated": good[:-10],
        "other-campaign": other.encrypt(np.ones(14)),
        # right header (this campaign's id) but the payload is another context's ciphertext
        "other-params": public.frame(14, other.split(other.encrypt(np.ones(14)))[1]),
    }
    # (a flipped bit inside a coefficient still parses: CKKS ciphertexts are not
    # authenticated; integrity of a partner's reply is the transport's job -- TLS and
    # SuperNode authentication)
    v = validate_frames(public, frames, 14)
    assert set(v.chunks) == {"good"}
    assert set(v.rejected) == set(frames) - {"good"}
    assert "expected 14" in v.rejected["wrong-length"]
    assert "context" in v.rejected["other-campaign"]


@pytest.mark.parametrize("bad", [[1.0, np.nan], [np.inf], [MAX_ABS], [[1.0, 2.0]]])
def test_kind_encrypt_refuses_what_ckks_cannot_carry(codecs, bad):
    secret, _ = codecs
    with pytest.raises(CiphertextError):
        secret.encrypt(np.array(bad))


def test_kind_statistics_never_pass_for_an_update(codecs):
    secret, public = codecs
    stats = secret.encrypt(np.array([700.0, 1e5, 3e7]), WIDE)
    with pytest.raises(CiphertextError, match="layout 2, expected 1"):
        public.split(stats, 3, PACKED)
    np.testing.assert_allclose(secret.decrypt(stats, 3, WIDE), [700.0, 1e5, 3e7], atol=1e-6)
    with pytest.raises(CiphertextError, match="beyond"):
        secret.encrypt(np.array([2.0**34]), WIDE)


def test_kind_count_weighting_through_the_key_holder_path_equals_numpy(codecs):
    """What partners encrypt (n_i w_i, the codec's "count" weighting) and what key holders
    publish (rounded to the parameter grid) equal NumPy's weighted average to the grid."""
    secret, public = codecs
    assert secret.WEIGHTING == "count"
    rng = np.random.default_rng(11)
    models = [rng.normal(0, 0.8, 300) for _ in range(5)]
    counts = [97, 301, 12, 55, 160]
    total = sum(counts)
    frames = {f"p{i}": secret.encrypt(update_share(m, n, total, secret.WEIGHTING))
              for i, (m, n) in enumerate(zip(models, counts))}
    summed = sum_chunks(public, validate_frames(public, frames, 300), 300)
    got = open_model(share_to_sum(secret.decrypt(summed, 300), total, secret.WEIGHTING), total, DecryptBounds())
    expected = np.average(np.stack(models), axis=0, weights=counts)
    assert np.max(np.abs(got - expected)) <= 2.0**-20


def test_sum_of_nothing_is_an_error(codecs):
    _, public = codecs
    with pytest.raises(CiphertextError):
        sum_chunks(public, validate_frames(public, {}, 3), 3)


# ---- what summation needs, checked per partner before anything is added ----------------

def _rescaled(secret, values, scale_bits):
    from tests.support.faults_partner import rescale_chunk

    length, chunks = secret.split(secret.encrypt(np.asarray(values)))
    return secret.frame(length, [rescale_chunk(secret, c, scale_bits) for c in chunks])


def _lower_level(secret, values):
    import tenseal as ts

    vec = ts.ckks_vector(secret._ctx, list(values)) * ([1.0] * len(values))  # plain multiply + rescale: one prime less
    return secret.frame(len(values), [secret._io.save(vec.ciphertext()[0])])


def _padded(secret, values, pad):
    _, (chunk,) = secret.split(secret.encrypt(np.asarray(values)))
    field = bytes([(15 << 3) | 2])  # what smuggled an unknown protobuf field past TenSEAL's parser
    n = pad
    while True:
        b, n = n & 0x7F, n >> 7
        field += bytes([b | 0x80]) if n else bytes([b])
        if not n:
            break
    return secret.frame(len(values), [chunk + field + bytes(pad)])


def test_kind_ciphertexts_that_cannot_be_added_are_refused_by_partner(codecs):
    secret, public = codecs
    ones = np.ones(14)
    frames = {
        "good": secret.encrypt(ones),
        "scale-2^30": _rescaled(secret, ones, 30),
        "lower-level": _lower_level(secret, ones),
        "padded-64MiB": _padded(secret, ones, 64 << 20),
        "padded-10B": _padded(secret, ones, 10),
    }
    v = validate_frames(public, frames, 14)
    assert set(v.chunks) == {"good"}
    assert "scale 2^30.00, expected 2^40" in v.rejected["scale-2^30"]
    assert "another modulus level (1 primes, expected 2)" in v.rejected["lower-level"]
    assert "exceeds the bound" in v.rejected["padded-64MiB"]
    assert "not in canonical form" in v.rejected["padded-10B"]
    # without the checks SEAL itself fails the sum (the round used to die here)
    import tenseal.sealapi as sealapi

    good, bad = (public._io.load_ciphertext(public._seal, secret.split(frames[k])[1][0]) for k in ("good", "scale-2^30"))
    with pytest.raises(ValueError, match="scale mismatch"):
        public._evaluator.add(good, bad, sealapi.Ciphertext())


def test_kind_validated_frames_always_add(codecs):
    secret, public = codecs
    rng = np.random.default_rng(3)
    frames = {f"p{i}": secret.encrypt(rng.normal(0, 100, 5000)) for i in range(3)}
    frames.update(bad=_rescaled(secret, np.ones(5000)[:4096], 30))
    v = validate_frames(public, frames, 5000)
    assert set(v.rejected) == {"bad"}
    got = secret.decrypt(sum_chunks(public, v, 5000), 5000)
    np.testing.assert_allclose(got, sum(secret.decrypt(frames[k], 5000) for k in v.chunks), atol=1e-6)


@pytest.mark.parametrize("params", [CKKSParams(), CKKSParams(4096, (40, 20, 40), 21), CKKSParams(8192, (60, 40, 40, 60), 40)])
def test_frame_size_bound_holds_for_real_ciphertexts(params):
    codec = CKKSCodec.generate(params)
    for length in (1, params.slots, params.slots + 1):
        for _ in range(3):
            blob = codec.encrypt(np.random.default_rng(length).normal(0, 1e3, length))
            assert len(blob) <= params.max_frame_bytes(length)
            assert all(len(c) <= params.max_chunk_bytes for c in codec.split(blob)[1])
    # the documented formula: 2 polynomials x N x data primes x 8 bytes, zstd's n/256, 4096 for headers
    raw = 2 * params.poly_modulus_degree * (len(params.coeff_mod_bit_sizes) - 1) * 8
    assert params.max_chunk_bytes == raw + raw // 256 + 4096


def test_kind_oversized_frame_is_refused_before_any_chunk_is_parsed(codecs):
    secret, public = codecs
    blob = secret.encrypt(np.ones(14))
    # a chunk header announcing 1 GiB, with the bytes absent: refused by size, not "truncated"
    hdr = blob[:HEADER.size] + (1 << 30).to_bytes(4, "little")
    with pytest.raises(CiphertextError, match="more than a ciphertext of these parameters can be"):
        public.split(hdr, 14)


def test_kind_partners_send_seeded_ciphertexts(codecs):
    """A partner's chunk carries c1 as SEAL's seed: about half of an expanded chunk (the
    aggregator's sum), whose size follows from the parameters -- 2 polynomials x N x the
    data primes' 60 + 40 bits, which zstd cannot shrink much."""
    secret, public = codecs
    frames = [secret.encrypt(np.full(4096, 0.25)) for _ in range(2)]
    assert frames[0] != frames[1]  # fresh seed and error each time
    _, (part,) = public.split(frames[0], 4096)
    _, (summed,) = public.split(sum_frames(public, frames, 4096), 4096)
    expanded_bits = 2 * secret.params.poly_modulus_degree * (60 + 40)
    assert len(summed) > 0.85 * expanded_bits / 8
    assert len(part) < 0.55 * len(summed)
    np.testing.assert_allclose(secret.decrypt(sum_frames(public, frames, 4096), 4096), 0.5, atol=1e-6)
