"""The pure checks of one partner reply (sealfl.server.validation) and of who sent it
(sealfl.server.intake), called directly with real flwr records and messages."""

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sealfl.attestation.keys import generate_key, public_key_to_pem, sign, verify
from sealfl.common import protocol as P
from sealfl.he.bfv import WIDE, BFVCodec
from sealfl.server.errors import ReplyError
from sealfl.server.intake import Roster, screen
from sealfl.server.validation import (
    ReplyLimits,
    check_candidate_counts,
    check_count,
    check_real,
    check_u8_array,
    parse_eval_reply,
    parse_stats_reply,
    parse_train_reply,
)

LIMITS = ReplyLimits(max_examples=1000, max_loss=100.0)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# every JSON-ish type that is not an int, and ints that are out of range
NOT_INTS = st.one_of(st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                     st.none(), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(),
                                                                                      max_size=2))
NOT_REALS = st.one_of(st.booleans(), st.text(max_size=5), st.none(), st.lists(st.floats(), max_size=3),
                      st.sampled_from([math.nan, math.inf, -math.inf]))


@pytest.fixture(scope="module")
def codecs():
    secret = BFVCodec.generate()
    return secret, BFVCodec.from_bytes(secret.public_context_bytes(), secret.params, secret.context_id)


# ---- single values ---------------------------------------------------------------------------

@given(NOT_INTS)
def test_kind_counts_of_any_non_integer_type_are_refused(value):
    with pytest.raises(ReplyError) as err:
        check_count(value, "metrics.num-examples", hi=1000)
    assert err.value.field == "metrics.num-examples"


@given(st.integers())
def test_kind_counts_outside_their_range_are_refused_and_inside_returned(value):
    if 1 <= value <= 1000:
        assert check_count(value, "n", hi=1000) == value and type(check_count(value, "n", hi=1000)) is int
    else:
        with pytest.raises(ReplyError, match=r"must be in 1\.\.1000"):
            check_count(value, "n", hi=1000)


@given(NOT_REALS)
def test_kind_reals_that_are_not_finite_numbers_are_refused(value):
    with pytest.raises(ReplyError):
        check_real(value, "metrics.loss", lo=0.0, hi=100.0)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_kind_reals_outside_their_range_are_refused(value):
    if 0.0 <= value <= 100.0:
        assert check_real(value, "x", lo=0.0, hi=100.0) == value
    else:
        with pytest.raises(ReplyError, match=r"must lie in \[0, 100\]"):
            check_real(value, "x", lo=0.0, hi=100.0)


# ---- train / statistics replies ---------------------------------------------------------------

_BLOB = {}


def _train(codecs, n=100, loss=0.5, blob=None, extra=None, partner=True):
    secret, _ = codecs
    if blob is None:
        blob = _BLOB.setdefault("b", secret.encrypt(np.arange(14.0) / 2))
    recs = {P.UPDATE: ArrayRecord({P.UPDATE_CT: Array(P.to_u8(blob))}),
            P.METRICS: MetricRecord({P.NUM_EXAMPLES: n, P.TRAIN_LOSS: loss})}
    if partner:
        recs[P.PARTNER] = ConfigRecord({P.NAME: "A", P.SIGNATURE: b"x"})
    recs.update(extra or {})
    return RecordDict(recs)


def _parse_train(codecs, content, declared_n=100):
    return parse_train_reply(content, codec=codecs[1], length=14, limits=LIMITS, declared_n=declared_n)


def test_a_good_train_reply_is_parsed(codecs):
    r = _parse_train(codecs, _train(codecs))
    assert (r.n, r.loss, len(r.chunks)) == (100, 0.5, 1)
    assert type(r.n) is int


@SETTINGS
@given(st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 0, -5, 100.0, 100.5, 10**9, [100], [1.0, 2.0]]),
                 st.floats(), st.integers()))
