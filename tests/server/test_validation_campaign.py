"""Whole campaigns (the real ServerApp body, the real partner handlers, real flwr
Messages) on the in-process grid of tests/support/fakegrid.py, with fault-injecting partners:
each bad reply is refused with the partner's name and the reason, recorded in
rounds.jsonl, and the round completes with the others; nothing good is lost.
"""

import json

import numpy as np
import pytest

from sealfl.clients.heart.data import HOSPITALS, N_FEATURES, load_partitions
from sealfl.clients.heart.task import HeartTask
from sealfl.he.decrypted import open_model, share_to_sum
from sealfl.platform.consortium import create_consortium
from sealfl.platform.partner_keys import partner_public_keys
from sealfl.server.app import ServerConfig, run_server
from sealfl.server.bookkeeping import CampaignDir, load_checkpoint
from sealfl.server.errors import NotEnoughPartnersError
from tests.support.fakegrid import FakeGrid

N_TRAIN = {p.name: p.n_train for p in load_partitions()}
N_TEST = {p.name: len(p.y_test) for p in load_partitions()}
C, H, S, V = HOSPITALS


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    cons, codec = create_consortium(tmp_path_factory.mktemp("cons") / "c", "heart", list(HOSPITALS))
    return cons, codec


@pytest.fixture(scope="module")
def ckks_consortium(tmp_path_factory):
    from sealfl.he.codecs import params_for

    return create_consortium(tmp_path_factory.mktemp("cons") / "c", "heart", list(HOSPITALS),
                             params=params_for("ckks"))


def _cfg(cons, out, rounds=1, min_partners=3, timeout_s=30.0, signed=True) -> ServerConfig:
    task = HeartTask()
    return ServerConfig(
        campaign_dir=str(out), public_context=str(cons.public_context), context_id=cons.context_id,
        he=cons.he_params.to_dict(), num_partners=len(cons.partners), min_partners=min_partners, num_rounds=rounds,
        n_params=task.n_params, stats_length=1 + 2 * N_FEATURES, initial_params=task.init_params().tolist(),
        train={"local-epochs": 1, "lr": 0.05, "batch-size": 16, "seed": 0}, timeout_s=timeout_s,
        partners=list(cons.partners), partner_keys=partner_public_keys(cons) if signed else {})


def _run(consortium, tmp_path, faults=None, *, rounds=1, min_partners=3, timeout_s=30.0, signed=True, grid=None,
         pad_bytes=64 << 20):
    cons, _ = consortium
    grid = grid or FakeGrid(str(cons.dir), len(cons.partners), faults, pad_bytes=pad_bytes)
    out = tmp_path / "camp"
    pulls = grid.pulls
    run_server(grid, _cfg(cons, out, rounds, min_partners, timeout_s, signed))
    assert grid.pulls > pulls  # the replies came through sealfl.server.streaming's ReplyStream
    return CampaignDir(out, rounds).rounds(), json.loads((out / "status.json").read_text()), out


def _model(consortium, out):
    _, codec = consortium
    ck = load_checkpoint(out)
    declared = json.loads((out / "status.json").read_text())["stats_declared_n"]
    return open_model(share_to_sum(codec.decrypt(ck["model_ct"], 14), declared, codec.WEIGHTING), ck["model_weight"],
                      HeartTask.decrypt_bounds, max_total=declared), ck


def _assert_round_went_on(rec, consortium, out, accepted):
    assert rec["accepted"] == sorted(accepted)
    assert rec["total_weight"] == sum(N_TRAIN[p] for p in accepted)
    params, ck = _model(consortium, out)
    assert np.all(np.isfinite(params)) and ck["model_weight"] == rec["total_weight"]
    assert 0.0 <= rec["pooled_test_accuracy"] <= 1.0


def test_kind_non_finite_or_non_integer_examples_are_refused(consortium, tmp_path, server_identity):
    (rec,), status, out = _run(consortium, tmp_path, {1: "nan-examples"})
    assert status["status"] == "finished"
    assert list(rec["rejected"]) == [H]
    assert "num-examples" in rec["rejected"][H] and "integer" in rec["rejected"][H]
    _assert_round_went_on(rec, consortium, out, [C, S, V])


