"""``sealfl campaign resume``: continue a stopped campaign from its last finished round.

A campaign whose coordinator or ServerApp died (kill -9), that was interrupted
(Ctrl-C, SIGTERM) or that failed is continued by a NEW run: the directory is levelled
with its checkpoint (:meth:`~sealfl.server.bookkeeping.CampaignDir.reopen`),
``server_config.json`` gets ``resume_from = k`` (everything else as the campaign was
started: rounds, training settings, seeds), and the same ServerApp starts at round
k + 1 from the checkpoint's encrypted global model and statistics
(:func:`sealfl.server.app.resume_state`). Partners derive each round's randomness from
the seed and the round number, so with fixed seeds the final model is an uninterrupted
run's (packed BFV: bit for bit).

Refused (:func:`sealfl.server.campaign_files.resume_plan`, before anything is
written): a finished campaign, one whose owner still runs, a damaged checkpoint, a
campaign of another consortium. Flower 1.42 does not resume a run whose SuperLink
died; with ``superlink`` the resumed campaign is submitted as a new run, after the
campaign's previous run on that SuperLink is stopped (``flwr stop``) and seen finished
(:func:`sealfl.platform.deployed.stop_previous_run`: a coordinator killed with -9 leaves
its ServerApp running there). Whatever happens to that stop, the resume takes the next
run epoch (:meth:`~sealfl.server.bookkeeping.CampaignDir.reopen`): a previous run still
alive cannot write a round record, checkpoint or status any more.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from sealfl.common.errors import Interrupted, signal_name
from sealfl.common.procs import identity
from sealfl.platform.campaign import CampaignResult, CampaignSpec, simulate_prepared
from sealfl.platform.campaign_checks import check_public_context
from sealfl.platform.consortium import Consortium
from sealfl.platform.errors import CampaignError
from sealfl.platform.simulate import plan_ray
from sealfl.platform.supervisor import requested
from sealfl.server.app import ServerConfig
from sealfl.server.bookkeeping import CampaignDir
from sealfl.server.errors import CampaignDirError

log = logging.getLogger(__name__)

__all__ = ["resume_campaign"]


def resume_campaign(campaign_dir: str | Path, consortium_dir: str | Path, *, ray_address: str | None = None,
                    cpus_per_partner: float = 1.0, superlink: str | None = None, flower_log_level: str = "WARNING",
                    on_round: Callable[[dict], None] | None = None, client_app: str | None = None,
                    client_app_kwargs: dict | None = None, app_dir: str | None = None) -> CampaignResult:
    """Continue the campaign in ``campaign_dir`` to its end (see module docstring).

    Args:
        campaign_dir: the stopped campaign.
        consortium_dir: the consortium that ran it (its HE context id must be the campaign's).
        ray_address, cpus_per_partner, flower_log_level, client_app, client_app_kwargs,
            app_dir: as for :func:`~sealfl.platform.campaign.run_campaign` (simulation).
        superlink: ``HOST:PORT``: resume on a SuperLink instead of the simulation engine.
        on_round: called with each round's record once committed (the resumed rounds only).
    Raises:
        ConsortiumError: not a consortium.
        CampaignError: the campaign cannot be resumed (why), or the resumed run failed.
        SimulationError, DeploymentError, Interrupted: as :func:`run_campaign`.
    """
    cons = Consortium.load(consortium_dir)
    check_public_context(cons)
    cd = CampaignDir(campaign_dir)
    try:
        plan = cd.plan_resume(cons.context_id)
        config = ServerConfig.from_dict(cd.read_config(), str(cd.config_path))
    except CampaignDirError as exc:
        raise CampaignError(f"cannot resume {campaign_dir}: {exc}") from exc
    if not plan.ok:
        raise CampaignError(f"{campaign_dir}: {plan.message}")
    if config.num_rounds != plan.num_rounds:
        raise CampaignError(f"cannot resume {campaign_dir}: server_config.json asks for {config.num_rounds} rounds, "
                            f"status.json for {plan.num_rounds}; the directory was edited")
    ray = plan_ray(ray_address, cpus_per_partner) if not superlink else None
    if superlink:  # reachable and this consortium's, before anything of the campaign changes
        from sealfl.platform.deployed import check_superlink

        check_superlink(superlink, cons.dir)
    if requested():
        raise Interrupted(requested(), f"resume stopped by {signal_name(requested())} before it started; "
                                       f"{campaign_dir} is unchanged")
    if superlink:  # the stopped campaign's run may still be alive on the SuperLink: stop it first
        from sealfl.platform.deployed import stop_previous_run

        stop_previous_run(cd, superlink)
    rnd = cd.reopen(identity())  # the next run epoch: any run of the campaign still alive is fenced out
    if rnd >= config.num_rounds:  # the stopped run committed the last round before it was stopped
        from sealfl.platform.campaign import CampaignResult

        status = cd.mark_complete(f"all {rnd} rounds were committed by the run that was stopped; resume had "
                                  "nothing left to run")
        log.info("%s: all %d rounds were committed before the stop; marked finished", cd.dir, rnd)
        return CampaignResult(cd.dir, status, cd.rounds(), 0.0)
    config.resume_from = rnd
    config.epoch = int(cd.status["epoch"])
    config.campaign_dir = str(cd.dir.resolve())
    cd.write_config(config.to_dict())
    log.info("resuming %s after round %d of %d", cd.dir, rnd, config.num_rounds)
    spec = CampaignSpec(str(cons.dir), str(cd.dir), rounds=config.num_rounds, ray_address=ray_address,
                        cpus_per_partner=cpus_per_partner, flower_log_level=flower_log_level, superlink=superlink,
                        timeout_s=config.timeout_s)
    if superlink:
        from sealfl.platform.deployed import run_deployed_campaign

        return run_deployed_campaign(spec, on_round, prepared=(cons, cd))
    return simulate_prepared(spec, cons, cd, ray, on_round, client_app=client_app,
                             client_app_kwargs=client_app_kwargs, app_dir=app_dir)
