"""Campaigns: rounds of encrypted FedAvg run through Flower's simulation engine on Ray.

Ray: see :mod:`sealfl.platform.simulate` (embedded local Ray by default,
``ray_address`` / ``RAY_ADDRESS`` attaches to an existing cluster).

The aggregator writes everything to ``<out>/`` (see :mod:`sealfl.server.bookkeeping`);
:func:`run_campaign` watches ``rounds.jsonl`` to report progress and raises
:class:`CampaignError` with the aggregator's recorded error if the campaign failed.
"""

from __future__ import annotations

import json
import math
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from sealfl.clients.data import N_FEATURES
from sealfl.clients.task import HeartTask
from sealfl.server.app import ServerConfig, make_server_app
from sealfl.server.bookkeeping import RoundLog

from .consortium import Consortium
from .errors import CampaignError
from .partner_keys import partner_public_keys
from .simulate import run_on_ray

log = logging.getLogger(__name__)


@dataclass
class CampaignSpec:
    """A campaign to run.

    Attributes:
        consortium_dir: directory written by ``sealfl consortium create``.
        out_dir: campaign directory (must not hold a finished campaign).
        rounds: training rounds.
        local_epochs, lr, batch_size: local training settings sent to partners.
        min_partners: fewest valid updates per round (default: all but one, at least 2).
        ray_address: attach to this Ray cluster (``None``: ``RAY_ADDRESS`` or a local Ray).
        cpus_per_partner: Ray CPUs reserved per simulated SuperNode.
        overwrite: replace an earlier campaign in ``out_dir`` (else refuse).
        flower_log_level: level of Flower's console handler (its INFO is chatty).
        max_examples: cap on the row count any partner may declare (the aggregator
            refuses larger ones; see :class:`sealfl.server.validation.ReplyLimits`).
    """

    consortium_dir: str
    out_dir: str
    rounds: int = 10
    local_epochs: int = 5
    lr: float = 0.05
    batch_size: int = 16
    seed: int = 0
    min_partners: int | None = None
    ray_address: str | None = None
    cpus_per_partner: float = 1.0
    timeout_s: float = 600.0
    overwrite: bool = False
    flower_log_level: str = "WARNING"
    extra: dict = field(default_factory=dict)
    max_examples: int = 1_000_000


@dataclass
class CampaignResult:
    """What a finished campaign left in ``out_dir``: its status and per-round records, and
    which Ray ran it (``{"gcs_address", "started_here"}``; Flower's simulation engine
    disconnects from Ray when the run ends)."""

    out_dir: Path
    status: dict
    rounds: list[dict]
    seconds: float
    ray: dict = field(default_factory=dict)


def check_spec(spec: CampaignSpec, num_partners: int, min_partners: int) -> None:
    """Refuse settings that cannot work, before Ray starts. Raises CampaignError."""
    if not 1 <= min_partners <= num_partners:
        raise CampaignError(f"min_partners={min_partners} but the consortium has {num_partners} partners")
    if spec.rounds < 1 or spec.local_epochs < 1 or spec.batch_size < 1:
        raise CampaignError("rounds, local epochs and batch size must be at least 1")
    if not (math.isfinite(spec.lr) and spec.lr > 0):
        raise CampaignError(f"learning rate must be a positive finite number, got {spec.lr}")
    if isinstance(spec.max_examples, bool) or not isinstance(spec.max_examples, int) or spec.max_examples < 1:
        raise CampaignError(f"max_examples must be a positive integer, got {spec.max_examples!r}")


def preflight(spec: CampaignSpec) -> tuple[Consortium, int]:
    """Everything that can be checked before Ray starts. Returns (consortium, min_partners).

    Raises ConsortiumError or CampaignError with what is wrong.
    """
    cons = Consortium.load(spec.consortium_dir)
    n = len(cons.partners)
    min_partners = spec.min_partners if spec.min_partners is not None else max(2, n - 1)
    check_spec(spec, n, min_partners)
    out, cdir = Path(spec.out_dir).resolve(), cons.dir.resolve()
    if out == cdir or cdir in out.parents or out in cdir.parents:
        raise CampaignError(f"the campaign directory {spec.out_dir} overlaps the consortium directory; keep them apart")
    if out.exists() and not out.is_dir():
        raise CampaignError(f"{spec.out_dir} is a file; give a directory for the campaign")
    if (out / "status.json").exists() and not spec.overwrite:
        raise CampaignError(f"{spec.out_dir} already holds a campaign (a release may have been built from it); "
                            "choose a new --out or pass --overwrite")
    return cons, min_partners


