"""EncryptedFedAvg: weighted FedAvg where the aggregator only adds CKKS ciphertexts.

Protocol (see :mod:`sealfl.common.protocol`): partner i replies E(n_i · w_i) and n_i;
the strategy adds the valid ciphertexts into E(Σ n_i w_i) and sums N = Σ n_i; the next
round's partners decrypt and divide (McMahan et al. 2017, FedAvg, eq. for w_{t+1};
the HE variant follows NVFlare's HE aggregation filter design).

Reuses Flower's :class:`flwr.serverapp.strategy.FedAvg` for node sampling and message
construction; replaces aggregation. It never holds a secret key: construction refuses a
codec whose context has one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from sealfl.common import protocol as P
from sealfl.common.he import CKKSCodec
from sealfl.common.testpoints import testpoint

from .aggregate import Validated, sum_chunks, validate_frames
from .bookkeeping import CampaignDir
from .errors import NotEnoughPartnersError, SecretKeyPresentError

log = logging.getLogger(__name__)


def partner_name(msg: Message) -> str:
    """The partner name a reply carries, else ``node-<id>``."""
    try:
        return str(msg.content[P.PARTNER]["name"])
    except Exception:  # error replies have no content
        return f"node-{msg.metadata.src_node_id}"


class EncryptedFedAvg(FedAvg):
    """FedAvg over CKKS ciphertexts.

    Args:
        codec: public CKKS codec of the campaign (must NOT hold the secret key).
        n_params: length of the flat model vector.
        min_partners: fewest valid updates a round may aggregate.
        round_log: the campaign directory: the round's aggregate is staged in
            ``aggregate_train`` and committed with its record when the round ends
            (``aggregate_evaluate``), see :mod:`sealfl.server.bookkeeping` (optional).
        shards: Ray tasks for summation of large models (1 = in-process; on 2 cores the
            2-task Ray sum was slower than in-process at every size in bench/he_bench.py).
    Raises:
        SecretKeyPresentError: ``codec`` holds a secret key.
    """

    def __init__(self, codec: CKKSCodec, n_params: int, *, min_partners: int = 2, num_partners: int = 2,
                 round_log: CampaignDir | None = None, shards: int = 1):
        if codec.has_secret_key:
            raise SecretKeyPresentError("the aggregator's CKKS context holds a secret key; give it the public context")
        super().__init__(
            fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=num_partners,
            min_evaluate_nodes=num_partners, min_available_nodes=num_partners,
            arrayrecord_key=P.GLOBAL, configrecord_key=P.CONFIG,
        )
        self.codec = codec
        self.n_params = n_params
        self.min_partners = min_partners
        self.round_log = round_log
        self.shards = shards
        self.stats_ct: bytes | None = None
        self._t_round = 0.0

    def summary(self) -> None:
        log.info("EncryptedFedAvg: CKKS N=%d, %d parameters, min_partners=%d",
                 self.codec.params.poly_modulus_degree, self.n_params, self.min_partners)

    def configure_train(self, server_round, arrays, config, grid):
        self._t_round = time.perf_counter()
        if "stats_ct" in arrays:
            self.stats_ct = P.from_u8(arrays["stats_ct"].numpy())
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate and add the partners' ciphertexts.

        Returns the new ``"global"`` ArrayRecord (``model_ct``, ``model_weight``,
        ``stats_ct``) and a MetricRecord (weighted train loss, accepted/rejected counts).
        Raises NotEnoughPartnersError if fewer than ``min_partners`` updates are valid.
        """
        t0 = time.perf_counter()
        frames: dict[str, bytes] = {}
        weights: dict[str, float] = {}
        losses: dict[str, float] = {}
        rejected: dict[str, str] = {}
        for msg in replies:
            name = partner_name(msg)
            if msg.has_error():
                rejected[name] = f"client error: {msg.error.reason}"
                log.warning("partner %s failed this round: %s", name, msg.error.reason)
                continue
            try:
                frames[name] = P.from_u8(msg.content[P.UPDATE]["update_ct"].numpy())
                weights[name] = float(msg.content[P.METRICS][P.NUM_EXAMPLES])
                losses[name] = float(msg.content[P.METRICS].get("train_loss", float("nan")))
                if weights[name] <= 0:
                    raise ValueError("num-examples is not positive")
            except (KeyError, ValueError, TypeError) as exc:
                frames.pop(name, None)
                rejected[name] = f"malformed reply: {exc}"
                log.warning("rejected the update of partner %s: malformed reply (%s)", name, exc)
        valid: Validated = validate_frames(self.codec, frames, self.n_params)
        rejected.update(valid.rejected)
        accepted = sorted(valid.chunks)
        if len(accepted) < self.min_partners:
            raise NotEnoughPartnersError(
                f"round {server_round}: only {len(accepted)} valid partner update(s) "
                f"({', '.join(accepted) or 'none'}), min_partners={self.min_partners}; rejected: "
                + "; ".join(f"{k}: {v}" for k, v in rejected.items())
            )
        testpoint("aggregate", server_round)
        model_ct = sum_chunks(self.codec, valid, self.n_params, shards=self.shards)
        total = float(sum(weights[k] for k in accepted))
        loss = float(sum(losses[k] * weights[k] for k in accepted) / total)
        bytes_in = sum(len(frames[k]) for k in frames)
        if self.stats_ct is None:
            raise RuntimeError("stats ciphertext missing from the global record")
        record = ArrayRecord({
            "model_ct": Array(P.to_u8(model_ct)),
            "model_weight": Array(np.array([total], dtype=np.float64)),
            "stats_ct": Array(P.to_u8(self.stats_ct)),
        })
        if self.round_log is not None:
            self.round_log.note(
                accepted=accepted, rejected=rejected, total_weight=total, train_loss=loss,
                ciphertext_bytes_in=bytes_in, aggregate_bytes=len(model_ct),
                fp32_bytes_per_update=4 * self.n_params, aggregate_seconds=time.perf_counter() - t0,
            )
            self.round_log.stage_checkpoint(server_round, model_ct, total, self.stats_ct)
        log.info("round %d: added %d ciphertexts (%d bytes), rejected %d", server_round, len(accepted), bytes_in, len(rejected))
        metrics = MetricRecord({"train_loss": loss, "accepted": len(accepted), "rejected": len(rejected)})
        return record, metrics

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Pooled test accuracy = Σ correct / Σ n over partners; per-partner figures go
        to the round record, and the round is committed (checkpoint, record, status)."""
        per: dict[str, dict] = {}
        for msg in replies:
            if msg.has_error():
                log.warning("partner %s failed evaluation: %s", partner_name(msg), msg.error.reason)
                continue
            m = msg.content[P.METRICS]
            per[partner_name(msg)] = {"accuracy": float(m["accuracy"]), "loss": float(m["loss"]),
                                      "correct": int(m["correct"]), "n": int(m[P.NUM_EXAMPLES])}
        if not per:
            if self.round_log is not None:
                self.round_log.note(pooled_test_accuracy=None, per_partner={},
                                    round_seconds=time.perf_counter() - self._t_round)
                self.round_log.end_round(server_round)
            return None
        n = sum(v["n"] for v in per.values())
        acc = sum(v["correct"] for v in per.values()) / max(n, 1)
        if self.round_log is not None:
            self.round_log.note(pooled_test_accuracy=acc, per_partner=per,
                                round_seconds=time.perf_counter() - self._t_round)
            self.round_log.end_round(server_round)
        return MetricRecord({"pooled_accuracy": acc, "n": n})