def test_kind_examples_must_equal_the_statistics_round_count(consortium, tmp_path, server_identity):
    (rec,), _, out = _run(consortium, tmp_path, {2: "undeclared-examples"})
    assert list(rec["rejected"]) == [S]
    assert f"{N_TRAIN[S] + 100} differs from the {N_TRAIN[S]} rows" in rec["rejected"][S]
    _assert_round_went_on(rec, consortium, out, [C, H, V])


@pytest.mark.parametrize("codec, words", [
    # the default packed BFV: SEAL refuses such a ciphertext when it loads it
    ("bfv", "chunk 0 is not a ciphertext of this BFV context"),
    # CKKS checks the scale before the trial addition
    ("ckks", "chunk 0 cannot be added to this campaign's ciphertexts: scale 2^30.00, expected 2^40"),
])
def test_kind_unaddable_ciphertext_names_the_partner_and_the_round_goes_on(codec, words, request, tmp_path,
                                                                          server_identity):
    consortium = request.getfixturevalue("consortium" if codec == "bfv" else "ckks_consortium")
    (rec,), _, out = _run(consortium, tmp_path, {1: "scale-2^30"})
    assert list(rec["rejected"]) == [H]
    assert words in rec["rejected"][H]
    _assert_round_went_on(rec, consortium, out, [C, S, V])


def test_kind_oversized_reply_is_refused_before_parsing(consortium, tmp_path, server_identity):
    (rec,), _, out = _run(consortium, tmp_path, {3: "padded-chunk"})
    assert list(rec["rejected"]) == [V]
    assert "exceed the bound" in rec["rejected"][V] and "before parsing" in rec["rejected"][V]
    _assert_round_went_on(rec, consortium, out, [C, H, S])


def test_kind_padding_within_the_bound_is_refused_as_non_canonical(consortium, tmp_path, server_identity):
    (rec,), _, out = _run(consortium, tmp_path, {3: "padded-chunk"}, pad_bytes=100)
    assert "not in canonical form" in rec["rejected"][V]
    _assert_round_went_on(rec, consortium, out, [C, H, S])


def test_kind_signed_impostor_cannot_take_a_partners_place(consortium, tmp_path, server_identity):
    # partner 2 (Switzerland) claims to be Cleveland in every reply, signed with its own key
    (rec,), status, out = _run(consortium, tmp_path, {2: "impostor"})
    assert rec["stats_partners"] == [C, H, V]
    (who, why), = rec["stats_rejected"].items()
    assert who.startswith(f"{C}?") and "signature" in why and C in why
    _assert_round_went_on(rec, consortium, out, [C, H, V])  # Cleveland counted once, from its own node


def test_kind_unsigned_claims_are_bound_to_the_first_node(consortium, tmp_path, server_identity):
    cons, _ = consortium
    from tests.support import faults_partner

    grid = FakeGrid(str(cons.dir), 4)

    def impostor_in_training(msg, ctx):  # honest in the statistics round, then claims Cleveland
        out = faults_partner.reply(msg, ctx, str(cons.dir))
        if ctx.node_config["partition-id"] == 2 and msg.metadata.message_type == "train":
            from flwr.app import ConfigRecord

            out.content["partner"] = ConfigRecord({"name": C})
        return out

    grid.handler = impostor_in_training
    (rec,), _, out = _run(consortium, tmp_path, signed=False, grid=grid)
    (who, why), = rec["rejected"].items()
    assert who == S
    assert f"node {grid.node_ids[2]} is partner '{S}' but claims '{C}' (node {grid.node_ids[0]})" in why
    _assert_round_went_on(rec, consortium, out, [C, H, V])


def test_kind_superlink_error_replies_are_named_by_the_node_they_concern(consortium, tmp_path, server_identity):
    cons, _ = consortium
    grid = FakeGrid(str(cons.dir), 4)

    def second_round_unreachable(g, kind):
        if kind == "train" and any(m.metadata.message_type == "train" for m in g.sent):
            g.unreachable.add(g.node_ids[1])

    grid.on_round = second_round_unreachable
    recs, status, out = _run(consortium, tmp_path, rounds=2, grid=grid)
    assert status["status"] == "finished"
    assert "node-1" not in json.dumps(recs)
    why = recs[1]["rejected"][H]
    assert "reported by the SuperLink" in why and "Node Unavailable" in why
    _assert_round_went_on(recs[1], consortium, out, [C, S, V])