def test_kind_train_num_examples_of_every_wrong_value_is_refused(codecs, value):
    if value == 100 and type(value) is int:
        return  # the declared count itself is fine
    with pytest.raises(ReplyError) as err:
        _parse_train(codecs, _train(codecs, n=value))
    assert err.value.field == "metrics.num-examples"


@SETTINGS
@given(st.one_of(st.sampled_from([math.nan, math.inf, -1.0, 101.0, [0.5]]), st.floats(max_value=-1e-300)))
def test_kind_train_loss_must_be_finite_and_in_range(codecs, value):
    with pytest.raises(ReplyError) as err:
        _parse_train(codecs, _train(codecs, loss=value))
    assert err.value.field == "metrics.train_loss"


@pytest.mark.parametrize("extra, words", [
    ({"smuggled": ArrayRecord({"x": Array(np.zeros(3, np.uint8))})}, "unexpected records ['smuggled']"),
    ({P.METRICS: MetricRecord({P.NUM_EXAMPLES: 100, P.TRAIN_LOSS: 0.5, "bonus": 1})}, "unexpected keys ['bonus']"),
    ({P.METRICS: ConfigRecord({P.NUM_EXAMPLES: 100, P.TRAIN_LOSS: 0.5})}, "must be a MetricRecord"),
    ({P.METRICS: ConfigRecord({P.NUM_EXAMPLES: "100", P.TRAIN_LOSS: True})}, "must be a MetricRecord"),
    ({P.UPDATE: ArrayRecord({P.UPDATE_CT: Array(np.zeros(5, np.float64))})}, "uint8"),
    ({P.UPDATE: ArrayRecord({P.UPDATE_CT: Array(np.zeros((2, 2), np.uint8))})}, "1-D"),
])
def test_kind_reply_shape_is_exact(codecs, extra, words):
    with pytest.raises(ReplyError, match=words.replace("[", r"\[").replace("]", r"\]")):
        _parse_train(codecs, _train(codecs, extra=extra))


def test_kind_missing_partner_record_is_refused(codecs):
    with pytest.raises(ReplyError, match="missing records"):
        _parse_train(codecs, _train(codecs, partner=False))


def test_kind_oversized_array_is_refused_before_it_is_deserialised(codecs):
    limit = codecs[1].params.max_frame_bytes(14)
    # declared larger than the bound, data not even an npy stream: refused on the metadata alone
    huge = Array(dtype="uint8", shape=(limit + 1,), stype="numpy.ndarray", data=b"not npy")
    with pytest.raises(ReplyError, match="refused before parsing"):
        check_u8_array(huge, "update.update_ct", limit)
    # metadata that lies about the content is caught after deserialising
    liar = Array(np.zeros(10, np.uint8))
    liar.shape = (9,)
    with pytest.raises(ReplyError, match="metadata says"):
        check_u8_array(liar, "update.update_ct", limit)


def test_kind_statistics_reply_declares_an_integer_count(codecs):
    secret, public = codecs
    content = RecordDict({P.STATS: ArrayRecord({P.STATS_CT: Array(P.to_u8(secret.encrypt(np.ones(27), WIDE)))}),
                          P.METRICS: MetricRecord({P.NUM_EXAMPLES: 150.0}),
                          P.PARTNER: ConfigRecord({P.NAME: "A", P.SIGNATURE: b"x"})})
    with pytest.raises(ReplyError, match="must be an integer"):
        parse_stats_reply(content, codec=public, length=27, limits=LIMITS)
    content[P.METRICS] = MetricRecord({P.NUM_EXAMPLES: 150})
    assert parse_stats_reply(content, codec=public, length=27, limits=LIMITS).n == 150


# ---- evaluate and gate replies ---------------------------------------------------------------

