"""One message per partner per round: round k's aggregate is evaluated inside round k+1's
train message (sealfl.server.strategy, "evaluate-round"), and the round log says the same as
Flower's own loop (a train and an evaluate message every round) on the same campaign."""

import json

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg

from sealfl.clients import app as capp
from sealfl.clients.heart.data import HOSPITALS
from sealfl.clients.kit import kit_dir, load_kit
from sealfl.common import protocol as P
from sealfl.server.bookkeeping import CampaignDir
from sealfl.server.strategy import EncryptedFedAvg
from tests.server.test_validation_campaign import _run
from tests.support import faults_partner
from tests.support.fakegrid import FakeGrid

C, H, S, V = HOSPITALS
ROUNDS = 3
#: what an evaluation means in rounds.jsonl (timings differ between runs)
EVAL_FIELDS = ("pooled_test_accuracy", "per_partner", "eval_rejected", "accepted", "rejected", "train_loss",
               "total_weight")


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    from sealfl.platform.consortium import create_consortium

    return create_consortium(tmp_path_factory.mktemp("cons") / "c", "heart", list(HOSPITALS))


def _kinds(grid):
    return [m.metadata.message_type for m in grid.sent]


def test_one_message_per_partner_per_round_and_the_same_round_log_as_flowers_loop(consortium, tmp_path,
                                                                                  server_identity, monkeypatch):
    cons, codec = consortium
    folded = FakeGrid(str(cons.dir), 4)
    asked = []  # (server-round, evaluate-round) of each train message, read when it is delivered
    deliver = folded._deliver

    def recording(messages):
        asked.extend((m.content[P.CONFIG]["server-round"], m.content[P.CONFIG][P.EVALUATE_ROUND])
                     for m in messages if m.metadata.message_type == "train")
        return deliver(messages)

    folded._deliver = recording
    recs, status, out = _run(consortium, tmp_path / "folded", rounds=ROUNDS, grid=folded)
    assert status["status"] == "finished" and [r["round"] for r in recs] == [1, 2, 3]
    kinds = _kinds(folded)
    assert kinds.count("query") == 4 and kinds.count("train") == 4 * ROUNDS and kinds.count("evaluate") == 4
    assert kinds[-4:] == ["evaluate"] * 4  # only the last aggregate has an evaluate message of its own
    assert asked == [(1, 0)] * 4 + [(2, 1)] * 4 + [(3, 2)] * 4

    # the reference: Flower's own Strategy.start (a train and an evaluate message each round)
    monkeypatch.setattr(EncryptedFedAvg, "start", FedAvg.start)
    flower = FakeGrid(str(cons.dir), 4)
    ref, ref_status, ref_out = _run(consortium, tmp_path / "flower", rounds=ROUNDS, grid=flower)
    assert ref_status["status"] == "finished"
    assert _kinds(flower).count("evaluate") == 4 * ROUNDS
    for a, b in zip(recs, ref, strict=True):
        assert {k: a[k] for k in EVAL_FIELDS} == {k: b[k] for k in EVAL_FIELDS}, a["round"]
        assert sorted(a["per_partner"]) == sorted(HOSPITALS) and a["pooled_test_accuracy"] is not None
    ck, ref_ck = CampaignDir(out).read_checkpoint(), CampaignDir(ref_out).read_checkpoint()
    assert ck.round == ref_ck.round == ROUNDS and ck.model_weight == ref_ck.model_weight
    m, m_ref = codec.decrypt(ck.model_ct, 14), codec.decrypt(ref_ck.model_ct, 14)
    assert np.array_equal(m, m_ref) and np.any(m != 0)  # packed BFV, same seeds: bit for bit


def test_a_train_reply_without_the_asked_evaluation_counts_its_update_and_is_named(consortium, tmp_path,
                                                                                   server_identity):
    cons, _ = consortium

    def handler(msg, ctx):
        reply = faults_partner.reply(msg, ctx, str(cons.dir))
        if int(ctx.node_config["partition-id"]) == 1 and P.EVALUATION in reply.content:
            del reply.content[P.EVALUATION]  # Hungary answers round 2 without evaluating round 1
            kit = load_kit(str(kit_dir(str(cons.dir), H)))
            capp.sign_reply(kit, msg, reply.content)  # its own, valid signature
        return reply

    recs, status, _ = _run(consortium, tmp_path, rounds=2, grid=FakeGrid(str(cons.dir), 4, handler=handler))
    assert status["status"] == "finished"
    assert list(recs[0]["eval_rejected"]) == [H] and "evaluation: missing" in recs[0]["eval_rejected"][H]
    assert sorted(recs[0]["per_partner"]) == [C, S, V]
    assert recs[1]["accepted"] == sorted(HOSPITALS)  # its round-2 update counted all the same


def test_an_evaluation_nobody_asked_for_is_refused_with_the_reply(consortium, tmp_path, server_identity):
    cons, _ = consortium

    def handler(msg, ctx):
        reply = faults_partner.reply(msg, ctx, str(cons.dir))
        if int(ctx.node_config["partition-id"]) == 2 and msg.metadata.message_type == "train" \
                and P.EVALUATION not in reply.content:  # round 1: nothing to evaluate yet
            reply.content[P.EVALUATION] = reply.content[P.METRICS]
            kit = load_kit(str(kit_dir(str(cons.dir), S)))
            capp.sign_reply(kit, msg, reply.content)
        return reply

    (rec,), _, _ = _run(consortium, tmp_path, rounds=1, grid=FakeGrid(str(cons.dir), 4, handler=handler))
    assert list(rec["rejected"]) == [S] and "unexpected records ['evaluation']" in rec["rejected"][S]
    assert json.dumps(rec["accepted"]) == json.dumps([C, H, V])


def test_a_bad_folded_evaluation_is_refused_and_the_update_still_counts(consortium, tmp_path, server_identity):
    recs, status, _ = _run(consortium, tmp_path, {3: "correct-above-n"}, rounds=2)
    assert status["status"] == "finished"
    # round 1's evaluation travelled in round 2's train reply: refused by name, the update counted
    assert "evaluation: metrics.correct: must be in 0..100, got 500" in recs[0]["eval_rejected"][V]
    assert recs[1]["accepted"] == sorted(HOSPITALS)
    assert sorted(recs[0]["per_partner"]) == [C, H, S]
