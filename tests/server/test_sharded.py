"""Sharded ciphertext sums (sealfl.server.sharded): the same bytes as the single-process
running sum, for both codecs; a reply refused in any chunk range counts in none."""

from __future__ import annotations

import numpy as np
import pytest

from sealfl.he.bfv import BFVCodec
from sealfl.he.ckks import CKKSCodec
from sealfl.he.decrypted import update_share
from sealfl.he.errors import CiphertextError
from sealfl.server.aggregate import RunningSum
from sealfl.server.sharded import RangeSum, _range_task, chunk_ranges, merge_ranges, shard_count, sharded_sum

LENGTH = {"bfv": 40_000, "ckks": 20_000}  # 5 BFV chunks (8,192 values each), 5 CKKS chunks (4,096)
NS = [30, 50, 20, 40]


def local_run(calls):
    """The tasks' own function, run here in order (the Ray runner is tested on a cluster)."""
    return [_range_task(*c) for c in calls]


@pytest.fixture(scope="module", params=["bfv", "ckks"])
def case(request):
    cls = {"bfv": BFVCodec, "ckks": CKKSCodec}[request.param]
    secret = cls.generate()
    public = cls.from_bytes(secret.public_context_bytes(), secret.params, secret.context_id)
    length = LENGTH[request.param]
    w = np.random.default_rng(5).normal(0, 0.5, (len(NS), length))
    frames = {f"p{i}": secret.encrypt(update_share(w[i], NS[i], sum(NS), secret.WEIGHTING)) for i in range(len(NS))}
    return secret, public, length, frames


def _running(public, length, frames) -> bytes:
    rs = RunningSum(public, length)
    for f in frames:
        n, chunks = public.split(f, length)
        rs.add(public.load_chunks(chunks, n))
    return rs.frame()


def _split(public, length, frames: dict) -> dict:
    return {p: public.split(f, length)[1] for p, f in frames.items()}


@pytest.mark.parametrize("shards", [2, 3, 5, 9])
def test_sharded_sum_is_the_running_sum_byte_for_byte(case, shards):
    _, public, length, frames = case
    split = _split(public, length, frames)
    assert len(next(iter(split.values()))) == 5
    want = _running(public, length, frames.values())
    got, accepted, refused = sharded_sum(public, split, length, shards, run=local_run)
    assert got == want and accepted == list(frames) and refused == {}


def test_a_partner_whose_last_chunk_fails_is_refused_whole(case):
    secret, public, length, frames = case
    split = _split(public, length, frames)
    bad = list(split["p1"])
    bad[-1] = bytes(len(bad[-1]))  # chunk 4: zeros of the right size; chunks 0-3 are good ciphertexts
    split["p1"] = bad
    calls = []

    def recording_run(c):
        calls.append(c)
        return local_run(c)

    got, accepted, refused = sharded_sum(public, split, length, 3, run=recording_run)
    assert accepted == ["p0", "p2", "p3"] and list(refused) == ["p1"] and "chunk 4" in refused["p1"]
    # no partial sum: exactly the sum of the three good partners, not p1's chunks 0-3
    assert got == _running(public, length, [frames[p] for p in accepted])
    # the ranges whose first pass had added p1 (chunks 0-1, 2-3) were summed again without it
    assert len(calls) == 2 and [c[4] for c in calls[1]] == [0, 2] and all("p1" not in c[5] for c in calls[1])
    # and it decrypts to what NumPy says the three good shares add up to
    dec = secret.decrypt(got, length)
    w = np.random.default_rng(5).normal(0, 0.5, (len(NS), length))
    want = sum(np.asarray(update_share(w[i], NS[i], sum(NS), secret.WEIGHTING)) for i in (0, 2, 3))
    assert np.max(np.abs(np.asarray(dec, np.float64) - want)) < 1e-3


def test_every_partner_refused_gives_no_sum(case):
    _, public, length, frames = case
    split = {p: [bytes(len(c)) for c in ch] for p, ch in _split(public, length, frames).items()}
    got, accepted, refused = sharded_sum(public, split, length, 2, run=local_run)
    assert got is None and accepted == [] and sorted(refused) == sorted(frames)


def test_frames_of_different_chunk_counts_are_refused(case):
    _, public, length, frames = case
    split = _split(public, length, frames)
    split["p0"] = split["p0"][:-1]
    with pytest.raises(CiphertextError, match="different chunk counts"):
        sharded_sum(public, split, length, 2, run=local_run)


def test_a_sum_task_refuses_a_secret_context(case):
    secret, _, length, frames = case
    with pytest.raises(CiphertextError, match="secret key"):
        _range_task(secret.secret_context_bytes(), secret.params.to_dict(), secret.context_id, length, 0, {}, 1, False)


def test_chunk_ranges_cover_every_chunk_once_in_order():
    for n in (1, 2, 5, 113, 1000):
        for k in (1, 2, 3, 7, 64, 2000):
            r = chunk_ranges(n, k)
            assert [i for a, b in r for i in range(a, b)] == list(range(n))
            sizes = [b - a for a, b in r]
            assert len(r) == min(n, k) and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        chunk_ranges(0, 2)


def test_shard_count_policy():
    assert shard_count(1, 1000, 113, 64) == 1  # in-process on request
    assert shard_count(4, 2, 3, 0) == 3  # explicit, capped at the chunk count
    assert shard_count(0, 4, 1, 8) == 1  # a small round stays in-process
    assert shard_count(0, 64, 113, 0) == 1  # no Ray here
    assert shard_count(0, 64, 113, 1) == 1  # one CPU: nothing to gain
    assert shard_count(0, 64, 113, 4) == 4
    assert shard_count(0, 3, 85, 4) == 1 and shard_count(0, 4, 64, 4) == 4  # 255 vs 256 partner-chunks
    with pytest.raises(ValueError):
        shard_count(-1, 4, 4, 4)


def test_merge_ranges_names_the_ranges_to_redo():
    r = [RangeSum(0, 2, [b"a"], ["x", "y"]), RangeSum(2, 4, [b"b"], ["x"], {"y": "chunk 3: bad"}),
         RangeSum(4, 5, [b"c"], ["x", "y"])]
    accepted, refused, redo = merge_ranges(r)
    assert accepted == {"x"} and refused == {"y": "chunk 3: bad"} and redo == [0, 2]


def test_a_deferred_train_reply_is_split_checked_and_its_chunks_kept(case):
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from sealfl.common import protocol as P
    from sealfl.server.errors import ReplyError
    from sealfl.server.validation import ReplyLimits, parse_train_reply

    _, public, length, frames = case

    def reply(frame):
        return RecordDict({P.UPDATE: ArrayRecord({P.UPDATE_CT: Array(P.to_u8(frame))}),
                           P.METRICS: MetricRecord({P.NUM_EXAMPLES: 30, P.TRAIN_LOSS: 0.5}),
                           P.PARTNER: ConfigRecord({P.NAME: "p"})})

    kw = dict(codec=public, length=length, limits=ReplyLimits(), declared_n=30, signed=False, defer_ciphertext=True)
    r = parse_train_reply(reply(frames["p0"]), **kw)
    assert r.frame == b"" and r.chunks == public.split(frames["p0"], length)[1] and r.nbytes == len(frames["p0"])
    for broken, words in [(frames["p0"][:-5], "truncated"), (b"XXXX" + frames["p0"][4:], "bad magic")]:
        with pytest.raises(ReplyError, match=words):
            parse_train_reply(reply(broken), **kw)
