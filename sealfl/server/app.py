"""The aggregator's Flower ServerApp.

``main(grid, context)``:

1. load the campaign's PUBLIC HE context and measure that it holds no secret key
   (written to ``status.json`` as ``server_has_secret_key``; a secret context aborts);
2. statistics round: query every connected node for E([n, Σx, Σx²]) and its declared
   ``n``; each reply is screened (:mod:`sealfl.server.intake`: signature, one per
   partner) and checked (:func:`sealfl.server.validation.parse_stats_reply`); an
   accepted reply binds its node to its partner and fixes that partner's ``n`` for the
   campaign; the accepted ciphertexts are added and Σ n is recorded as
   ``stats_declared_n`` in ``status.json`` (key holders compare the decrypted count with it);
3. ``EncryptedFedAvg.start(...)`` for ``num_rounds`` rounds from the public initial model,
   with the partners bound in step 2;
4. record ``finished`` (or ``failed`` with the error) in ``status.json``.

Everything the coordinator needs afterwards is in the campaign directory
(:mod:`sealfl.server.bookkeeping`), so the same app runs under the simulation engine and
under a SuperLink.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from sealfl.common import protocol as P
from sealfl.he import codecs
from sealfl.he.codecs import Codec
from sealfl.he.dp import DPConfig
from sealfl.he.dp_account import Ledger
from sealfl.he.framed import WIDE
from sealfl.he.server_opt import ServerOpt
from sealfl.server.aggregate import Validated, sum_chunks
from sealfl.server.bookkeeping import CampaignDir
from sealfl.server.errors import CampaignDirError, NotEnoughPartnersError, SecretKeyPresentError, StaleRunError
from sealfl.server.intake import Roster, screen
from sealfl.server.strategy import EncryptedFedAvg
from sealfl.server.streaming import StreamingGrid
from sealfl.server.validation import ReplyLimits, parse_stats_reply

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """What the aggregator needs for one campaign (all plain data, JSON-serialisable).

    Attributes:
        campaign_dir: where status, round log and checkpoints go.
        public_context: path of the public HE context file.
        context_id: hex id of the campaign's HE context.
        he: the campaign's HE parameters (:mod:`sealfl.he.codecs` parameter dict: packed BFV or CKKS).
        num_partners: partners expected to connect.
        min_partners: fewest valid updates per round.
        num_rounds: training rounds.
        n_params: flat model length (partners upload ``ServerOpt.wire_length(n_params)``
            values: the model and the server optimizer's state named in ``train``).
        stats_length: length of the scaling-statistics vector ``[n, Σx, Σx²]``.
        initial_params: the public initial model (list of floats).
        train: extra train config sent to partners (local-epochs, lr, batch-size, the
            server optimizer's ``server-*`` keys, ...).
        timeout_s: seconds to wait for replies per round (and for partners to connect).
        partners: the consortium's partner names (the names a reply may claim).
        partner_keys: partner name -> PEM of its P-256 public key (the kit key); replies
            must be signed by it. Empty: name claims are not authenticated (warned).
        max_examples: cap on any row count a partner declares (:class:`ReplyLimits`).
        max_loss: cap on any loss a partner reports (:class:`ReplyLimits`).
        sum_shards: chunk-range shards of each round's sum on Ray (0: automatic by the
            round's size, 1: in-process; :mod:`sealfl.server.sharded`).
        resume_from: 0 for a new campaign; k > 0 for a resumed one (``sealfl campaign
            resume``): the app starts at round k + 1 from the checkpoint of round k (its
            encrypted global model and statistics), see :func:`resume_state`.
        epoch: the run epoch this run may write the campaign directory under (``status.json``'s
            ``epoch`` when the coordinator started or resumed it; 0: a directory from before
            epochs). A run whose epoch is no longer the directory's stops at its next write
            (:mod:`sealfl.server.bookkeeping`, fencing).
    """

    campaign_dir: str
    public_context: str
    context_id: str
    he: dict
    num_partners: int
    min_partners: int
    num_rounds: int
    n_params: int
    stats_length: int
    initial_params: list = field(default_factory=list)
    train: dict = field(default_factory=dict)
    timeout_s: float = 600.0
    partners: list = field(default_factory=list)
    partner_keys: dict = field(default_factory=dict)
    max_examples: int = ReplyLimits.max_examples
    max_loss: float = ReplyLimits.max_loss
    sum_shards: int = 0
    resume_from: int = 0
    epoch: int = 0

    def limits(self) -> ReplyLimits:
        """The :class:`ReplyLimits` these settings give (raises ServerError if invalid)."""
        return ReplyLimits(max_examples=self.max_examples, max_loss=self.max_loss)

    def roster(self) -> Roster:
        """A fresh :class:`Roster` of this campaign's partners and keys."""
        partners = list(self.partners) or sorted(self.partner_keys)
        return Roster.from_pems(partners, self.partner_keys or None, bytes.fromhex(self.context_id))

    def to_dict(self) -> dict:
        """The JSON object ``server_config.json`` holds."""
        return asdict(self)

    @classmethod
    def from_dict(cls, config: dict, where: str = "server_config.json") -> "ServerConfig":
        """Rebuild from :meth:`to_dict`'s object (sealfl 0.1's ``"ckks"`` is read as ``"he"``).

        Raises:
            CampaignDirError: a field is missing or unknown.
        """
        config = dict(config)
        if "he" not in config and "ckks" in config:
            config["he"] = config.pop("ckks")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise CampaignDirError(f"{where}: unknown fields {unknown}")
        try:
            return cls(**config)
        except TypeError as exc:
            raise CampaignDirError(f"{where}: {exc}") from exc

    @classmethod
    def load(cls, campaign_dir: str | Path) -> "ServerConfig":
        """Read a campaign's ``server_config.json`` (:meth:`CampaignDir.read_config`).

        Raises:
            CampaignDirError: missing, malformed, or a field is missing or unknown.
        """
        cd = CampaignDir(campaign_dir)
        return cls.from_dict(cd.read_config(), str(cd.config_path))


def wait_for_nodes(grid: Grid, want: int, timeout_s: float, need: int | None = None) -> list[int]:
    """Wait until ``want`` nodes are connected, at most ``timeout_s`` seconds; returns
    their ids. After the deadline, proceed with ``need`` (default: ``want``) or more.

    Raises NotEnoughPartnersError if fewer than ``need`` are connected at the deadline.
    """
    need = want if need is None else need
    t0 = time.monotonic()
    while len(ids := list(grid.get_node_ids())) < want:
        if time.monotonic() - t0 > timeout_s:
            if len(ids) >= need:
                log.warning("%d of %d partners connected within %.0f s; going on with them", len(ids), want, timeout_s)
                return ids
            raise NotEnoughPartnersError(f"only {len(ids)} of {want} partners connected within {timeout_s:.0f} s "
                                         f"(at least {need} needed)")
        time.sleep(0.2)
    return ids


def stats_round(grid: Grid, codec: Codec, cfg: ServerConfig, rlog: CampaignDir, roster: Roster) -> tuple[bytes, int]:
    """Query E([n, Σx, Σx²]) and n from every connected node, screen and check each reply,
    bind each accepted node to its partner, and add the accepted ciphertexts.

    Returns (aggregate frame, Σ declared n). Raises NotEnoughPartnersError if fewer than
    ``min_partners`` replies are accepted (naming every refusal).
    """
    ids = wait_for_nodes(grid, cfg.num_partners, cfg.timeout_s, need=cfg.min_partners)
    content = RecordDict({P.CONFIG: ConfigRecord({P.QUERY: P.QUERY_STATS, **_scalar(cfg.train)})})
    msgs = [Message(content=content, dst_node_id=nid, message_type=MessageType.QUERY) for nid in ids]
    replies = list(grid.send_and_receive(msgs, timeout=cfg.timeout_s))
    length, limits = cfg.stats_length, cfg.limits()
    screened = screen(replies, msgs, roster,
                      lambda p, c: parse_stats_reply(c, codec=codec, length=length, limits=limits, signed=roster.signed),
                      phase="statistics", bind=True)
    accepted = sorted(screened.accepted)
    if len(accepted) < cfg.min_partners:
        raise NotEnoughPartnersError(
            f"statistics round: {len(accepted)} valid replies ({', '.join(accepted) or 'none'}), "
            f"min_partners={cfg.min_partners}; rejected: " + "; ".join(f"{k}: {v}" for k, v in screened.rejected.items()))
    for p in accepted:
        roster.n_train[p] = screened.accepted[p].n
    declared = sum(roster.n_train[p] for p in accepted)
    rlog.note(stats_partners=accepted, stats_rejected=screened.rejected)
    rlog.set_status(stats_declared_n=declared, stats_partners=accepted)
    valid = Validated({p: screened.accepted[p].chunks for p in accepted}, screened.rejected)
    return sum_chunks(codec, valid, length, layout=WIDE), declared


def _scalar(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool))}


