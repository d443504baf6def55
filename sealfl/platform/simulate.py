"""Run a Flower ServerApp + ClientApp pair through Flower's simulation engine on Ray.

Ray: a new embedded local Ray by default (``address="local"``: without it ``ray.init()``
silently joins any Ray already running on the machine); ``ray_address`` or
``RAY_ADDRESS`` attaches to an existing cluster. Flower's Ray backend calls
``ray.init()`` only when Ray is not already running, so it uses the Ray started here
(checked with flwr 1.42 / ray 2.55.1), and it disconnects from Ray when the run ends.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from .errors import SimulationError

log = logging.getLogger(__name__)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast if a Ray GCS address (``host:port``, optionally ``ray://``) does not accept
    TCP connections: ``ray.init`` would otherwise retry for minutes. Raises SimulationError."""
    if address == "auto":  # Ray reads the address of the last cluster started here
        try:
            address = Path("/tmp/ray/ray_current_cluster").read_text().split()[0]
        except (OSError, IndexError) as exc:
            raise SimulationError("--ray-address auto: no Ray cluster was started on this machine "
                                  "('ray start --head'), or drop --ray-address to use a local Ray") from exc
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise SimulationError(f"cannot reach the Ray cluster at {address!r} ({exc}); start it with "
                              "'ray start --head' or drop --ray-address to use a local Ray") from exc


def _ray_init(address: str | None) -> bool:
    """Start or attach to Ray. Returns True if we started a local Ray (and must stop it)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address == "local":
        address = None
    if address:
        _check_reachable(address)
        log.info("attaching to the Ray cluster at %s", address)
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        return False
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs here; silences Ray's tip
    # address="local": always a new embedded Ray; without it ray.init() silently joins any
    # Ray cluster already running on this machine (and dies with it)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONWARNINGS": "ignore"}})
    return True


class _DropDeprecation(logging.Filter):
    """Flower 1.42 warns that ``run_simulation`` is deprecated in favour of ``flwr run``;
    we call it on purpose (SuperLink deployment is a separate path), so drop that one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`run_simulation` function is deprecated" not in record.getMessage()


def _hide_run_simulation_deprecation() -> None:
    flwr_logger = logging.getLogger("flwr")
    for h in flwr_logger.handlers:
        if not any(isinstance(f, _DropDeprecation) for f in h.filters):
            h.addFilter(_DropDeprecation())


def _exit_on_signal(on_interrupt: Callable[[int], None] | None, started_ray: bool):
    """Install SIGINT/SIGTERM handlers (main thread only) that record the interruption,
    stop the Ray we started and exit 128+signal. Flower's simulation runtime does not stop
    on Ctrl-C (seen with flwr 1.42: the driver waited forever for dead Ray actors).
    Everything a campaign needs to resume is already on disk (checkpoint per round).
    Returns the previous handlers (to restore) or None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):  # noqa: ARG001
        try:
            if on_interrupt is not None:
                on_interrupt(signum)
        finally:
            if started_ray:
                try:
                    import ray

                    ray.shutdown()
                except Exception:  # exiting anyway
                    pass
            os._exit(128 + signum)

    return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}


def run_on_ray(server_app, client_app, num_supernodes: int, *, ray_address: str | None = None,
               cpus_per_partner: float = 1.0, flower_log_level: str = "WARNING",
               on_interrupt: Callable[[int], None] | None = None) -> tuple[dict, BaseException | None]:
    """Run one Flower app pair to completion.

    Returns ``({"gcs_address", "started_here"}, the ServerApp's exception or None)``:
    Flower re-raises the ServerApp thread's error; callers turn it into their own error
    with the context they recorded on disk. On SIGINT/SIGTERM ``on_interrupt(signum)`` is
    called, Ray is stopped and the process exits with 128 + signum.
    """
    import ray
    from flwr.simulation import run_simulation
    from flwr.supercore.logger import update_console_handler

    update_console_handler(level=flower_log_level)
    _hide_run_simulation_deprecation()
    started = _ray_init(ray_address)
    info = {"gcs_address": ray.get_runtime_context().gcs_address, "started_here": started}
    failure: BaseException | None = None
    previous = _exit_on_signal(on_interrupt, started)
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_supernodes,
                       backend_config={"client_resources": {"num_cpus": cpus_per_partner, "num_gpus": 0.0}})
    except Exception as exc:  # run_simulation re-raises the ServerApp thread's error
        failure = exc
    finally:
        if previous:
            for sig, h in previous.items():
                signal.signal(sig, h)
        if started:
            ray.shutdown()
    return info, failure
