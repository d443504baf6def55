"""The partner's Flower ClientApp (Message API, flwr 1.42).

Handlers:

- ``query`` (``{"query": "stats"}``): encrypt ``[n, Σx, Σx²]`` of the local training split;
  (``{"query": "evaluate-onnx"}``): score candidate release models on the local test
  split and reply ``{correct, n}`` counts only.
- ``train``: decrypt the global model (key holder; with a server optimizer, apply its
  step, :mod:`sealfl.he.server_opt`), train locally, reply with E((n / N) · [w_local,
  optimizer state]) only (N: the declared total of the statistics round,
  :func:`sealfl.he.decrypted.update_share`) -- no plaintext weights leave the partner.
  When the round's config names ``evaluate-round`` k > 0, the global model it received is
  round k's aggregate: the partner evaluates it first, as ``evaluate`` would, and the
  reply carries those metrics too (``"evaluation"``, :mod:`sealfl.common.protocol`).
- ``evaluate``: decrypt the global model, evaluate on the local test split, reply with
  plaintext metrics (accuracy, loss, counts).

Every reply is signed with the partner's kit key (:func:`sign_reply`; the aggregator
checks it, :mod:`sealfl.server.intake`). As a key holder the partner checks and rounds
what it decrypts before using it (:func:`~sealfl.clients.global_record.decode_global`,
:mod:`sealfl.he.decrypted`): the statistics count must equal the total the partners
declared, parameters and feature statistics must lie within the task's bounds, and
everything is rounded to the task's grids -- so the model it trains from, and the loss
and accuracy it reports (rounded to the metric grid too), carry no decryption noise.

Which partner a node is: ``node_config["kit-dir"]`` (a SuperNode started by ``sealfl
partner start KIT``: the kit says who it is), else ``node_config["partner"]`` or
``node_config["partition-id"]`` (simulation: index into the consortium's partner list)
within the consortium directory ``node_config["consortium-dir"]``, the one given to
:func:`make_client_app`, or ``run_config["consortium-dir"]`` (``flwr run .`` in the
local simulation federation). ``node_config["partner-key"]`` names the partner's private
key when it is not in the kit, ``node_config["data-path"]`` the partner's own data
(``sealfl partner start KIT --key K --data PATH``); both come only from the node's own
config: a ``data-path`` in the aggregator's round config is dropped (:func:`local_data`).

:data:`app` is the module-level ClientApp that ``[tool.flwr.app.components]`` in
``pyproject.toml`` names (``flwr run``, SuperNodes); :func:`make_client_app` builds the
same handlers around a default consortium directory (``sealfl campaign run`` in simulation).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from sealfl.attestation import keys as _keys
from sealfl.clients.errors import ClientError, DataError
from sealfl.clients.global_record import decode_global, decode_global_state, global_int, task_of
from sealfl.clients.kit import PartnerKit, cached_kit, kit_dir
from sealfl.common import protocol as P
from sealfl.common.testpoints import testpoint
from sealfl.he.decrypted import round_metric, update_share
from sealfl.he.dp import DPConfig
from sealfl.he.errors import PrivacyError
from sealfl.he.framed import PACKED, WIDE
from sealfl.he.server_opt import ServerOpt

log = logging.getLogger(__name__)


def _resolve(context: Context, default_dir: str | None) -> tuple[PartnerKit, str]:
    cfg = context.node_config
    if "kit-dir" in cfg:  # a SuperNode started with its own kit (sealfl partner start KIT)
        key = cfg.get(PARTNER_KEY_KEY)
        kit = cached_kit(str(Path(str(cfg["kit-dir"])).resolve()), str(key) if key else None)
        return kit, kit.partner
    run_cfg = getattr(context, "run_config", None) or {}
    cdir = str(cfg.get("consortium-dir", default_dir or run_cfg.get("consortium-dir", "") or ""))
    if not cdir:
        raise ClientError("no partner kit: set node_config 'kit-dir' (sealfl partner start KIT) or 'consortium-dir' "
                          "(node or run config)")
    if "partner" in cfg:
        name = str(cfg["partner"])
    else:
        partners = json.loads((Path(cdir) / "consortium.json").read_text())["partners"]
        pid = int(cfg["partition-id"])
        if not 0 <= pid < len(partners):
            raise ClientError(f"partition-id {pid} but the consortium has {len(partners)} partners")
        name = partners[pid]
    return cached_kit(str(kit_dir(cdir, name))), name


def sign_reply(kit: PartnerKit, msg: Message, content: RecordDict) -> RecordDict:
    """Put ``{"name", "signature"}`` into ``content["partner"]``: the kit key's ECDSA
    P-256 signature over :func:`sealfl.common.protocol.reply_statement` for a reply to
    ``msg`` (campaign context id, ``msg``'s id and type, the name, the content digest).
    Returns ``content``. Raises ClientError if the kit has no signing key."""
    if kit.signing_key is None:
        raise ClientError(f"the kit of partner {kit.partner} has no signing key")
    content[P.PARTNER] = ConfigRecord({P.NAME: kit.partner})
    stmt = P.reply_statement(kit.codec.context_id, msg.metadata.message_id, msg.metadata.message_type, kit.partner,
                             P.content_digest(content))
    content[P.PARTNER] = ConfigRecord({P.NAME: kit.partner, P.SIGNATURE: _keys.sign(kit.signing_key, stmt)})
    return content


#: node_config keys: the partner's private key file and its own data (a file or directory)
PARTNER_KEY_KEY = "partner-key"
DATA_KEY = "data-path"


def check_bundled_partner(task, name: str) -> None:
    """Refuse a partner without its own data whose name is not one the task bundles demo
    data for (``task.partners``, by exact name: a partner named ``"2"`` is not hospital 2).

    Raises:
        DataError: ``name`` is not in ``task.partners``; the message says to give ``--data``.
    """
    if name not in task.partners:
        raise DataError(f"partner {name!r} has no bundled demo data (the {task.name} task has data for "
                        f"{', '.join(task.partners)} only): give your own with --data PATH")


def local_data(task, name: str, cfg, node_config=None):
    """The partner's training data: ``task.load_data`` with the round config ``cfg``, where
    ``data-path`` is the node's own (``node_config``) or absent -- never the aggregator's.
    Without one, only a partner the task bundles data for (:func:`check_bundled_partner`).

    Raises:
        DataError: no own data and no bundled data for ``name``, or the task refused the data.
    """
    conf = {k: v for k, v in dict(cfg).items() if k != DATA_KEY}
    if node_config and node_config.get(DATA_KEY):
        conf[DATA_KEY] = str(node_config[DATA_KEY])
    else:
        check_bundled_partner(task, name)
    return task.load_data(name, conf)


def _open_round(msg: Message, context: Context, consortium_dir: str | None):
    """Common start of train/evaluate: kit, task, partner name, config, local data, decrypted global model."""
    kit, name = _resolve(context, consortium_dir)
    task = task_of(kit)
    cfg = msg.content[P.CONFIG]
    data = local_data(task, name, cfg, context.node_config)
    return kit, task, name, cfg, data, decode_global_state(msg.content[P.GLOBAL], kit, task, round_opt(cfg),
                                                           round_dp(cfg, context.node_config))


#: node_config keys a partner sets to pin its own DP floor (the round config comes through the aggregator)
DP_FLOOR_KEYS = ("dp-min-partners", "dp-noise-multiplier", "dp-trust")


def round_dp(cfg, node_config=None) -> DPConfig | None:
    """The campaign's DP settings named in a round's config (None: no DP).

    The round config is written by the coordinator and relayed by the aggregator; a partner
    that does not take it on trust pins a floor in its own ``node_config`` (any of
    :data:`DP_FLOOR_KEYS`): then a round without DP, or with a smaller k, noise multiplier or
    t than the floor, is refused before anything is decrypted or trained.

    Raises ClientError for malformed or nonsense settings, or a round below the floor."""
    try:
        dpc = DPConfig.from_config(cfg)
    except PrivacyError as exc:
        raise ClientError(f"the round's config: {exc}") from exc
    floor = {k: node_config[k] for k in DP_FLOOR_KEYS if node_config and k in node_config}
    if floor:
        if dpc is None:
            raise ClientError(f"this partner requires DP (node config {floor}) but the round has none; refusing it")
        got = {"dp-min-partners": dpc.min_partners, "dp-noise-multiplier": dpc.noise_multiplier,
               "dp-trust": dpc.trust}
        for key, low in floor.items():
            if got[key] < float(low):
                raise ClientError(f"the round's {key} = {got[key]:g} is below this partner's floor {float(low):g} "
                                  "(node config): refusing it")
    return dpc


def round_opt(cfg) -> ServerOpt:
    """The campaign's server optimizer named in a round's config (FedAvg if none).
    Raises ClientError for an unknown or out-of-range one."""
    from sealfl.he.errors import ServerOptError

    try:
        return ServerOpt.from_config(cfg)
    except ServerOptError as exc:
        raise ClientError(f"the round's config: {exc}") from exc


def handle_query(msg: Message, context: Context, consortium_dir: str | None = None) -> Message:
    """``query`` handler: reply E([n, Σx, Σx²]) of the local training split."""
    kit, name = _resolve(context, consortium_dir)
    what = msg.content[P.CONFIG].get(P.QUERY, "")
    task = task_of(kit)
    if what == P.QUERY_EVAL_ONNX:
        reply = _evaluate_candidates(msg, kit, task, name, context.node_config)
        sign_reply(kit, msg, reply.content)
        return reply
    if what != P.QUERY_STATS:
        raise ClientError(f"unknown query {what!r}")
    data = local_data(task, name, msg.content[P.CONFIG], context.node_config)
    blob = kit.codec.encrypt(task.local_stats(data), WIDE)
    content = RecordDict({
        P.STATS: ArrayRecord({P.STATS_CT: _array(blob)}),
        P.METRICS: MetricRecord({P.NUM_EXAMPLES: int(task.n_train(data))}),
    })
    return Message(content=sign_reply(kit, msg, content), reply_to=msg)


def handle_train(msg: Message, context: Context, consortium_dir: str | None = None) -> Message:
    """``train`` handler: decrypt the global model, train, reply E((n / N) · w_local) and n."""
    kit, task, name, cfg, data, (params, mean, std, state) = _open_round(msg, context, consortium_dir)
    rnd = int(cfg.get("server-round", 0))
    testpoint("train", rnd)
    evaluation = _evaluation(task, params, data, mean, std) if int(cfg.get(P.EVALUATE_ROUND, 0)) > 0 else None
    n = task.n_train(data)
    dpc = round_dp(cfg, context.node_config)
    if dpc is not None:
        blob, loss = _dp_train(kit, task, data, params, mean, std, cfg, dpc, global_int(msg.content[P.GLOBAL], P.STATS_N))
    else:
        new, metrics = task.train_round(params, data, mean, std, cfg, 1000 * rnd + kit.index)
        wire = round_opt(cfg).pack(new, state)
        blob = kit.codec.encrypt(update_share(wire, int(n), global_int(msg.content[P.GLOBAL], P.STATS_N),
                                              kit.codec.WEIGHTING, kit.codec.params.update_layout))
        loss = round_metric(metrics["train_loss"], task.decrypt_bounds)
    log.info("partner %s round %d: trained on %d rows, loss %.4f", name, rnd, n, loss)
    content = RecordDict({
        P.UPDATE: ArrayRecord({P.UPDATE_CT: _array(blob)}),
        P.METRICS: MetricRecord({P.NUM_EXAMPLES: int(n), P.TRAIN_LOSS: loss}),
    })
    if evaluation is not None:  # the previous round's aggregate, evaluated before training from it
        content[P.EVALUATION] = evaluation
    return Message(content=sign_reply(kit, msg, content), reply_to=msg)


def _dp_train(kit: PartnerKit, task, data, params, mean, std, cfg, dpc: DPConfig, declared_total: int
              ) -> tuple[bytes, float]:
    """One DP round at a partner (:mod:`sealfl.he.dp`): a Poisson batch at ``dpc.sampling_rate``
    (secret ChaCha20 randomness), its per-example clipped gradient sum (Opacus, the task's
    ``dp_gradient_sum``), the upload ``(n/N) w + (-(lr/B) Σ clip(g))`` with ``B = q N`` plus this
    partner's Skellam share and the count slot, encrypted as integers. Returns (frame, 0.0):
    no training loss is reported under DP (it is a plaintext function of the records).

    Raises ClientError when the task has no DP training, the codec is not packed BFV or a
    server optimizer is set (DP campaigns run FedAvg at the key holders)."""
    from sealfl.clients.dp_local import poisson_batch
    from sealfl.he.dp import dp_upload, partner_noise_variance, secure_rng, step_upload

    if not hasattr(task, "dp_gradient_sum"):
        raise ClientError(f"the {task.name} task has no DP training")
    if kit.codec.WEIGHTING != "share" or not hasattr(kit.codec, "encrypt_integers"):
        raise ClientError("DP noise lives in packed BFV's integers: this consortium's codec is not BFV")
    if kit.codec.params.update_layout.id != PACKED.id:
        raise ClientError(f"DP noise is calibrated for the 27-bit packing; this consortium packs "
                          f"{kit.codec.params.update_layout.bits}-bit values (create it without --pack-bits)")
    if round_opt(cfg).wire_length(task.n_params) != task.n_params:
        raise ClientError("DP campaigns run FedAvg at the key holders: no server optimizer state")
    rng = secure_rng()
    n = int(task.n_train(data))
    idx = poisson_batch(n, dpc.sampling_rate, rng)
    grad_sum = task.dp_gradient_sum(params, data, idx, mean, std, dpc.clip)
    lr = float(cfg.get("lr", task.train_defaults()["lr"]))
    batch = dpc.sampling_rate * int(declared_total)
    values = update_share(params, n, int(declared_total), kit.codec.WEIGHTING) + step_upload(grad_sum, lr, batch)
    try:
        ints = dp_upload(values, partner_noise_variance(dpc, lr, batch, task.n_params), rng)
    except PrivacyError as exc:
        raise ClientError(str(exc)) from exc
    log.info("partner %s DP round: %d of %d rows sampled (q=%g), clip %g, noise share for k=%d, t=%d",
             kit.partner, idx.size, n, dpc.sampling_rate, dpc.clip, dpc.min_partners, dpc.trust)
    return kit.codec.encrypt_integers(ints), 0.0


def handle_evaluate(msg: Message, context: Context, consortium_dir: str | None = None) -> Message:
    """``evaluate`` handler: decrypt the global model, reply local test metrics."""
    kit, task, name, cfg, data, (params, mean, std, _state) = _open_round(msg, context, consortium_dir)
    content = RecordDict({P.METRICS: _evaluation(task, params, data, mean, std)})
    return Message(content=sign_reply(kit, msg, content), reply_to=msg)


def _evaluation(task, params, data, mean, std) -> MetricRecord:
    """The global model ``params`` scored on the local test split: ``num-examples``,
    ``accuracy`` (= correct / n), ``loss`` (rounded to the metric grid) and ``correct``."""
    m = task.evaluate_round(params, data, mean, std)
    n, correct = int(m["n"]), int(m["correct"])
    return MetricRecord({
        P.NUM_EXAMPLES: n, P.ACCURACY: correct / n if n else 0.0,
        P.LOSS: round_metric(m["loss"], task.decrypt_bounds), P.CORRECT: correct,
    })


def _evaluate_candidates(msg: Message, kit: PartnerKit, task, name: str, node_config=None) -> Message:
    """Score each candidate model on this partner's own held-out data; reply counts (and
    the task's float sums, e.g. summed NLL) only. A task that scores against the global
    model (causal-lm: the fp32 merged reference) gets it from the query's encrypted
    ``global`` record, decrypted here like a training round's."""
    testpoint("gate-query")
    cfg = msg.content[P.CONFIG]
    data = local_data(task, name, cfg, node_config)
    params = mean = std = None
    if P.GLOBAL in msg.content:
        params, mean, std = decode_global(msg.content[P.GLOBAL], kit, task, round_opt(cfg),
                                          round_dp(cfg, node_config))
    cands = {c: P.from_u8(arr.numpy()) for c, arr in msg.content[P.CANDIDATES].items()}
    scores = task.score_candidates(cands, data, params, mean, std)
    metrics: dict = {}
    for cand, v in scores.items():
        metrics[f"{cand}.correct"] = int(v["correct"])
        metrics[f"{cand}.n"] = int(v["n"])
        for key in task.candidate_sums:
            metrics[f"{cand}.{key}"] = round_metric(float(v[key]), task.decrypt_bounds)
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


#: the module-level ClientApp (``clientapp = "sealfl.clients.app:app"`` in pyproject.toml)
app = make_client_app()