@dataclass(frozen=True)
class ResumeState:
    """Where a resumed campaign starts: the checkpoint of round ``round``, the statistics'
    declared total the partners were told (``status.json``'s ``stats_declared_n``; None if
    not recorded) and how many of the finished rounds were noised (DP accounting)."""

    round: int
    model_ct: bytes
    model_weight: float
    stats_ct: bytes
    declared_n: int | None
    noised_rounds: int


def resume_state(rlog: CampaignDir, cfg: ServerConfig) -> ResumeState:
    """Read what a resumed campaign starts from (before :meth:`CampaignDir.begin`).

    Raises:
        CampaignDirError: no readable checkpoint, or it is not of round ``cfg.resume_from``.
    """
    ck = rlog.read_checkpoint()
    if ck.round != cfg.resume_from or not 0 < ck.round < cfg.num_rounds:
        raise CampaignDirError(f"{rlog.checkpoint_path} holds round {ck.round}, the campaign resumes after round "
                               f"{cfg.resume_from} of {cfg.num_rounds}; run 'sealfl campaign resume' again")
    try:
        declared = rlog.read_status().get("stats_declared_n")
    except CampaignDirError:
        declared = None
    declared = declared if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0 else None
    noised = sum(1 for r in rlog.rounds() if r["round"] <= ck.round and not r.get("skipped"))
    return ResumeState(ck.round, ck.model_ct, ck.model_weight, ck.stats_ct, declared, noised)


