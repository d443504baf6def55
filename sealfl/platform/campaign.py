"""Campaigns: rounds of encrypted FedAvg run through Flower's simulation engine on Ray.

:func:`run_campaign` prepares the campaign directory (:class:`~sealfl.server.bookkeeping.CampaignDir`),
runs the aggregator and the partners in a worker process tree
(:mod:`sealfl.platform.supervisor`; Ray: :mod:`sealfl.platform.simulate`), reports
progress from ``rounds.jsonl`` and, once that tree is gone, reads the outcome. Stopped
by a signal, it brings the directory level with the last committed round, records
``interrupted`` and raises :class:`~sealfl.common.errors.Interrupted`; the process
tree is gone by then, so nothing else writes the directory.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from sealfl.clients.plugins import get_task
from sealfl.common.errors import Interrupted, SealflError, signal_name
from sealfl.common.procs import identity
from sealfl.he.server_opt import ServerOpt
from sealfl.platform.campaign_checks import preflight
from sealfl.platform.consortium import Consortium
from sealfl.platform.errors import CampaignError
from sealfl.platform.partner_keys import partner_public_keys
from sealfl.platform.simulate import plan_ray, ray_environment
from sealfl.platform.supervisor import requested, run_worker
from sealfl.server.app import ServerConfig
from sealfl.server.bookkeeping import CampaignDir
from sealfl.server.errors import CampaignDirError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DPSpec:
    """A campaign's record-level differential privacy (issue 23; :mod:`sealfl.he.dp`).

    Attributes:
        delta: δ (0 < δ < 1).
        epsilon: ε budget: the campaign stops before the round that would exceed it; with no
            ``noise_multiplier`` the noise is calibrated so that all rounds fit it.
        noise_multiplier: z, aggregate noise std over one record's L2 sensitivity.
        clip: per-example L2 clip norm C.
        trust: t, partners that may skip their noise share or collude (0 <= t < k, k =
            the campaign's min partners).
        sampling_rate: q, each record's Poisson inclusion probability per round.
    """

    delta: float = 1e-5
    epsilon: float | None = None
    noise_multiplier: float | None = None
    clip: float = 1.0
    trust: int = 0
    sampling_rate: float = 0.1


@dataclass
class CampaignSpec:
    """A campaign to run.

    Attributes:
        consortium_dir: directory written by ``sealfl consortium create``.
        out_dir: campaign directory (must not hold a campaign unless ``overwrite``).
        rounds: training rounds.
        local_epochs, lr, batch_size: local training settings sent to partners (``None``:
            the task's default; ``local_epochs`` means local steps for the causal-LM task).
        min_partners: fewest valid updates per round (default: all but one, at least 2).
        ray_address: attach to this Ray cluster (``None``: ``RAY_ADDRESS`` or a local Ray).
        cpus_per_partner: Ray CPUs reserved per simulated SuperNode.
        overwrite: replace an earlier, not running campaign in ``out_dir`` (else refuse).
        flower_log_level: level of Flower's console handler (its INFO is chatty).
        max_examples: cap on the row count any partner may declare (the aggregator
            refuses larger ones; see :class:`sealfl.server.validation.ReplyLimits`).
        server_opt: the server optimizer the key holders run on each decrypted aggregate
            (:class:`sealfl.he.server_opt.ServerOpt`; default FedAvg).
        proximal_mu: FedProx's proximal term weight μ for local training (Li et al., MLSys
            2020; ``None``: the task's default, 0); only for tasks whose training settings
            include ``proximal-mu``.
        dp: record-level DP (:class:`DPSpec`; None: off).
        superlink: ``HOST:PORT`` of a SuperLink (``sealfl superlink start``): the campaign
            is submitted there (:mod:`sealfl.platform.deployed`) instead of simulated on Ray.
    """

    consortium_dir: str
    out_dir: str
    rounds: int = 10
    local_epochs: int | None = None
    lr: float | None = None
    batch_size: int | None = None
    seed: int = 0
    min_partners: int | None = None
    ray_address: str | None = None
    cpus_per_partner: float = 1.0
    timeout_s: float = 600.0
    overwrite: bool = False
    flower_log_level: str = "WARNING"
    extra: dict = field(default_factory=dict)
    max_examples: int = 1_000_000
    server_opt: ServerOpt = field(default_factory=ServerOpt)
    proximal_mu: float | None = None
    dp: DPSpec | None = None
    #: the ``dp-*`` round-config entries :func:`plan_dp` fixed (set by :func:`preflight`)
    dp_round_config: dict = field(default_factory=dict)
    superlink: str | None = None


@dataclass
class CampaignResult:
    """What a finished campaign left in ``out_dir``: its status and per-round records,
    which Ray ran it (``{"gcs_address", "started_here", "mode", "auth", "loopback_only"}``)
    and the peak RSS (bytes) of the worker process that ran the aggregator (None if unknown):
    ``coordinator_peak_rss_bytes`` over its life (imports and Ray's start-up included),
    ``coordinator_run_rss`` over the Flower run only (``{"start_bytes", "peak_bytes",
    "method"}``: RSS as the run starts and its peak after, :mod:`sealfl.platform.worker`)."""

    out_dir: Path
    status: dict
    rounds: list[dict]
    seconds: float
    ray: dict = field(default_factory=dict)
    coordinator_peak_rss_bytes: int | None = None
    coordinator_run_rss: dict = field(default_factory=dict)


def train_config(task, spec: CampaignSpec) -> dict:
    """What partners receive each round: the task's defaults, then the spec's settings."""
    train = {**task.train_defaults(), "seed": spec.seed}
    steps_key = "local-epochs" if "local-epochs" in train else "local-steps"
    for key, value in ((steps_key, spec.local_epochs), ("lr", spec.lr), ("batch-size", spec.batch_size),
                       ("proximal-mu", spec.proximal_mu)):
        if value is not None:
            train[key] = value
    return {**train, **spec.server_opt.to_config(), **spec.extra, **spec.dp_round_config}


def prepare_campaign(spec: CampaignSpec) -> tuple[Consortium, CampaignDir]:
    """Check ``spec`` (:func:`preflight`) and write the campaign directory the aggregator
    reads (``server_config.json``, a fresh status). Both runtimes start from it.

    Raises ConsortiumError, CampaignError (bad settings, a campaign already there) or
    Interrupted (a signal came before anything was written).
    """
    cons, min_partners = preflight(spec)
    if requested():
        raise Interrupted(requested(), f"campaign stopped by {signal_name(requested())} before it started; "
                                       f"nothing was written to {spec.out_dir}")
    cd = CampaignDir(spec.out_dir)
    try:
        cd.prepare(spec.rounds, overwrite=spec.overwrite, owner=identity())
    except CampaignDirError as exc:
        raise CampaignError(str(exc)) from exc
    task = get_task(cons.task)
    n = len(cons.partners)
    config = ServerConfig(
        campaign_dir=str(cd.dir.resolve()), public_context=str(cons.public_context.resolve()),
        context_id=cons.context_id, he=cons.he_params.to_dict(), num_partners=n, min_partners=min_partners,
        num_rounds=spec.rounds, n_params=task.n_params, stats_length=task.stats_length,
        initial_params=task.init_params().tolist(), train=train_config(task, spec),
        timeout_s=spec.timeout_s, partners=list(cons.partners), partner_keys=partner_public_keys(cons),
        max_examples=spec.max_examples, epoch=int(cd.status["epoch"]),
    )
    cd.write_config(config.to_dict())
    return cons, cd


def run_campaign(spec: CampaignSpec, on_round: Callable[[dict], None] | None = None, *,
                 client_app: str | None = None, client_app_kwargs: dict | None = None,
                 app_dir: str | None = None, superlink_checked: bool = False) -> CampaignResult:
    """Run a campaign to the end.

    Args:
        spec: what to run.
        on_round: called with each round's record once it is committed (progress display).
        client_app: ``"module:factory"`` building the ClientApp as
            ``factory(consortium_dir, **client_app_kwargs)`` in the worker (default: the
            partner app, ``sealfl.clients.app:make_client_app``; tests inject faults).
        app_dir: directory put first on ``sys.path`` / ``PYTHONPATH`` so that module imports
            in the worker and in Ray's workers.
        superlink_checked: the caller has just checked ``spec.superlink``
            (:func:`~sealfl.platform.deployed.check_superlink`): not asked again.
    Raises:
        ConsortiumError: ``spec.consortium_dir`` is not a consortium.
        CampaignError: bad settings, ``out_dir`` holds an earlier or running campaign, or
            the campaign failed (message: the aggregator's recorded error or how the worker died).
        SimulationError: the Ray cluster given cannot be reached.
        Interrupted: SIGINT/SIGTERM (inside :func:`~sealfl.platform.supervisor.interruptible`);
            ``status.json`` says ``interrupted`` with the last finished round.
    """
    if spec.superlink:
        from sealfl.platform.deployed import run_deployed_campaign

        return run_deployed_campaign(spec, on_round, checked=superlink_checked)
    preflight(spec)  # settings before Ray's address (as before); prepare_campaign checks again
    plan = plan_ray(spec.ray_address, spec.cpus_per_partner)
    cons, cd = prepare_campaign(spec)
    return simulate_prepared(spec, cons, cd, plan, on_round, client_app=client_app,
                             client_app_kwargs=client_app_kwargs, app_dir=app_dir)


def simulate_prepared(spec: CampaignSpec, cons: Consortium, cd: CampaignDir, plan: dict,
                      on_round: Callable[[dict], None] | None = None, *, client_app: str | None = None,
                      client_app_kwargs: dict | None = None, app_dir: str | None = None) -> CampaignResult:
    """Run the campaign ``cd`` (prepared: ``server_config.json`` and a ``starting`` status,
    by :func:`prepare_campaign` or a resume) in a worker process tree on Ray ``plan``
    (:func:`~sealfl.platform.simulate.plan_ray`) to the end. Arguments and errors as
    :func:`run_campaign`."""
    n = len(cons.partners)
    job = {"kind": "campaign", "campaign_dir": str(cd.dir.resolve()), "consortium_dir": str(cons.dir.resolve()),
           "num_supernodes": n, "client_app": client_app, "client_app_kwargs": client_app_kwargs or {},
           "app_dir": app_dir, "ray": plan, "flower_log_level": spec.flower_log_level}
    seen = [0]
    ray_told = [False]

    def tick() -> None:
        if not ray_told[0]:
            ray_told[0] = _tell_ray_protection(cd)
        if on_round is None:
            return
        rounds = cd.rounds()
        for rec in rounds[seen[0]:]:
            on_round(rec)
        seen[0] = max(seen[0], len(rounds))

    t0 = time.perf_counter()
    try:
        result = run_worker(job, env=ray_environment(plan, dict(os.environ)), log_path=cd.log_path,
                            app_dir=app_dir, on_tick=tick)
    except Interrupted as exc:
        raise _interrupted(cd, exc.signum) from None
    except KeyboardInterrupt:  # library use outside interruptible(): the tree is gone already
        _interrupted(cd, signal.SIGINT)
        raise
    except SealflError as exc:
        cd.recover()
        cd.mark_failed(str(exc))
        raise CampaignError(f"campaign in {cd.dir} failed: {exc}") from exc
    seconds = time.perf_counter() - t0
    cd.recover()
    status = cd.read_status()
    if status.get("status") != "finished":
        status = cd.mark_failed(result.get("error") or "the aggregator stopped without finishing")
        raise CampaignError(f"campaign in {cd.dir} did not finish: {status.get('error')} (log: {cd.log_path})")
    if requested():  # the signal came as the last round ended: say so, lose nothing
        raise Interrupted(requested(), f"campaign {cd.dir} had finished all {status.get('num_rounds')} rounds when "
                                       f"{signal_name(requested())} arrived; it is complete")
    return CampaignResult(cd.dir, status, cd.rounds(), seconds, result.get("ray", {}), result.get("peak_rss_bytes"),
                          result.get("run_rss") or {})


def _tell_ray_protection(cd: CampaignDir) -> bool:
    """Once the worker recorded which Ray it runs on, say how that Ray is protected
    (a warning if it accepts unauthenticated drivers). Returns True once told."""
    try:
        ray = cd.read_status().get("ray")
    except CampaignDirError:
        return False
    if not isinstance(ray, dict):
        return False
    if ray.get("auth") == "token":
        log.info("Ray at %s: token authentication%s", ray.get("gcs_address"),
                 ", loopback only" if ray.get("loopback_only") else "")
    else:
        log.warning("the Ray cluster at %s runs this campaign with authentication %r: anyone who can reach it can "
                    "run code there, next to the partners' kits; start it with RAY_AUTH_MODE=token",
                    ray.get("gcs_address"), ray.get("auth"))
    return True


def _interrupted(cd: CampaignDir, signum: int) -> Interrupted:
    """Level the directory with its last committed round and record the interruption."""
    rnd = int(cd.mark_interrupted(signum).get("round", 0))
    name = signal_name(signum)
    where = (f"after round {rnd}; the checkpoint of round {rnd} in {cd.checkpoint_path} is intact" if rnd
             else "before the first round finished")
    return Interrupted(signum, f"campaign {cd.dir} stopped by {name} {where} "
                               f"('sealfl campaign status {cd.dir}' shows it)")
