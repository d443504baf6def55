"""The aggregator's Flower ServerApp.

``main(grid, context)``:

1. load the campaign's PUBLIC CKKS context and measure that it holds no secret key
   (written to ``status.json`` as ``server_has_secret_key``; a secret context aborts);
2. statistics round: query every partner for E([n, Σx, Σx²]) and add them;
3. ``EncryptedFedAvg.start(...)`` for ``num_rounds`` rounds from the public initial model;
4. record ``finished`` (or ``failed`` with the error) in ``status.json``.

Everything the coordinator needs afterwards is in the campaign directory
(:mod:`sealfl.server.bookkeeping`), so the same app runs under the simulation engine and
under a SuperLink.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from sealfl.common import protocol as P
from sealfl.common.he import CKKSCodec, CKKSParams

from .aggregate import sum_chunks, validate_frames
from .bookkeeping import CampaignDir
from .errors import NotEnoughPartnersError, SecretKeyPresentError
from .strategy import EncryptedFedAvg, partner_name

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """What the aggregator needs for one campaign (all plain data, JSON-serialisable).

    Attributes:
        campaign_dir: where status, round log and checkpoints go.
        public_context: path of the public CKKS context file.
        context_id: hex id of the campaign's CKKS context.
        ckks: CKKSParams as a dict.
        num_partners: partners expected to connect.
        min_partners: fewest valid updates per round.
        num_rounds: training rounds.
        n_params: flat model length.
        stats_length: length of the scaling-statistics vector ``[n, Σx, Σx²]``.
        initial_params: the public initial model (list of floats).
        train: extra train config sent to partners (local-epochs, lr, batch-size, ...).
        timeout_s: seconds to wait for replies per round.
    """

    campaign_dir: str
    public_context: str
    context_id: str
    ckks: dict
    num_partners: int
    min_partners: int
    num_rounds: int
    n_params: int
    stats_length: int
    initial_params: list = field(default_factory=list)
    train: dict = field(default_factory=dict)
    timeout_s: float = 600.0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> "ServerConfig":
        return cls(**json.loads(Path(path).read_text()))


def wait_for_nodes(grid: Grid, n: int, timeout_s: float) -> list[int]:
    """Block until ``n`` nodes are connected; returns their ids. Raises NotEnoughPartnersError on timeout."""
    t0 = time.monotonic()
    while len(ids := list(grid.get_node_ids())) < n:
        if time.monotonic() - t0 > timeout_s:
            raise NotEnoughPartnersError(f"only {len(ids)} of {n} partners connected within {timeout_s:.0f} s")
        time.sleep(0.2)
    return ids


def stats_round(grid: Grid, codec: CKKSCodec, cfg: ServerConfig, rlog: CampaignDir) -> bytes:
    """Query E([n, Σx, Σx²]) from every partner and add them; returns the aggregate frame."""
    ids = wait_for_nodes(grid, cfg.num_partners, cfg.timeout_s)
    content = RecordDict({P.CONFIG: ConfigRecord({"query": P.QUERY_STATS, **_scalar(cfg.train)})})
    msgs = [Message(content=content, dst_node_id=nid, message_type=MessageType.QUERY) for nid in ids]
    replies = list(grid.send_and_receive(msgs, timeout=cfg.timeout_s))
    frames: dict[str, bytes] = {}
    for msg in replies:
        name = partner_name(msg)
        if msg.has_error():
            log.warning("partner %s failed the statistics query: %s", name, msg.error.reason)
            continue
        try:
            frames[name] = P.from_u8(msg.content[P.STATS]["stats_ct"].numpy())
        except (KeyError, ValueError) as exc:
            log.warning("rejected the statistics of partner %s: %s", name, exc)
    length = cfg.stats_length
    valid = validate_frames(codec, frames, length)
    if len(valid.chunks) < cfg.min_partners:
        raise NotEnoughPartnersError(
            f"statistics round: {len(valid.chunks)} valid replies, min_partners={cfg.min_partners}")
    rlog.note(stats_partners=sorted(valid.chunks), stats_rejected=valid.rejected)
    return sum_chunks(codec, valid, length)


def _scalar(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool))}


def run_server(grid: Grid, cfg: ServerConfig) -> None:
    """The ServerApp body (see module docstring). Raises what the campaign failed on,
    after recording it in ``status.json``."""
    rlog = CampaignDir(cfg.campaign_dir, cfg.num_rounds)
    rlog.begin()
    try:
        codec = CKKSCodec.from_bytes(Path(cfg.public_context).read_bytes(), CKKSParams.from_dict(cfg.ckks),
                                     bytes.fromhex(cfg.context_id))
        rlog.set_status(server_has_secret_key=codec.has_secret_key)
        if codec.has_secret_key:
            raise SecretKeyPresentError(f"{cfg.public_context} holds a CKKS secret key")
        t0 = time.perf_counter()
        stats_ct = stats_round(grid, codec, cfg, rlog)
        rlog.set_status(stats_seconds=time.perf_counter() - t0)
        initial = ArrayRecord({
            "model_plain": Array(np.asarray(cfg.initial_params, dtype=np.float64)),
            "stats_ct": Array(P.to_u8(stats_ct)),
        })
        strategy = EncryptedFedAvg(codec, cfg.n_params, min_partners=cfg.min_partners,
                                   num_partners=cfg.num_partners, round_log=rlog)
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=cfg.num_rounds, timeout=cfg.timeout_s,
                       train_config=ConfigRecord(_scalar(cfg.train)), evaluate_config=ConfigRecord(_scalar(cfg.train)))
        rlog.set_status(status="finished", finished=time.time())
    except BaseException as exc:
        rlog.set_status(status="failed", error=f"{type(exc).__name__}: {exc}")
        log.error("campaign failed: %s", exc)
        raise


def make_server_app(cfg: ServerConfig | None = None) -> ServerApp:
    """Build the ServerApp. Without ``cfg`` it reads ``run_config["server-config"]`` (a
    path to a saved :class:`ServerConfig`), which is how a SuperLink deployment passes it."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        conf = cfg or ServerConfig.load(Path(str(context.run_config["server-config"])))
        run_server(grid, conf)

    return app