def run_server(grid: Grid, cfg: ServerConfig) -> None:
    """The ServerApp body (see module docstring). Raises what the campaign failed on,
    after recording it in ``status.json``."""
    rlog = CampaignDir(cfg.campaign_dir, cfg.num_rounds, epoch=cfg.epoch)
    resume = resume_state(rlog, cfg) if cfg.resume_from else None
    rlog.begin(resumed_from=resume.round if resume else 0)
    try:
        codec = codecs.from_bytes(Path(cfg.public_context).read_bytes(), codecs.params_from_dict(cfg.he),
                                     bytes.fromhex(cfg.context_id))
        rlog.set_status(server_has_secret_key=codec.has_secret_key)
        if codec.has_secret_key:
            raise SecretKeyPresentError(f"{cfg.public_context} holds a HE secret key")
        roster = cfg.roster()
        limits = cfg.limits()
        grid = StreamingGrid(grid)  # replies are checked and added as they arrive
        t0 = time.perf_counter()
        stats_ct, declared = stats_round(grid, codec, cfg, rlog, roster)  # resumed too: binds nodes to partners
        rlog.set_status(stats_seconds=time.perf_counter() - t0)
        if resume is None:
            model = {P.MODEL_PLAIN: Array(np.asarray(cfg.initial_params, dtype=np.float64))}
        else:  # the campaign's own statistics and model: what an uninterrupted run would send now
            if resume.declared_n is not None and resume.declared_n != declared:
                log.warning("resumed campaign: the partners now declare %d rows, %d at the start; the campaign "
                            "keeps its statistics of %d", declared, resume.declared_n, resume.declared_n)
            stats_ct, declared = resume.stats_ct, resume.declared_n or declared
            rlog.set_status(stats_declared_n=declared)
            model = {P.MODEL_CT: Array(P.to_u8(resume.model_ct)),
                     P.MODEL_WEIGHT: Array(np.array([resume.model_weight], dtype=np.float64))}
        initial = ArrayRecord({
            **model,
            P.STATS_CT: Array(P.to_u8(stats_ct)),
            P.STATS_N: Array(np.array([declared], dtype=np.int64)),
        })
        # partners upload [model, server-optimizer state] (sealfl.he.server_opt)
        wire = ServerOpt.from_config(cfg.train).wire_length(cfg.n_params)
        dpc = DPConfig.from_config(cfg.train)
        ledger = None
        if dpc is not None:  # DP uploads carry the partner count after the model (sealfl.he.dp)
            wire += 1
            budget = cfg.train.get("dp-epsilon")
            ledger = Ledger(dpc.noise_multiplier, float(cfg.train["dp-delta"]),
                            None if budget is None else float(budget))
            for _ in range(resume.noised_rounds if resume else 0):  # the finished rounds' privacy cost
                ledger.record(dpc.sampling_rate)
        strategy = EncryptedFedAvg(codec, wire, roster=roster, limits=limits, min_partners=cfg.min_partners,
                                   round_log=rlog, wait_s=cfg.timeout_s, privacy=(ledger, dpc) if dpc else None,
                                   sum_shards=cfg.sum_shards, first_round=resume.round + 1 if resume else 1)
        if resume is not None:
            strategy.resume_with(resume.model_ct, resume.model_weight)
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=cfg.num_rounds - (resume.round if resume else 0),
                       timeout=cfg.timeout_s,
                       train_config=ConfigRecord(_scalar(cfg.train)), evaluate_config=ConfigRecord(_scalar(cfg.train)))
        rlog.set_status(status="finished", finished=time.time())
    except StaleRunError as exc:  # a newer run owns the directory: write nothing more
        log.error("campaign run stopped: %s", exc)
        raise
    except BaseException as exc:
        rlog.set_status(status="failed", error=f"{type(exc).__name__}: {exc}")
        log.error("campaign failed: %s", exc)
        raise


def make_server_app(cfg: ServerConfig | None = None) -> ServerApp:
    """Build the ServerApp. Without ``cfg`` it reads the campaign directory
    ``run_config["campaign-dir"]`` (its ``server_config.json``), which is how a SuperLink
    deployment passes it."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        conf = cfg or ServerConfig.load(Path(str(context.run_config["campaign-dir"])))
        run_server(grid, conf)

    return app


#: the module-level ServerApp (``serverapp = "sealfl.server.app:app"`` in pyproject.toml):
#: ``run_config["campaign-dir"]`` names a campaign directory prepared by ``sealfl campaign run``
app = make_server_app()
