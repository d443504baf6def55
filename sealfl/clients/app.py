"""The partner's Flower ClientApp (Message API, flwr 1.42).

Handlers:

- ``query`` (``{"query": "stats"}``): encrypt ``[n, Σx, Σx²]`` of the local training split;
  (``{"query": "evaluate-onnx"}``): score candidate release models on the local test
  split and reply ``{correct, n}`` counts only.
- ``train``: decrypt the global model (key holder), train locally, reply with
  E(n · w_local) only -- no plaintext weights leave the partner.
- ``evaluate``: decrypt the global model, evaluate on the local test split, reply with
  plaintext metrics (accuracy, loss, counts).

Which partner a node is: ``node_config["partner"]`` (deployment) or
``node_config["partition-id"]`` (simulation: index into the consortium's partner list).
The consortium directory: ``node_config["consortium-dir"]`` or the one given to
:func:`make_client_app`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from sealfl.common import protocol as P
from sealfl.common.errors import CiphertextError
from sealfl.common.testpoints import testpoint

from .data import load_partition
from .errors import ClientError
from .kit import PartnerKit, kit_dir, load_kit
from .onnx_eval import evaluate_onnx
from .stats import local_sums, mean_std
from .task import HeartTask, TrainConfig

log = logging.getLogger(__name__)
TASK = HeartTask()


def _resolve(context: Context, default_dir: str | None) -> tuple[PartnerKit, str]:
    cfg = context.node_config
    cdir = str(cfg.get("consortium-dir", default_dir or ""))
    if not cdir:
        raise ClientError("no consortium directory: set node_config 'consortium-dir'")
    if "partner" in cfg:
        name = str(cfg["partner"])
    else:
        partners = json.loads((Path(cdir) / "consortium.json").read_text())["partners"]
        pid = int(cfg["partition-id"])
        if not 0 <= pid < len(partners):
            raise ClientError(f"partition-id {pid} but the consortium has {len(partners)} partners")
        name = partners[pid]
    return load_kit(str(kit_dir(cdir, name))), name


def decode_global(record: ArrayRecord, kit: PartnerKit, n_params: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Turn the server's ``"global"`` record into (params (P,), mean (13,), std (13,)), all float64.

    Decrypts the aggregate and divides by the total weight (key-holder side of FedAvg).
    Raises CiphertextError if a ciphertext does not decrypt under this kit's context.
    """
    stats = kit.codec.decrypt(P.from_u8(record["stats_ct"].numpy()))
    mean, std = mean_std(stats)
    if "model_plain" in record:
        params = record["model_plain"].numpy().astype(np.float64)
    else:
        weight = float(record["model_weight"].numpy()[0])
        if weight <= 0:
            raise CiphertextError("aggregate weight is not positive")
        params = kit.codec.decrypt(P.from_u8(record["model_ct"].numpy()), n_params) / weight
    if params.shape != (n_params,):
        raise CiphertextError(f"global model has shape {params.shape}, expected ({n_params},)")
    return params, mean, std


def _train_config(cfg: ConfigRecord) -> TrainConfig:
    d = TrainConfig()
    return TrainConfig(
        local_epochs=int(cfg.get("local-epochs", d.local_epochs)),
        lr=float(cfg.get("lr", d.lr)),
        batch_size=int(cfg.get("batch-size", d.batch_size)),
        seed=int(cfg.get("seed", d.seed)),
        proximal_mu=float(cfg.get("proximal-mu", d.proximal_mu)),
    )


def _open_round(msg: Message, context: Context, consortium_dir: str | None):
    """Common start of train/evaluate: kit, partner name, config, local data, decrypted global model."""
    kit, name = _resolve(context, consortium_dir)
    cfg = msg.content[P.CONFIG]
    part = load_partition(name, seed=int(cfg.get("data-seed", 42)))
    return kit, name, cfg, part, decode_global(msg.content[P.GLOBAL], kit, TASK.n_params)


