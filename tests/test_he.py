"""CKKS codec: weighted FedAvg under encryption equals plaintext FedAvg; the aggregator
cannot decrypt; bad frames are refused."""

import numpy as np
import pytest

from sealfl.common.errors import CiphertextError, SecretKeyMissingError
from sealfl.common.he import CKKSCodec, CKKSParams
from sealfl.server.aggregate import sum_chunks, validate_frames


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
    # and the library itself refuses: TenSEAL raises on decrypt without a secret key
    (vec,) = public.parse(blob)
    with pytest.raises(ValueError, match="secret"):
        vec.decrypt()


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


def test_encrypt_refuses_nan(codecs):
    secret, _ = codecs
    with pytest.raises(ValueError):
        secret.encrypt(np.array([1.0, np.nan]))


def test_sum_of_nothing_is_an_error(codecs):
    _, public = codecs
    with pytest.raises(CiphertextError):
        sum_chunks(public, validate_frames(public, {}, 3), 3)
