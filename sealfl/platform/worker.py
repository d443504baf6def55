"""``python -m sealfl.platform.worker JOB.json``: the process that runs Ray and Flower.

Started only by :func:`sealfl.platform.supervisor.run_worker`, in its own session, with
stdout/stderr going to a log file (Flower's and Ray's tracebacks end there, never on the
user's terminal). First it arranges to die with its supervisor
(``PR_SET_PDEATHSIG``=SIGKILL, then checks the supervisor did not die before that) and
starts the reaper (:mod:`sealfl.common.procs`), which kills whatever is left of the run
when this process dies. It has no signal handling of its own: it is stopped by SIGKILL.

Jobs (JSON):

- ``{"kind": "campaign", "campaign_dir", ...}``: the aggregator's ServerApp
  (:mod:`sealfl.server.app`, configuration from ``server_config.json``) with the client
  app; the campaign directory is the outcome.
- ``{"kind": "fedeval", "candidates": {name: path}, "out", ...}``: the release gate's
  query round (:mod:`sealfl.server.eval_app`); ``out`` receives the counts.

Common fields: ``consortium_dir``, ``num_supernodes``, ``client_app`` ("module:factory",
called as ``factory(consortium_dir, **client_app_kwargs)``), ``client_app_kwargs``,
``app_dir`` (first on ``sys.path``), ``ray`` (a plan from
:func:`sealfl.platform.simulate.plan_ray`), ``flower_log_level``, ``result`` (where
``{"ok": true, "ray": {...}}`` or ``{"ok": false, "error", "type"}`` is written),
``run_dir`` (Ray's temporary directory goes under it).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from sealfl.platform.errors import PlatformError

DEFAULT_CLIENT_APP = "sealfl.clients.app:make_client_app"

log = logging.getLogger("sealfl.worker")


def load_client_app(spec: str, consortium_dir: str, kwargs: dict):
    """Build the ClientApp from ``"module:factory"``. Raises PlatformError naming the spec."""
    from sealfl.platform.errors import PlatformError

    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise PlatformError(f"client app {spec!r}: expected 'module:factory'")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise PlatformError(f"client app {spec!r} cannot be loaded: {exc}") from exc
    return factory(consortium_dir, **kwargs)


def run_job(job: dict) -> dict:
    """Run one job (see module docstring); returns the result fields beyond ``ok``."""
    from sealfl.common.testpoints import testpoint
    from sealfl.platform.errors import CampaignError, ReleaseError
    from sealfl.platform.simulate import run_flower, start_ray
    from sealfl.server.bookkeeping import CampaignDir

    if job.get("app_dir"):
        sys.path.insert(0, job["app_dir"])
    client_app = load_client_app(job.get("client_app") or DEFAULT_CLIENT_APP, job["consortium_dir"],
                                 job.get("client_app_kwargs") or {})
    kind = job["kind"]
    testpoint("before-ray")
    ray_info = start_ray(job["ray"], os.path.join(job["run_dir"], "ray"))
    run = {"cpus_per_partner": job["ray"].get("cpus_per_partner", 1.0),
           "flower_log_level": job.get("flower_log_level", "WARNING")}
    if kind == "campaign":
        from sealfl.server.app import ServerConfig, make_server_app

        cd = CampaignDir(job["campaign_dir"])
        cd.amend_status(ray=ray_info)
        app = make_server_app(ServerConfig.load(cd.dir))
        rss = _RunRss()  # from here: the Flower run itself, not the imports and Ray's start-up
        failure = run_flower(app, client_app, job["num_supernodes"], **run)
        if failure is not None:
            raise CampaignError(f"{type(failure).__name__}: {failure}") from failure
    elif kind == "fedeval":
        from sealfl.server.eval_app import make_eval_server_app
        from sealfl.server.validation import ReplyLimits

        candidates = {name: Path(p).read_bytes() for name, p in job["candidates"].items()}
        ev = job["eval"]
        global_arrays = None
        if ev.get("global"):
            import numpy as np

            with np.load(ev["global"], allow_pickle=False) as z:
                global_arrays = {k: z[k] for k in z.files}
        app = make_eval_server_app(candidates, job["num_supernodes"], job["out"], partners=ev["partners"],
                                   partner_keys=ev["partner_keys"], context_id=bytes.fromhex(ev["context_id"]),
                                   limits=ReplyLimits(**ev["limits"]), expected_n=ev["expected_n"],
                                   reference_names=ev.get("reference_names", ()), sums=ev.get("sums", ()),
                                   global_arrays=global_arrays, config=ev.get("config"))
        rss = _RunRss()
        failure = run_flower(app, client_app, job["num_supernodes"], **run)
        if failure is not None:
            raise ReleaseError(f"{type(failure).__name__}: {failure}") from failure
    else:
        raise PlatformError(f"unknown job kind {kind!r}")
    import resource

    # this process hosts the ServerApp and Flower's simulation driver: the coordinator
    return {"ray": ray_info, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "run_rss": rss.done()}


class _RunRss:
    """The coordinator's resident memory over the Flower run: RSS when it starts, and the
    peak after it (``VmHWM`` reset at the start by :func:`~sealfl.common.procs.reset_peak_rss`;
    where that is refused, the lifetime peak, said so in ``method``)."""

    def __init__(self):
        from sealfl.common.procs import memory_status, reset_peak_rss

        self.reset = reset_peak_rss()
        self.start = memory_status().get("VmRSS")

    def done(self) -> dict:
        from sealfl.common.procs import memory_status

        return {"start_bytes": self.start, "peak_bytes": memory_status().get("VmHWM"),
                "method": "VmHWM after clear_refs 5 at the run's start" if self.reset else "VmHWM (lifetime)"}


def _die_with_supervisor() -> None:
    from sealfl.common.procs import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
    expected = os.environ.get("SEALFL_SUPERVISOR_PID")
    if expected and os.getppid() != int(expected):  # the supervisor died before prctl took effect
        os._exit(70)


def _start_reaper(run_dir: str) -> int:
    """Start the reaper (:mod:`sealfl.common.procs`); returns the write end of its pipe,
    held until this process dies."""
    from sealfl.common.procs import read_stat

    sup = read_stat(os.getppid())
    r, w = os.pipe()
    subprocess.Popen([sys.executable, "-m", "sealfl.common.procs", "reap", str(r), os.environ["SEALFL_RUN_TOKEN"],
                      str(os.getsid(0)), run_dir, str(os.getppid()), str(sup.start if sup else 0)],
                     pass_fds=(r,), stdin=subprocess.DEVNULL, close_fds=True)
    os.close(r)
    return w


def main(argv: list[str]) -> None:
    """Entry point; never returns (``os._exit`` so no Flower/Ray thread can hold the exit)."""
    _die_with_supervisor()
    _reaper_pipe = _start_reaper(str(Path(argv[0]).parent))  # noqa: F841 - open for this process's lifetime
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("alembic", "filelock"):  # Flower's in-memory state set-up logs its plugins at INFO
        logging.getLogger(chatty).setLevel(logging.WARNING)
    job = json.loads(Path(argv[0]).read_text())
    code = 0
    try:
        result = {"ok": True, **run_job(job)}
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a result for the supervisor
        from sealfl.common.errors import SealflError

        if isinstance(exc, SealflError):
            log.error("%s", exc)
        else:
            log.exception("worker failed")
        result = {"ok": False, "error": str(exc) if isinstance(exc, SealflError) else f"{type(exc).__name__}: {exc}",
                  "type": type(exc).__name__}
        code = 1
    from sealfl.common.fsutil import atomic_write

    atomic_write(job["result"], json.dumps(result).encode(), 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