def _eval(n=100, correct=80, acc=None, loss=0.4):
    acc = correct / n if acc is None else acc
    return RecordDict({P.METRICS: MetricRecord({P.NUM_EXAMPLES: n, P.CORRECT: correct, P.ACCURACY: acc, P.LOSS: loss}),
                       P.PARTNER: ConfigRecord({P.NAME: "A", P.SIGNATURE: b"x"})})


@pytest.mark.parametrize("kw, expected_n, words", [
    ({"correct": 500, "acc": 5.0}, None, "metrics.correct: must be in 0..100, got 500"),
    ({"correct": -1, "acc": 0.0}, None, "metrics.correct: must be in 0..100, got -1"),
    ({"acc": 0.9}, None, "is not correct/n = 80/100"),
    ({"acc": math.nan}, None, "must be a finite number, got number nan"),
    ({"loss": math.inf}, None, "metrics.loss: must be a finite number, got number inf"),
    ({"loss": -0.1}, None, "metrics.loss: must lie in [0, 100], got -0.1"),
    ({}, 60, "100 test rows, but this partner reported 60 before"),
    ({"n": 0, "correct": 0, "acc": 0.0}, None, "metrics.num-examples: must be in 1..1000, got 0"),
])
def test_kind_evaluate_counts_and_metrics_must_be_possible(kw, expected_n, words):
    with pytest.raises(ReplyError) as err:
        parse_eval_reply(_eval(**kw), limits=LIMITS, expected_n=expected_n)
    assert words in str(err.value)


def test_a_good_evaluate_reply_is_parsed():
    r = parse_eval_reply(_eval(), limits=LIMITS, expected_n=100)
    assert (r.n, r.correct, r.accuracy) == (100, 80, 0.8)


@pytest.mark.parametrize("counts, expected_n, words", [
    ({"fp32.correct": 50, "fp32.n": 60, "int8.correct": 900, "int8.n": 60}, None, "int8.correct: must be in 0..60, got 900"),
    ({"fp32.correct": 50, "fp32.n": 60, "int8.correct": 40, "int8.n": 100}, None, "different numbers of rows"),
    ({"fp32.correct": 50, "fp32.n": 60, "int8.correct": 40, "int8.n": 60}, 88, "60 test rows, but this partner reported 88"),
    ({"fp32.correct": 50, "fp32.n": 60, "int8.correct": 40.0, "int8.n": 60}, None, "must be an integer"),
    ({"fp32.correct": 50, "fp32.n": 60, "int8.correct": 40, "int8.n": 60, "int4.n": 1}, None, "unexpected keys"),
    ({"fp32.correct": 50, "fp32.n": 60}, None, "missing keys"),
])
def test_kind_gate_counts_must_be_possible_and_consistent(counts, expected_n, words):
    with pytest.raises(ReplyError) as err:
        check_candidate_counts(counts, ["fp32", "int8"], limits=LIMITS, expected_n=expected_n)
    assert words in str(err.value)


# ---- who sent it: screen() -----------------------------------------------------------------

@pytest.fixture(scope="module")
def keys():
    return {p: generate_key() for p in "ABC"}


CTX = bytes(range(32))


def _roster(keys, signed=True):
    return Roster.from_pems(list(keys), {p: public_key_to_pem(k).decode() for p, k in keys.items()} if signed else None,
                            CTX)


def _sent(nodes, kind="train"):
    msgs = []
    for i, nid in enumerate(nodes):
        m = Message(RecordDict({P.CONFIG: ConfigRecord({"server-round": 1})}), dst_node_id=nid, message_type=kind)
        m.metadata.__dict__["_message_id"] = f"msg-{kind}-{nid}-{i}"
        msgs.append(m)
    return msgs


def _reply(msg, name, key, *, value=1):
    content = RecordDict({P.METRICS: MetricRecord({"v": value}), P.PARTNER: ConfigRecord({P.NAME: name})})
    stmt = P.reply_statement(CTX, msg.metadata.message_id, msg.metadata.message_type, name, P.content_digest(content))
    content[P.PARTNER] = ConfigRecord({P.NAME: name, P.SIGNATURE: sign(key, stmt)})
    return Message(content, reply_to=msg)