def run_campaign(spec: CampaignSpec, on_round: Callable[[dict], None] | None = None, client_app=None) -> CampaignResult:
    """Run a campaign to the end.

    Args:
        spec: what to run.
        on_round: called with each round's record as it is written (progress display).
        client_app: a ClientApp to use instead of the partner app (tests inject faults).
    Raises:
        ConsortiumError: ``spec.consortium_dir`` is not a consortium.
        CampaignError: bad settings, ``out_dir`` holds an earlier campaign, or the
            aggregator recorded a failure (message says which and why).
    """
    from sealfl.clients.app import make_client_app

    cons, min_partners = preflight(spec)
    out = Path(spec.out_dir)
    task = HeartTask()
    n = len(cons.partners)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("rounds.jsonl", "status.json", "checkpoint/global.npz"):
        (out / stale).unlink(missing_ok=True)
    cfg = ServerConfig(
        campaign_dir=str(out), public_context=str(cons.public_context), context_id=cons.context_id,
        ckks=cons.ckks.to_dict(), num_partners=n, min_partners=min_partners, num_rounds=spec.rounds,
        n_params=task.n_params, stats_length=1 + 2 * N_FEATURES, initial_params=task.init_params().tolist(),
        train={"local-epochs": spec.local_epochs, "lr": spec.lr, "batch-size": spec.batch_size, "seed": spec.seed,
               **spec.extra},
        timeout_s=spec.timeout_s, partners=list(cons.partners), partner_keys=partner_public_keys(cons),
        max_examples=spec.max_examples,
    )
    cfg.save(out / "server_config.json")
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(out, on_round, stop), daemon=True) if on_round else None
    if watcher:
        watcher.start()
    t0 = time.perf_counter()
    try:
        ray_info, failure = run_on_ray(
            make_server_app(cfg), client_app or make_client_app(str(cons.dir.resolve())), n,
            ray_address=spec.ray_address, cpus_per_partner=spec.cpus_per_partner,
            flower_log_level=spec.flower_log_level, on_interrupt=lambda sig: _mark_interrupted(out, sig))
    finally:
        stop.set()
        if watcher:
            watcher.join(timeout=5)
    seconds = time.perf_counter() - t0
    status_path = out / "status.json"
    status = json.loads(status_path.read_text()) if status_path.exists() else {"status": "failed", "error": "the aggregator never started"}
    if status.get("status") != "finished":
        raise CampaignError(
            f"campaign in {out} did not finish: {status.get('error') or failure or status.get('status')}") from failure
    return CampaignResult(out, status, RoundLog(out, spec.rounds).rounds(), seconds, ray_info)


def _mark_interrupted(out: Path, signum: int) -> None:
    """Record in ``status.json`` that the campaign was stopped by a signal."""
    from sealfl.common.fsutil import atomic_write
    from sealfl.server.bookkeeping import FROZEN, STATUS_LOCK

    with STATUS_LOCK:
        FROZEN.set()  # the aggregator thread keeps running until exit: stop its status writes
        p = out / "status.json"
        try:
            status = json.loads(p.read_text())
        except (OSError, ValueError):
            status = {}
        status.update(status="interrupted", error=f"stopped by signal {signum} after round "
                      f"{status.get('round', 0)}; the checkpoint of that round is intact")
        atomic_write(p, json.dumps(status, indent=2).encode(), 0o644)
    log.warning("campaign interrupted by signal %d", signum)


def _watch(out: Path, on_round: Callable[[dict], None], stop: threading.Event) -> None:
    seen = 0
    path = out / "rounds.jsonl"
    while True:
        done = stop.is_set()
        if path.exists():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            for ln in lines[seen:]:
                try:
                    on_round(json.loads(ln))
                except Exception:  # a progress display must never kill the campaign
                    log.exception("progress callback failed")
            seen = len(lines)
        if done:
            return
        stop.wait(0.3)
