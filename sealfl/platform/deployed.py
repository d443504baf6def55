"""A campaign submitted to a SuperLink (``sealfl campaign run --superlink HOST:PORT``).

The same campaign directory as a simulated campaign (:func:`sealfl.platform.campaign.prepare_campaign`
writes it; the ServerApp on the SuperLink writes status.json, rounds.jsonl and checkpoints),
submitted as ``flwr run`` does (Flower's Control API over TLS, checked against the
aggregator kit's ``ca.crt``) with ``--run-config campaign-dir=...``. The coordinator then
looks at the run (Flower's Control API from this process, :mod:`.control_api`; ``flwr ls
--run-id`` if that client cannot be made) and the round log until the run ends.

The ServerApp runs in a ``flwr-serverapp`` process started by the SuperLink's SuperExec
on the SuperLink's host: the campaign directory must be a path that host can write (the
coordinator runs the SuperLink; on one machine this is automatic).

Stopped by SIGINT/SIGTERM: the run is stopped on the SuperLink (``flwr stop``), the
directory is levelled with its last committed round and marked ``interrupted`` (exit
130/143 from the CLI), as in simulation.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from sealfl.common.errors import Interrupted, signal_name
from sealfl.platform import flwr_cli
from sealfl.platform.errors import CampaignError, DeploymentError
from sealfl.platform.startup_kits import CA_FILE

log = logging.getLogger(__name__)

__all__ = ["run_deployed_campaign", "stop_previous_run", "check_superlink", "RUN_DIR"]

#: inside the campaign directory: the app directory and FLWR_HOME of the submission
RUN_DIR = "flwr"
#: seconds between run-status looks (one Control API request each, :mod:`.control_api`)
POLL_S = 3.0
#: seconds one look may take before it counts as unanswered (a stopped or overloaded SuperLink
#: would otherwise hold the coordinator for Flower's 30-s request timeout, Ctrl-C included)
LOOK_TIMEOUT_S = 10.0
#: seconds without an answer from the SuperLink after which ``campaign run`` stops following
#: the run and marks the campaign failed (resumable): a SuperLink killed and started again
#: fails its runs anyway (Flower 1.42), so waiting longer only delays the resume
UNANSWERED_S = 120.0
#: seconds between the warnings while the SuperLink does not answer
UNANSWERED_WARN_S = 30.0
#: seconds Ctrl-C / SIGTERM spends stopping the run on the SuperLink (``flwr stop`` and waiting
#: for it) before the directory is levelled anyway: the stopped run is fenced out by the epoch
STOP_ON_SIGNAL_S = 10.0


def run_state(doc: dict, run_id: int) -> tuple[str, str]:
    """(status, details) of run ``run_id`` in a ``flwr ls --run-id --format json`` answer,
    e.g. ``("finished:completed", "N/A")``. Raises DeploymentError if the run is not listed."""
    for r in doc.get("runs") or []:
        if isinstance(r, dict) and str(r.get("run-id")) == str(run_id):
            return str(r.get("status", "")), str(r.get("status-details", ""))
    raise DeploymentError(f"the SuperLink does not list run {run_id}")


class _RunLook:
    """(status, details) of a run, asked of the SuperLink in this process
    (:class:`~sealfl.platform.control_api.RunWatcher`); if Flower's client cannot be made
    here, each look is one ``flwr ls --run-id`` process instead (a warning says so)."""

    def __init__(self, home: Path) -> None:
        from sealfl.platform.control_api import RunWatcher

        self.home = home
        try:
            self.watcher: RunWatcher | None = RunWatcher(home, flwr_cli.CONNECTION)
        except DeploymentError as exc:
            log.warning("%s; asking with 'flwr ls' instead (one process per look)", exc)
            self.watcher = None

    def __call__(self, run_id: int, timeout_s: float = LOOK_TIMEOUT_S,
                 abandon: Callable[[], object] | None = None) -> tuple[str, str]:
        """Asked in a helper thread, waited for at most ``timeout_s`` and only while
        ``abandon()`` is false (a signal arrived: the answer is not waited for).

        Raises DeploymentError (the SuperLink cannot be asked, did not answer in time or
        does not list the run; or ``abandon()`` turned true)."""
        box: dict = {}

        def ask() -> None:
            try:
                box["answer"] = self._ask(run_id)
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc

        t = threading.Thread(target=ask, name="sealfl-run-look", daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        while t.is_alive() and time.monotonic() < deadline and not (abandon is not None and abandon()):
            t.join(0.1)
        if "answer" in box:
            return box["answer"]
        if "error" in box:
            exc = box["error"]
            raise exc if isinstance(exc, DeploymentError) else DeploymentError(str(exc))
        if t.is_alive() and abandon is not None and abandon():
            raise DeploymentError(f"the look at run {run_id} was abandoned (a signal arrived)")
        raise DeploymentError(f"the SuperLink did not answer within {timeout_s:g} s")

    def _ask(self, run_id: int) -> tuple[str, str]:
        if self.watcher is not None:
            return self.watcher.run_status(run_id)
        return run_state(flwr_cli.flwr_json(["ls", flwr_cli.CONNECTION, "--run-id", str(run_id)], self.home,
                                            timeout_s=LOOK_TIMEOUT_S), run_id)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()


def check_superlink(address: str, consortium_dir: Path) -> None:
    """Ask the SuperLink at ``address`` for its runs (``flwr ls``, TLS checked against the
    aggregator kit's ``ca.crt``) before a campaign directory is written or changed, as an
    unreachable Ray cluster is refused before a simulated campaign starts.

    Raises:
        CampaignError: the aggregator kit has no ``ca.crt``.
        DeploymentError: nothing answers there, or it is not this consortium's SuperLink.
    """
    import tempfile

    from sealfl.platform.services import parse_hostport

    parse_hostport(address)
    ca = Path(consortium_dir) / "aggregator" / CA_FILE
    if not ca.is_file():
        raise CampaignError(f"the aggregator kit has no {CA_FILE} ({ca}); create the consortium with this sealfl "
                            "version ('sealfl consortium create')")
    with tempfile.TemporaryDirectory(prefix="sealfl-superlink-check-") as tmp:
        home = flwr_cli.write_flwr_home(Path(tmp) / "home", address, ca)
        try:
            flwr_cli.flwr_json(["ls", flwr_cli.CONNECTION], home)
        except DeploymentError as exc:
            raise DeploymentError(f"cannot use the SuperLink at {address}: {exc}; check --superlink and that "
                                  "'sealfl superlink start' of this consortium runs there (nothing was "
                                  "written)") from exc


def run_deployed_campaign(spec, on_round: Callable[[dict], None] | None = None, prepared=None,
                          checked: bool = False):
    """Run ``spec`` (a :class:`~sealfl.platform.campaign.CampaignSpec` with ``superlink``)
    on the SuperLink to the end. Returns a :class:`~sealfl.platform.campaign.CampaignResult`.
    ``prepared``: (consortium, campaign dir) already prepared (a resume); else
    :func:`~sealfl.platform.campaign.prepare_campaign` prepares them from ``spec``.
    ``checked``: :func:`check_superlink` has just passed for ``spec`` (not asked again).

    Raises ConsortiumError/CampaignError (as :func:`~sealfl.platform.campaign.run_campaign`),
    DeploymentError (the SuperLink cannot be reached or refused the run), Interrupted.
    """
    from sealfl.platform.campaign import CampaignResult, prepare_campaign
    from sealfl.platform.services import parse_hostport
    from sealfl.platform.supervisor import requested

    parse_hostport(spec.superlink)
    if prepared is None:  # settings, then the SuperLink, before the campaign directory is written
        from sealfl.platform.campaign_checks import preflight

        preflight(spec)
        if not checked:
            check_superlink(spec.superlink, Path(spec.consortium_dir))
    cons, cd = prepared if prepared is not None else prepare_campaign(spec)
    ca = cons.dir / "aggregator" / CA_FILE
    if not ca.is_file():
        raise CampaignError(f"the aggregator kit has no {CA_FILE} ({ca}); create the consortium with this sealfl "
                            "version ('sealfl consortium create')")
    run_dir = cd.dir / RUN_DIR
    app = flwr_cli.write_app(run_dir / "app")
    home = flwr_cli.write_flwr_home(run_dir / "home", spec.superlink, ca)
    run_config = {"campaign-dir": str(cd.dir.resolve()), "consortium-dir": ""}
    t0 = time.perf_counter()
    try:
        doc = flwr_cli.flwr_json(["run", str(app), flwr_cli.CONNECTION, "--run-config",
                                  flwr_cli.toml_config(run_config)], home)
    except DeploymentError as exc:
        cd.mark_failed(str(exc))
        raise DeploymentError(f"the SuperLink at {spec.superlink} refused the campaign: {exc}") from exc
    run_id = int(doc["run-id"])
    cd.amend_status(deployment={"superlink": spec.superlink, "run_id": run_id, "tls": True, "node_auth": True})
    log.info("campaign submitted to %s as run %d", spec.superlink, run_id)
    look = _RunLook(home)
    try:
        state, details = _follow(cd, run_id, home, look, on_round, requested)
    except _Unanswered as exc:
        rnd = int(cd.mark_abandoned(f"{exc}; the coordinator stopped following run {run_id}").get("round", 0))
        where = f"after round {rnd} (its checkpoint is intact)" if rnd else "before the first round finished"
        raise DeploymentError(f"the SuperLink at {spec.superlink} has not answered for {exc.seconds:.0f} s "
                              f"({exc.last}); campaign {cd.dir} stopped {where} and is marked failed. Once the "
                              f"SuperLink runs again: 'sealfl campaign resume {cd.dir} -c {cons.dir} --superlink "
                              f"{spec.superlink}'") from None
    finally:
        look.close()
    seconds = time.perf_counter() - t0
    cd.recover()
    status = cd.read_status()
    if status.get("status") != "finished":
        why = status.get("error") or (f"the run ended {state} ({details}); 'flwr log {run_id}' on the SuperLink "
                                      "host shows the ServerApp's output")
        status = cd.mark_failed(why)
        raise CampaignError(f"campaign in {cd.dir} did not finish: {status.get('error')}")
    if requested():
        raise Interrupted(requested(), f"campaign {cd.dir} had finished all {status.get('num_rounds')} rounds when "
                                       f"{signal_name(requested())} arrived; it is complete")
    return CampaignResult(cd.dir, status, cd.rounds(), seconds, {}, None)


class _Unanswered(DeploymentError):
    """The SuperLink has not answered the run looks for ``seconds`` (last error ``last``)."""

    def __init__(self, seconds: float, last: str) -> None:
        super().__init__(f"the SuperLink has not answered for {seconds:.0f} s ({last})")
        self.seconds, self.last = seconds, last


def _follow(cd, run_id: int, home: Path, look, on_round, requested) -> tuple[str, str]:
    """Show each new round of ``cd`` and look at run ``run_id`` every :data:`POLL_S` seconds
    until the SuperLink lists it finished; returns its last (status, details). Stops the run
    and raises Interrupted when a signal was requested."""
    from sealfl.platform.campaign import _interrupted

    seen = 0
    last_poll = 0.0
    state = "pending"
    details = ""
    unanswered_since = None  # monotonic time of the first look of an outage without an answer
    warned = 0.0
    while True:
        sig = requested()
        if sig:
            _stop(run_id, home, look, wait_s=STOP_ON_SIGNAL_S)  # not seen stopped: fenced out by the epoch
            raise _interrupted(cd, sig) from None
        rounds = cd.rounds()
        if on_round is not None:
            for rec in rounds[seen:]:
                try:
                    on_round(rec)
                except Exception:  # a progress display never stops the campaign
                    log.exception("progress callback failed")
        seen = max(seen, len(rounds))
        if time.monotonic() - last_poll >= POLL_S:
            last_poll = time.monotonic()
            try:
                state, details = look(run_id, abandon=requested)
            except DeploymentError as exc:
                now = time.monotonic()
                if requested():
                    continue  # acted on at the top of the loop
                if unanswered_since is None:
                    unanswered_since = warned = now
                    log.warning("%s; waiting up to %.0f s for the SuperLink to answer", exc, UNANSWERED_S)
                elif now - unanswered_since >= UNANSWERED_S:
                    raise _Unanswered(now - unanswered_since, str(exc)) from exc
                elif now - warned >= UNANSWERED_WARN_S:
                    warned = now
                    log.warning("the SuperLink has not answered for %.0f s (%s)", now - unanswered_since, exc)
            else:
                if unanswered_since is not None:
                    log.warning("the SuperLink answers again after %.0f s", time.monotonic() - unanswered_since)
                unanswered_since = None
            if state.startswith("finished"):
                break
        time.sleep(0.25)
    if on_round is not None:
        for rec in cd.rounds()[seen:]:
            on_round(rec)
    return state, details


def _stop(run_id: int, home: Path, look=None, wait_s: float = 30.0) -> bool:
    """Stop the run on the SuperLink and wait (at most ``wait_s`` in all, the ``flwr stop``
    included) until it is finished, so no ServerApp writes the campaign directory while it
    is levelled. Returns True once the SuperLink lists the run as finished (also a run that
    had finished before)."""
    deadline = time.monotonic() + wait_s
    try:
        flwr_cli.flwr_json(["stop", str(run_id), flwr_cli.CONNECTION], home, timeout_s=min(30.0, wait_s))
    except DeploymentError as exc:  # e.g. the run had finished already: its state below says
        log.info("flwr stop %d: %s", run_id, exc)
    own = look is None
    look = look or _RunLook(home)
    try:
        return _wait_finished(run_id, look, deadline, wait_s)
    finally:
        if own:
            look.close()


def _wait_finished(run_id: int, look, deadline: float, wait_s: float) -> bool:
    while True:
        try:
            state, _ = look(run_id, timeout_s=round(max(0.5, min(LOOK_TIMEOUT_S, deadline - time.monotonic())), 1))
        except DeploymentError as exc:
            log.warning("run %d not seen stopped: %s", run_id, exc)
            return False
        if state.startswith("finished"):
            return True
        if time.monotonic() >= deadline:
            log.warning("run %d was still %s %.0f s after the stop request", run_id, state, wait_s)
            return False
        time.sleep(0.5)


def stop_previous_run(cd, superlink: str, wait_s: float = 120.0) -> bool | None:
    """Before ``campaign resume --superlink``: stop the campaign's previous run (``status.json``'s
    ``deployment.run_id``) on ``superlink`` and wait until the SuperLink lists it finished.

    Returns True (stopped or finished already), False (it could not be confirmed: the resume
    goes on, fenced by the next run epoch, and a warning says so), None (no run recorded on
    this SuperLink, or no connection written for it). Uses the connection the previous
    submission wrote (``flwr/home`` in the campaign directory). Raises CampaignDirError
    (status.json unreadable).
    """
    dep = cd.read_status().get("deployment")
    if not isinstance(dep, dict) or not isinstance(dep.get("run_id"), int):
        return None
    if dep.get("superlink") != superlink:
        log.warning("the campaign's previous run %s was on %s, not %s: not stopped from here (it is fenced out)",
                    dep.get("run_id"), dep.get("superlink"), superlink)
        return None
    home = cd.dir / RUN_DIR / "home"
    if not (home / "config.toml").is_file():
        log.warning("no Flower connection in %s: run %d not stopped (it is fenced out)", home, dep["run_id"])
        return None
    ok = _stop(int(dep["run_id"]), home, wait_s=wait_s)
    if ok:
        log.info("the campaign's previous run %d on %s is finished", dep["run_id"], superlink)
    else:
        log.warning("the campaign's previous run %d on %s could not be seen stopped; resuming anyway (its writes are "
                    "refused from now on)", dep["run_id"], superlink)
    return ok