def _parse(partner, content):
    return content[P.METRICS]["v"]


def _bound(keys, nodes=(11, 12, 13)):
    roster = _roster(keys)
    for p, nid in zip("ABC", nodes):
        roster.bind(nid, p)
    return roster


def test_kind_replies_are_bound_at_first_contact_and_signed(keys, server_identity):
    roster = _roster(keys)
    sent = _sent([11, 12, 13], "query")
    out = screen([_reply(m, p, keys[p]) for m, p in zip(sent, "ABC")], sent, roster, _parse, phase="statistics",
                 bind=True)
    assert out.accepted == {"A": 1, "B": 1, "C": 1} and not out.rejected
    assert roster.node_of == {"A": 11, "B": 12, "C": 13}


def test_kind_impostor_claiming_another_partner_is_refused(keys, server_identity):
    roster = _bound(keys)
    sent = _sent([11, 12, 13])
    replies = [_reply(sent[0], "A", keys["A"]), _reply(sent[1], "B", keys["B"]),
               _reply(sent[2], "A", keys["C"]),  # node 13 (C) claims A, signed with its own key
               ]
    out = screen(replies, sent, roster, _parse, phase="train")
    assert sorted(out.accepted) == ["A", "B"]
    assert "does not verify with partner 'A'" in out.rejected["C"]


def test_kind_node_speaking_for_another_partner_is_refused_with_both_node_ids(keys, server_identity):
    roster = _bound(keys)
    roster.keys = None  # unsigned: only the binding stands in the way
    sent = _sent([11, 12, 13])
    out = screen([_reply(sent[0], "A", keys["A"]), _reply(sent[2], "A", keys["C"])], sent, roster, _parse,
                 phase="train")
    assert out.accepted == {"A": 1}
    assert "node 13 is partner 'C' but claims 'A' (node 11)" in out.rejected["C"]
    assert "no reply" in out.rejected["B"]


def test_kind_replayed_or_altered_replies_do_not_verify(keys, server_identity):
    roster = _bound(keys)
    old = _sent([11], "train")
    new = _sent([11, 12], "train")
    new[0].metadata.__dict__["_message_id"] = "msg-round-2"
    replayed = _reply(old[0], "A", keys["A"])
    replayed.metadata.__dict__["_reply_to_message_id"] = "msg-round-2"  # round 1's reply answering round 2
    altered = _reply(new[1], "B", keys["B"])
    altered.content[P.METRICS] = MetricRecord({"v": 10**6})
    out = screen([replayed, altered], new, roster, _parse, phase="train")
    assert not out.accepted
    assert "does not verify" in out.rejected["A"] and "does not verify" in out.rejected["B"]


def test_kind_superlink_error_reply_is_named_by_the_message_it_answers(keys, server_identity):
    roster = _bound(keys)
    sent = _sent([11, 12])
    err = create_message_error_unavailable_res_message(sent[1].metadata, "node_unavail")
    assert err.metadata.src_node_id == 1  # the SuperLink's own id: useless for naming the partner
    out = screen([_reply(sent[0], "A", keys["A"]), err], sent, roster, _parse, phase="train")
    assert "reported by the SuperLink" in out.rejected["B"] and "node-1" not in out.rejected


def test_kind_one_reply_per_message_and_per_partner(keys, server_identity):
    roster = _bound(keys)
    sent = _sent([11, 12])
    first = _reply(sent[0], "A", keys["A"])
    again = _reply(sent[0], "A", keys["A"], value=2)
    stray = Message(RecordDict({P.METRICS: MetricRecord({"v": 3})}), reply_to=_sent([12], "train")[0])
    stray.metadata.__dict__["_reply_to_message_id"] = "not-ours"
    out = screen([first, again, stray], sent, roster, _parse, phase="train")
    assert out.accepted == {"A": 1}
    assert "a second reply to the same message" in out.rejected["A"]
    assert any("answers no message" in v for v in out.rejected.values())