def test_kind_partner_leaving_between_rounds_does_not_hang_the_campaign(consortium, tmp_path, server_identity):
    cons, _ = consortium
    grid = FakeGrid(str(cons.dir), 4)

    def leave_after_round_1(g, kind):
        if kind == "train":  # after round 1's train message (round 2's would carry round 1's evaluation)
            g.connected.discard(g.node_ids[3])

    grid.after_round = leave_after_round_1
    recs, status, out = _run(consortium, tmp_path, rounds=2, grid=grid)
    assert status["status"] == "finished"
    assert "not connected" in recs[1]["rejected"][V]
    _assert_round_went_on(recs[1], consortium, out, [C, H, S])


def test_kind_too_few_partners_fail_the_round_and_keep_the_last_good_checkpoint(consortium, tmp_path,
                                                                                server_identity):
    cons, _ = consortium
    grid = FakeGrid(str(cons.dir), 4, {0: "scale-2^30"})
    saved = {}

    def second_round_goes_bad(g, kind):
        if kind == "train" and any(m.metadata.message_type == "train" for m in g.sent):
            saved["round 2"] = True
            g.faults[1] = "nan-examples"  # with partner 0's bad ciphertext: 2 of 4 valid, min_partners=3

    grid.on_round = second_round_goes_bad
    with pytest.raises(NotEnoughPartnersError, match="min_partners=3") as err:
        _run(consortium, tmp_path, rounds=2, grid=grid)
    assert saved == {"round 2": True}
    assert f"{C}: update.update_ct" in str(err.value) and f"{H}: metrics.num-examples" in str(err.value)
    status = json.loads((tmp_path / "camp" / "status.json").read_text())
    assert status["status"] == "failed" and status["round"] == 1
    # round 1, evaluated in round 2's train replies (which partner 1's bad update does not spoil), is the checkpoint
    cd = CampaignDir(tmp_path / "camp", 2)
    (rec,) = cd.rounds()
    assert cd.read_checkpoint().round == 1 and cd.read_checkpoint().record == rec
    assert sorted(rec["per_partner"]) == sorted(HOSPITALS) and rec["eval_rejected"] == {}


def test_kind_impossible_evaluate_counts_are_refused(consortium, tmp_path, server_identity):
    (rec,), _, out = _run(consortium, tmp_path, {1: "correct-above-n"})
    assert list(rec["eval_rejected"]) == [H]
    assert "metrics.correct: must be in 0..100, got 500" in rec["eval_rejected"][H]
    per = rec["per_partner"]
    assert sorted(per) == [C, S, V] and all(per[p]["n"] == N_TEST[p] for p in per)
    assert rec["pooled_test_accuracy"] == sum(v["correct"] for v in per.values()) / sum(v["n"] for v in per.values())


def test_kind_statistics_count_lie_is_caught_by_the_key_holders(consortium, tmp_path, server_identity):
    # the aggregator cannot see inside E([n, Σx, Σx²]); every partner decrypts the sum,
    # finds 100 rows more declared than encrypted, and refuses to train on it
    with pytest.raises(NotEnoughPartnersError) as err:
        _run(consortium, tmp_path, {1: "stats-count-lie"})
    assert "differs from the" in str(err.value) and "encrypted another count than it declared" in str(err.value)
    assert not (tmp_path / "camp" / "checkpoint" / "global.npz").exists()


def test_kind_evaluate_n_must_stay_the_same_across_rounds(consortium, tmp_path, server_identity):
    cons, _ = consortium
    grid = FakeGrid(str(cons.dir), 4)

    def second_round_lies(g, kind):
        if kind == "evaluate":  # round 2's (round 1's evaluation came with round 2's train replies)
            g.faults[2] = "correct-above-n"  # n = 100 instead of the 15 it reported in round 1

    grid.on_round = second_round_lies
    recs, _, _ = _run(consortium, tmp_path, rounds=2, grid=grid)
    assert f"100 test rows, but this partner reported {N_TEST[S]} before" in recs[1]["eval_rejected"][S]


