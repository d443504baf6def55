"""The round's running sum (sealfl.server.aggregate.RunningSum): summing each update while
it is checked gives the same decrypted sum as adding the frames afterwards, for every
codec, and a refused reply is never added."""

from __future__ import annotations

import numpy as np
import pytest

from sealfl.he.bfv import BFVCodec
from sealfl.he.ckks import CKKSCodec
from sealfl.he.decrypted import update_share
from sealfl.server.aggregate import RunningSum
from sealfl.server.errors import ReplyError
from sealfl.server.validation import ReplyLimits, check_frame, parse_train_reply


@pytest.fixture(scope="module", params=["bfv", "ckks"])
def codecs(request):
    cls = {"bfv": BFVCodec, "ckks": CKKSCodec}[request.param]
    secret = cls.generate()
    return secret, cls.from_bytes(secret.public_context_bytes(), secret.params, secret.context_id)


def _reply(frame: bytes, n: int):
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from sealfl.common import protocol as P

    return RecordDict({P.UPDATE: ArrayRecord({P.UPDATE_CT: Array(P.to_u8(frame))}),
                       P.METRICS: MetricRecord({P.NUM_EXAMPLES: n, P.TRAIN_LOSS: 0.5}),
                       P.PARTNER: ConfigRecord({P.NAME: "p"})})


def test_kind_running_sum_equals_numpy_and_skips_refused_replies(codecs):
    secret, public = codecs
    length, ns = 9000, [30, 50, 20]
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.5, (3, length))
    frames = [secret.encrypt(update_share(w[i], ns[i], sum(ns), secret.WEIGHTING)) for i in range(3)]
    running = RunningSum(public, length)
    limits = ReplyLimits()
    for i, f in enumerate(frames):
        r = parse_train_reply(_reply(f, ns[i]), codec=public, length=length, limits=limits, declared_n=ns[i],
                              signed=False, running=running)
        # added into the sum, its bytes are not kept (one sum per round, not one update per partner)
        assert (r.frame, r.chunks, r.nbytes, r.n) == (b"", [], len(f), ns[i])
    kept = parse_train_reply(_reply(frames[0], ns[0]), codec=public, length=length, limits=limits,
                             declared_n=ns[0], signed=False)
    assert kept.frame == frames[0] and kept.nbytes == len(frames[0]) and kept.chunks
    # refused replies: a wrong count, then a corrupted frame -- neither may reach the sum
    with pytest.raises(ReplyError):
        parse_train_reply(_reply(frames[0], 99), codec=public, length=length, limits=limits, declared_n=ns[0],
                          signed=False, running=running)
    with pytest.raises(ReplyError):
        parse_train_reply(_reply(frames[0][:-5], ns[0]), codec=public, length=length, limits=limits,
                          declared_n=ns[0], signed=False, running=running)
    assert running.partners == 3
    got = secret.decrypt(running.frame(), length)
    shares = np.stack([update_share(w[i], ns[i], sum(ns), secret.WEIGHTING) for i in range(3)])
    np.testing.assert_allclose(got, shares.sum(axis=0), atol=3 * 2.0**-20 * max(ns))
    assert np.max(np.abs(got - shares.sum(axis=0))) < 1e-3 * np.max(np.abs(shares.sum(axis=0)))


def test_kind_empty_running_sum_is_an_error(codecs):
    from sealfl.he.errors import CiphertextError

    with pytest.raises(CiphertextError, match="no valid"):
        RunningSum(codecs[1], 4).frame()
    parsed: list = []
    check_frame(codecs[1], codecs[0].encrypt(np.ones(4)), 4, "f", parsed=parsed)
    assert len(parsed) == 1