def test_kind_reply_from_another_node_than_addressed_is_refused(keys, server_identity):
    roster = _bound(keys)
    sent = _sent([11, 12])
    r = _reply(sent[0], "A", keys["A"])
    r.metadata.__dict__["_src_node_id"] = 12
    out = screen([r], sent, roster, _parse, phase="train")
    assert "reply from node 12 to a message sent to node 11" in out.rejected["A"]


def test_kind_unbound_node_cannot_join_after_the_statistics_round(keys, server_identity):
    roster = _bound(keys, nodes=(11, 12))  # C never took part
    sent = _sent([13])
    out = screen([_reply(sent[0], "C", keys["C"])], sent, roster, _parse, phase="train")
    assert not out.accepted and "did not take part in the statistics round" in out.rejected["C"]


def test_reply_signature_is_plain_ecdsa_p256_over_the_documented_statement(keys, server_identity):
    # independent check with pycryptodome over a statement rebuilt by hand from the spec
    import hashlib
    import struct

    sent = _sent([11])
    r = _reply(sent[0], "A", keys["A"])
    lp = lambda b: struct.pack(">Q", len(b)) + b  # noqa: E731
    digest = P.content_digest(r.content)
    stmt = b"sealfl/partner-reply/v1\n" + lp(CTX) + lp(b"msg-train-11-0") + lp(b"train") + lp(b"A") + lp(digest)
    assert verify(keys["A"].public_key(), stmt, r.content[P.PARTNER][P.SIGNATURE])
    assert len(digest) == 32 and digest != hashlib.sha256(b"").digest()


@given(st.integers(min_value=-(2**62), max_value=2**62), st.floats(allow_nan=True), st.text(max_size=8),
       st.binary(max_size=8))
def test_kind_content_digest_changes_with_every_value(i, f, s, b):
    base = {"i": 1, "f": 0.5, "s": "x", "b": b"y"}
    d0 = P.content_digest(RecordDict({"c": ConfigRecord(base)}))
    for k, v in (("i", i), ("f", f), ("s", s), ("b", b)):
        changed = dict(base, **{k: v})
        same = changed[k] == base[k] and type(changed[k]) is type(base[k])
        if k == "f" and isinstance(v, float) and math.isnan(v):
            same = False
        d = P.content_digest(RecordDict({"c": ConfigRecord(changed)}))
        assert (d == d0) == same


def test_kind_a_clientapp_traceback_is_refused_in_one_line(keys, server_identity):
    """Flower's simulation reports a ClientApp exception with its whole traceback, coloured; the
    refusal in the log and rounds.jsonl keeps the exception line only."""
    from flwr.app import Error, Message

    roster = _bound(keys)
    sent = _sent([11, 12])
    reason = ("\x1b[91mTraceback (most recent call last):\x1b[0m\n  File \"/x/app.py\", line 3, in train\n"
              "    kit = load_kit(d)\n\x1b[1mKitError: startup kit partners/b: the wrapped secret does not "
              "unwrap\x1b[0m\n")
    err = Message(Error(code=2, reason=reason), reply_to=sent[1])
    err.metadata.__dict__["_src_node_id"] = 12
    out = screen([_reply(sent[0], "A", keys["A"]), err], sent, roster, _parse, phase="train")
    why = out.rejected["B"]
    assert why.endswith("KitError: startup kit partners/b: the wrapped secret does not unwrap")
    assert "\n" not in why and "\x1b" not in why and "Traceback" not in why
    long = screen([Message(Error(code=2, reason="x" * 5000), reply_to=sent[1])], sent, roster, _parse, phase="train")
    assert max(len(v) for v in long.rejected.values()) < 400
