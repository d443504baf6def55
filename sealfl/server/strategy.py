"""EncryptedFedAvg: weighted FedAvg where the aggregator only adds ciphertexts (CKKS, or packed BFV).

Protocol (see :mod:`sealfl.common.protocol`): partner i replies E(n_i · w_i) and n_i;
the strategy adds the valid ciphertexts into E(Σ n_i w_i) and sums N = Σ n_i; the next
round's partners decrypt and divide (McMahan et al. 2017, FedAvg, eq. for w_{t+1};
the HE variant follows NVFlare's HE aggregation filter design).

Reuses Flower's :class:`flwr.serverapp.strategy.FedAvg` for message construction; replaces
node sampling and aggregation. It never holds a secret key: construction refuses a
codec whose context has one.

Sampling: Flower's ``sample_nodes`` waits without end until ``min_available_nodes`` are
connected, so one partner leaving between rounds would hang the campaign. Here a round
goes to every node bound to a partner (:class:`sealfl.server.intake.Roster`) that is
connected now, as soon as at least ``min_partners`` of them are; bound partners that are
not connected are recorded as absent; fewer than ``min_partners`` for ``wait_s`` seconds
raise :class:`NotEnoughPartnersError`.

Every reply goes through :func:`sealfl.server.intake.screen` (who sent it) and the
reply kind's checks in :mod:`sealfl.server.validation` (what it says) before anything of
it counts; refusals name the partner and the reason in the log and in ``rounds.jsonl``.

One message per partner per round (:meth:`EncryptedFedAvg.start`): round k's aggregate is
evaluated by the partners inside round k+1's train message (``evaluate-round`` = k, see
:mod:`sealfl.common.protocol`), and only the last round's aggregate gets an evaluate message
of its own. Round k is therefore committed (:meth:`~sealfl.server.bookkeeping.CampaignDir.end_round`:
checkpoint and ``rounds.jsonl`` record, with its evaluation) when round k+1's train replies
are in -- right after they are screened, before anything of round k+1 can fail -- or, for
the last round, when its evaluate replies are. A record's ``pooled_test_accuracy``,
``per_partner`` and ``eval_rejected`` are still the evaluation of that round's aggregate;
its ``round_seconds`` run from its train message to its aggregate (which for k > 1 includes
the partners' evaluation of round k-1), and for the last round to the end of its evaluation.
Flower's own loop (a train and an evaluate message every round) also works:
:meth:`aggregate_evaluate` closes a round whose evaluation is pending.

The round's sum: in-process while each reply is checked (:class:`RunningSum`), or, when
the round's updates are large or many (:func:`sealfl.server.sharded.shard_count`), split
by chunk range into Ray tasks that check and add their range for every partner
(:func:`sealfl.server.sharded.sharded_sum`); a reply one task refuses counts in no range.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from sealfl.common import protocol as P
from sealfl.common.testpoints import testpoint
from sealfl.he.codecs import Codec
from sealfl.he.framed import PACKED
from sealfl.server.aggregate import RunningSum
from sealfl.server.bookkeeping import CampaignDir
from sealfl.server.errors import NotEnoughPartnersError, ReplyError, SecretKeyPresentError, ServerError
from sealfl.server.intake import Overdue, Roster, collect_late, connected_partner_nodes, screen
from sealfl.server.sharded import ray_cpus, shard_count, sharded_sum
from sealfl.server.streaming import aggregate_timing
from sealfl.server.validation import ReplyLimits, parse_eval_reply, parse_train_reply, split_evaluation

log = logging.getLogger(__name__)

class EncryptedFedAvg(FedAvg):
    """FedAvg over HE ciphertexts (CKKS or packed BFV).

    Args:
        codec: the aggregator's codec of the campaign (must NOT hold the secret key).
        n_params: length of the flat model vector.
        roster: who is who (bound in the statistics round) and what each partner declared.
        limits: caps on what partners may report.
        min_partners: fewest valid updates a round may aggregate.
        round_log: the campaign directory: the round's aggregate is staged in
            ``aggregate_train`` and committed with its record when the round ends
            (``aggregate_evaluate``), see :mod:`sealfl.server.bookkeeping` (optional).
        wait_s: longest wait for ``min_partners`` connected partner nodes per round.
        privacy: (ledger, DP config) of a DP campaign (:mod:`sealfl.he.dp_account`): each
            aggregated round is recorded and its ``privacy`` block (ε, δ so far) goes into
            ``rounds.jsonl``; None without DP.
        sum_shards: chunk-range shards of the round's sum (0: automatic, 1: in-process,
            N: N Ray tasks; see :func:`sealfl.server.sharded.shard_count`).
        first_round: the campaign round Flower's round 1 is (a resumed campaign: k + 1);
            every round number sent, logged and recorded is the campaign's.
    Raises:
        SecretKeyPresentError: ``codec`` holds a secret key.
    """

    def __init__(self, codec: Codec, n_params: int, *, roster: Roster, limits: ReplyLimits | None = None,
                 min_partners: int = 2, round_log: CampaignDir | None = None, wait_s: float = 600.0,
                 privacy: tuple | None = None, sum_shards: int = 0, first_round: int = 1):
        if codec.has_secret_key:
            raise SecretKeyPresentError("the aggregator's HE context holds a secret key; give it the public context")
        super().__init__(
            fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=min_partners,
            min_evaluate_nodes=min_partners, min_available_nodes=min_partners,
            arrayrecord_key=P.GLOBAL, configrecord_key=P.CONFIG,
        )
        self.codec = codec
        self.n_params = n_params
        self.roster = roster
        self.limits = limits or ReplyLimits()
        self.min_partners = min_partners
        self.round_log = round_log
        self.wait_s = wait_s
        self.privacy = privacy
        shard_count(sum_shards, 1, 1, 0)  # raises ValueError for a negative setting now, not in round 1
        self.sum_shards = int(sum_shards)
        self.round_offset = int(first_round) - 1
        self.last_shards = 1
        self.stats_ct: bytes | None = None
        self.stats_n: np.ndarray | None = None
        self._t_round = 0.0
        self._sent: list[Message] = []
        self._absent: dict[str, str] = {}
        self._last: tuple[bytes, float] | None = None  # the last published aggregate (DP: kept over a skipped round)
        self._overdue: dict[str, Overdue] = {}  # messages whose round closed without their reply
        self._late: dict[str, str] = {}  # this round's late partners (no reply by the deadline)
        self._pending: int | None = None  # the round whose aggregate awaits its evaluation (module docstring)
        self.evaluations: dict[int, MetricRecord] = {}  # campaign round -> pooled evaluation metrics

    def resume_with(self, model_ct: bytes, model_weight: float) -> None:
        """A resumed campaign: the checkpoint's aggregate is the last published one (what a
        DP round with too few partners keeps)."""
        self._last = (bytes(model_ct), float(model_weight))

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn=None) -> Result:
        """Run ``num_rounds`` rounds, one train message per partner each (each carrying the
        evaluation of the previous round's aggregate), then one evaluate message for the last
        aggregate (module docstring). Returns Flower's :class:`Result` (``train_metrics_clientapp``
        and ``evaluate_metrics_clientapp`` keyed by campaign round).

        Raises:
            ServerError: ``evaluate_fn`` given (the aggregator holds no plaintext model to evaluate).
            NotEnoughPartnersError: as :meth:`aggregate_train`.
        """
        if evaluate_fn is not None:
            raise ServerError("no server-side evaluation: the aggregator holds no plaintext model")
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        self.summary()
        result, arrays = Result(), initial_arrays
        for rnd in range(1, num_rounds + 1):
            replies = grid.send_and_receive(self.configure_train(rnd, arrays, train_config, grid), timeout=timeout)
            new, metrics = self.aggregate_train(rnd, replies)
            if new is not None:
                result.arrays = arrays = new
            if metrics is not None:
                result.train_metrics_clientapp[rnd + self.round_offset] = metrics
        if num_rounds >= 1:
            replies = grid.send_and_receive(self.configure_evaluate(num_rounds, arrays, evaluate_config, grid),
                                            timeout=timeout)
            self.aggregate_evaluate(num_rounds, replies)
        result.evaluate_metrics_clientapp.update(self.evaluations)
        return result

    def summary(self) -> None:
        log.info("EncryptedFedAvg: HE %s, %d parameters, min_partners=%d", self.codec.params.to_dict(),
                 self.n_params, self.min_partners)

    def _record_late(self, grid: Grid, screened=None, phase: str = "", server_round: int = 0) -> None:
        """Lateness for ``rounds.jsonl``: ``late`` (who had not answered by the deadline, per
        phase) and ``late_replies`` (replies to an earlier closed round that came since)."""
        if screened is not None:
            for mid, who in screened.unanswered.items():
                self._overdue[mid] = Overdue(who, phase, server_round)
                self._late[who] = (f"{self._late[who]}; " if who in self._late else "") + \
                    f"{phase}: no reply within the round's {self.wait_s:g} s"
            if self.round_log is not None and self._late:
                self.round_log.note(late=dict(self._late))
        came = collect_late(grid, self._overdue) if grid is not None else {}
        if came and self.round_log is not None:
            self.round_log.note(late_replies={**self.round_log.current.get("late_replies", {}), **came})

    def _configure(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid,
                   message_type: str, phase: str) -> list[Message]:
        self._record_late(grid)
        nodes, self._absent = connected_partner_nodes(grid, self.roster, self.min_partners, self.wait_s, phase)
        config["server-round"] = server_round
        if message_type == MessageType.TRAIN:  # the previous aggregate, evaluated in the same message
            config[P.EVALUATE_ROUND] = self._pending or 0
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        # keep the Message objects: the Grid sets their ids in place when it pushes them,
        # and each reply is matched to the message (and node) it answers
        self._sent = list(self._construct_messages(record, nodes, message_type))
        log.info("%s round %d: sending to %d partner nodes", phase, server_round, len(nodes))
        return self._sent

    def configure_train(self, server_round, arrays, config, grid):
        """Train messages to every connected bound partner node (see module docstring)."""
        server_round += self.round_offset
        self._t_round = time.perf_counter()
        self._late = {}
        if P.STATS_CT in arrays:
            self.stats_ct = P.from_u8(arrays[P.STATS_CT].numpy())
            self.stats_n = arrays[P.STATS_N].numpy()
        return self._configure(server_round, arrays, config, grid, MessageType.TRAIN, "train")

    def configure_evaluate(self, server_round, arrays, config, grid):
        """Evaluate messages to every connected bound partner node."""
        server_round += self.round_offset
        return self._configure(server_round, arrays, config, grid, MessageType.EVALUATE, "evaluate")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply (:func:`screen` + :func:`parse_train_reply`) and add the valid ciphertexts.

        Returns the new ``"global"`` ArrayRecord (``model_ct``, ``model_weight``,
        ``stats_ct``, ``stats_n``) and a MetricRecord (weighted train loss,
        accepted/rejected counts). Raises NotEnoughPartnersError (naming every refused
        partner and why) if fewer than ``min_partners`` updates are valid; nothing is
        written then, so the previous checkpoint stays.
        """
        server_round += self.round_offset
        t0 = time.perf_counter()
        roster = self.roster
        n_chunks = self.codec.params.n_chunks(self.n_params, PACKED)
        shards = shard_count(self.sum_shards, len(self._sent), n_chunks, ray_cpus() if self.sum_shards == 0 else 0)
        self.last_shards = shards
        running = RunningSum(self.codec, self.n_params)  # summed while checked: each chunk parsed once
        pending = self._pending
        evals: dict = {}
        eval_refused: dict[str, str] = {}

        def parse(p, c):
            if pending is not None:  # the evaluation first: it counts even if the update is refused
                c, evaluation = split_evaluation(c)
                try:
                    if evaluation is None:
                        raise ReplyError(P.EVALUATION, f"missing: the train message asked for the evaluation of "
                                                       f"round {pending}")
                    evals[p] = parse_eval_reply(evaluation, limits=self.limits, expected_n=roster.n_test.get(p),
                                                signed=roster.signed)
                except ReplyError as exc:
                    eval_refused[p] = f"{P.EVALUATION}: {exc}" if evaluation is not None else str(exc)
            return parse_train_reply(c, codec=self.codec, length=self.n_params, limits=self.limits,
                                     declared_n=roster.n_train[p], signed=roster.signed,
                                     running=None if shards > 1 else running, defer_ciphertext=shards > 1)

        screened = screen(replies, self._sent, roster, parse, phase="train")
        if pending is not None:  # round k-1 is complete: commit it before anything of round k can fail
            refused = {k: v for k, v in screened.rejected.items() if k not in evals}
            self._close_round(pending, evals, {**self._absent, **refused, **eval_refused})
        self._record_late(None, screened, "train", server_round)  # round k's lateness, after k-1 is closed
        rejected = {**self._absent, **screened.rejected}
        sharded_ct = None
        if shards > 1:  # the chunks' checks run in the shards; a refusal there refuses the reply whole
            split = {p: screened.accepted[p].chunks for p in sorted(screened.accepted)}
            sharded_ct, ok, refused = sharded_sum(self.codec, split, self.n_params, shards)
            for p, why in refused.items():
                rejected[p] = f"{P.UPDATE}.{P.UPDATE_CT}: {why}"
                log.warning("rejected the train reply of %s: %s", p, rejected[p])
                del screened.accepted[p]
            log.info("round %d: summed in %d chunk-range shards on Ray", server_round, shards)
        accepted = sorted(screened.accepted)
        if len(accepted) < self.min_partners and self.privacy is not None and self._last is not None:
            return self._skip_round(server_round, accepted, rejected)
        if len(accepted) < self.min_partners:
            raise NotEnoughPartnersError(
                f"round {server_round}: only {len(accepted)} valid partner update(s) "
                f"({', '.join(accepted) or 'none'}), min_partners={self.min_partners}; rejected: "
                + "; ".join(f"{k}: {v}" for k, v in rejected.items())
            )
        if self.stats_ct is None or self.stats_n is None:
            raise NotEnoughPartnersError("the statistics ciphertext is missing from the global record")
        upd = {p: screened.accepted[p] for p in accepted}
        testpoint("aggregate", server_round)
        if sharded_ct is not None:
            model_ct = sharded_ct
        elif running.partners != len(upd):  # parse is screen's last step: every accepted reply was added
            raise ServerError(f"internal: {running.partners} updates summed, {len(upd)} accepted")
        else:
            model_ct = running.frame()
        total = sum(r.n for r in upd.values())
        loss = float(sum(r.loss * r.n for r in upd.values()) / total)
        bytes_in = sum(r.nbytes for r in upd.values())
        record = ArrayRecord({
            P.MODEL_CT: Array(P.to_u8(model_ct)),
            P.MODEL_WEIGHT: Array(np.array([total], dtype=np.float64)),
            P.STATS_CT: Array(P.to_u8(self.stats_ct)),
            P.STATS_N: Array(np.asarray(self.stats_n, dtype=np.int64)),
        })
        if self.privacy is not None:  # every aggregate that may be decrypted is accounted
            self.privacy[0].record(self.privacy[1].sampling_rate)
        if self.round_log is not None:
            self.round_log.note(
                accepted=accepted, rejected=rejected, total_weight=total, train_loss=loss,
                ciphertext_bytes_in=bytes_in, aggregate_bytes=len(model_ct),
                fp32_bytes_per_update=4 * self.n_params, sum_shards=shards, **aggregate_timing(replies, t0),
            )
            if self.privacy is not None:
                ledger, dpc = self.privacy
                self.round_log.note(privacy=ledger.privacy_block(dpc.clip, dpc.min_partners, dpc.trust))
            self.round_log.stage_checkpoint(server_round, model_ct, total, self.stats_ct)
        self._last = (model_ct, total)
        self._await_evaluation(server_round)
        log.info("round %d: added %d ciphertexts (%d bytes), rejected %d", server_round, len(accepted), bytes_in, len(rejected))
        metrics = MetricRecord({"train_loss": loss, "accepted": len(accepted), "rejected": len(rejected)})
        return record, metrics

    def _skip_round(self, server_round: int, accepted: list[str], rejected: dict) -> tuple[None, MetricRecord]:
        """DP: fewer than k partners counted, so the sum would carry too little noise -- it is
        not made and nothing is published; the global model stays the last published one (its
        checkpoint is staged again under this round) and the campaign goes on. Not counted
        by the accountant: no aggregate of this round is ever decrypted."""
        model_ct, total = self._last
        msg = (f"too little noise: only {len(accepted)} partner update(s) ({', '.join(accepted) or 'none'}), "
               f"fewer than k={self.min_partners}; the round is not published")
        log.warning("round %d: %s", server_round, msg)
        if self.round_log is not None:
            self.round_log.note(accepted=accepted, rejected=rejected, skipped=msg, total_weight=total,
                                privacy=self.privacy[0].privacy_block(self.privacy[1].clip, self.privacy[1].min_partners,
                                                                      self.privacy[1].trust))
            self.round_log.stage_checkpoint(server_round, model_ct, total, self.stats_ct)
        self._await_evaluation(server_round)
        return None, MetricRecord({"accepted": len(accepted), "rejected": len(rejected)})

    def _await_evaluation(self, server_round: int) -> None:
        """Round ``server_round``'s aggregate is staged: its record waits for its evaluation
        (the next train message's, or :meth:`aggregate_evaluate`'s)."""
        self._pending = server_round
        if self.round_log is not None:
            self.round_log.note(round_seconds=time.perf_counter() - self._t_round)

    def _close_round(self, server_round: int, evals: dict, rejected: dict[str, str]) -> MetricRecord | None:
        """Record the evaluation of round ``server_round``'s aggregate -- pooled test accuracy =
        Σ correct / Σ n over the accepted ``evals`` (partner -> EvalReply), per-partner
        figures, ``rejected`` as ``eval_rejected`` -- and commit the round."""
        per: dict[str, dict] = {}
        for p in sorted(evals):
            r = evals[p]
            self.roster.n_test.setdefault(p, r.n)
            per[p] = {"accuracy": r.accuracy, "loss": r.loss, "correct": r.correct, "n": r.n}
        n = sum(v["n"] for v in per.values())
        acc = sum(v["correct"] for v in per.values()) / n if n else float("nan")
        self._pending = None
        if self.round_log is not None:
            self.round_log.note(pooled_test_accuracy=acc if per else None, per_partner=per, eval_rejected=rejected)
            self.round_log.end_round(server_round)
        log.info("round %d: evaluated by %d partners, pooled accuracy %s", server_round, len(per),
                 f"{acc:.4f}" if per else "none")
        metrics = MetricRecord({"pooled_accuracy": acc, "n": n}) if per else None
        if metrics is not None:
            self.evaluations[server_round] = metrics
        return metrics

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Pooled test accuracy = Σ correct / Σ n over the partners whose evaluate reply
        passes :func:`parse_eval_reply` (counts are integers, correct <= n, n equal to
        the partner's earlier n, accuracy = correct/n, loss finite and bounded); per-partner
        figures and refusals (``eval_rejected``) go to the round log, which closes the round
        (also when no reply counts: ``pooled_test_accuracy`` is then null). Used for the last
        round's aggregate (:meth:`start`), or every round under Flower's own loop."""
        server_round += self.round_offset
        roster = self.roster
        screened = screen(
            replies, self._sent, roster,
            lambda p, c: parse_eval_reply(c, limits=self.limits, expected_n=roster.n_test.get(p), signed=roster.signed),
            phase="evaluate")
        self._record_late(None, screened, "evaluate", server_round)
        if self.round_log is not None:
            self.round_log.note(round_seconds=time.perf_counter() - self._t_round)
        return self._close_round(server_round, screened.accepted, {**self._absent, **screened.rejected})