def handle_query(msg: Message, context: Context, consortium_dir: str | None = None) -> Message:
    """``query`` handler: reply E([n, Σx, Σx²]) of the local training split."""
    kit, name = _resolve(context, consortium_dir)
    what = msg.content[P.CONFIG].get("query", "")
    if what == P.QUERY_EVAL_ONNX:
        return _evaluate_candidates(msg, name)
    if what != P.QUERY_STATS:
        raise ClientError(f"unknown query {what!r}")
    part = load_partition(name, seed=int(msg.content[P.CONFIG].get("data-seed", 42)))
    blob = kit.codec.encrypt(local_sums(part.x_train))
    content = RecordDict({
        P.STATS: ArrayRecord({"stats_ct": _array(blob)}),
        P.METRICS: MetricRecord({P.NUM_EXAMPLES: part.n_train}),
        P.PARTNER: ConfigRecord({"name": name}),
    })
    return Message(content=content, reply_to=msg)


def handle_train(msg: Message, context: Context, consortium_dir: str | None = None) -> Message:
    """``train`` handler: decrypt the global model, train, reply E(n · w_local) and n."""
    kit, name, cfg, part, (params, mean, std) = _open_round(msg, context, consortium_dir)
    tc = _train_config(cfg)
    rnd = int(cfg.get("server-round", 0))
    testpoint("train", rnd)
    new, metrics = TASK.train(params, part.x_train, part.y_train, mean, std, tc, tc.seed + 1000 * rnd + kit.index)
    n = part.n_train
    blob = kit.codec.encrypt(new * n)
    log.info("partner %s round %d: trained on %d rows, loss %.4f", name, rnd, n, metrics["train_loss"])
    content = RecordDict({
        P.UPDATE: ArrayRecord({"update_ct": _array(blob)}),
        P.METRICS: MetricRecord({P.NUM_EXAMPLES: n, "train_loss": float(metrics["train_loss"])}),
        P.PARTNER: ConfigRecord({"name": name}),
    })
    return Message(content=content, reply_to=msg)


def handle_evaluate(msg: Message, context: Context, consortium_dir: str | None = None) -> Message:
    """``evaluate`` handler: decrypt the global model, reply local test metrics."""
    kit, name, cfg, part, (params, mean, std) = _open_round(msg, context, consortium_dir)
    m = TASK.evaluate(params, part.x_test, part.y_test, mean, std)
    content = RecordDict({
        P.METRICS: MetricRecord({
            P.NUM_EXAMPLES: m["n"], "accuracy": m["accuracy"], "loss": m["loss"], "correct": m["correct"],
        }),
        P.PARTNER: ConfigRecord({"name": name}),
    })
    return Message(content=content, reply_to=msg)


def _evaluate_candidates(msg: Message, name: str) -> Message:
    """Score each candidate ONNX model on this partner's test split; reply counts only."""
    testpoint("gate-query")
    metrics: dict[str, int] = {}
    for cand, arr in msg.content[P.CANDIDATES].items():
        r = evaluate_onnx(name, P.from_u8(arr.numpy()), seed=int(msg.content[P.CONFIG].get("data-seed", 42)))
        metrics[f"{cand}.correct"] = r["correct"]
        metrics[f"{cand}.n"] = r["n"]
    content = RecordDict({P.METRICS: MetricRecord(metrics), P.PARTNER: ConfigRecord({"name": name})})
    return Message(content=content, reply_to=msg)


def make_client_app(consortium_dir: str | None = None) -> ClientApp:
    """Build the partner ClientApp. ``consortium_dir`` is the default kit location."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return handle_query(msg, context, consortium_dir)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return handle_train(msg, context, consortium_dir)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return handle_evaluate(msg, context, consortium_dir)

    return app


def _array(blob: bytes) -> Array:
    return Array(P.to_u8(blob))