def test_kind_plaintext_candidates_go_only_to_nodes_bound_to_a_partner(consortium, server_identity):
    """The release gate's query carries the fp32/INT8 models in plaintext: of six connected
    nodes, the four proven partners get them; a node no partner is bound to (an unknown
    partition, a stranger claiming a partner's name with a signature that does not verify)
    gets only the binding round's statistics query -- and no model."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from sealfl.clients.heart.stats import local_sums, mean_std
    from sealfl.common import protocol as P
    from sealfl.server.eval_app import run_gate_query
    from tests.support import faults_partner

    cons, _ = consortium
    parts = load_partitions()
    mean, std = mean_std(sum(local_sums(p.x_train) for p in parts))
    model = HeartTask().to_onnx(np.zeros(14), mean, std)
    stranger_node = 101 + 7 * 5

    def handler(msg, ctx):
        if ctx.node_id == stranger_node:  # claims to be Cleveland; cannot sign as Cleveland
            return Message(RecordDict({P.PARTNER: ConfigRecord({P.NAME: C, P.SIGNATURE: b"\x30\x06\x02\x01\x01\x02"
                                                                                        b"\x01\x01"}),
                                       P.METRICS: MetricRecord({P.NUM_EXAMPLES: 10})}), reply_to=msg)
        return faults_partner.reply(msg, ctx, str(cons.dir))

    grid = FakeGrid(str(cons.dir), 6, handler=handler)  # partitions 4 and 5 are no partner of the consortium
    result = run_gate_query(grid, {"fp32": model, "int8": model}, len(cons.partners), 30.0,
                            partners=list(cons.partners), partner_keys=partner_public_keys(cons),
                            context_id=bytes.fromhex(cons.context_id), expected_n=N_TEST)
    partner_nodes = set(grid.node_ids[:4])
    with_models = [m.metadata.dst_node_id for m in grid.sent if P.CANDIDATES in m.content]
    assert sorted(with_models) == sorted(partner_nodes)  # each partner once, nobody else
    assert {m.metadata.dst_node_id for m in grid.sent} == set(grid.node_ids)  # all were asked who they are
    assert sorted(result["per_partner"]) == sorted(HOSPITALS)
    assert set(result["sent_to"].values()) == partner_nodes
    stranger, unknown = f"{C}? (node-{stranger_node})", f"node-{grid.node_ids[4]}"
    assert "does not verify" in result["failed"][stranger] and "partition-id" in result["failed"][unknown]


class _LateGrid(FakeGrid):
    """Holds node ``late``'s round-1 train reply back until the next delivery (round 2's
    train messages): it reaches the SuperLink after the round-1 train round closed."""

    def __init__(self, *a, late: int, **kw):
        super().__init__(*a, **kw)
        self.late, self.held, self.train_pushes = late, [], 0

    def push_messages(self, messages):
        messages = list(messages)
        kind = messages[0].metadata.message_type if messages else ""
        if self.held and messages:
            for reply in self.held:
                self._ready.setdefault(reply.metadata.reply_to_message_id, []).append(reply)
            self.held = []
        ids = super().push_messages(messages)
        if kind == "train":
            self.train_pushes += 1
            if self.train_pushes == 1:
                for m in messages:
                    if m.metadata.dst_node_id == self.late:
                        self.held += self._ready.pop(m.metadata.message_id, [])
        return ids


def test_kind_a_reply_after_the_round_closed_is_recorded_late_and_not_counted(consortium, tmp_path, server_identity):
    cons, _ = consortium
    grid = _LateGrid(str(cons.dir), 4, late=101 + 7 * 1)  # Hungary's node
    recs, status, out = _run(consortium, tmp_path, rounds=2, grid=grid, timeout_s=1.0)
    assert status["status"] == "finished"
    first, second = recs
    assert first["late"] == {H: "train: no reply within the round's 1 s"}
    assert "no reply to the train message within the deadline" in first["rejected"][H]
    assert first["accepted"] == [C, S, V] and first["total_weight"] == sum(N_TRAIN[p] for p in (C, S, V))
    assert H in first["per_partner"]  # its evaluate reply was on time
    # noted in the record open when it came: round 1's (it closes with round 2's train replies) or round 2's
    came = {**first.get("late_replies", {}), **second.get("late_replies", {})}
    assert came == {H: "its reply to the train message of round 1 came after that round closed; not counted"}
    assert "late" not in second and second["accepted"] == [C, H, S, V]
