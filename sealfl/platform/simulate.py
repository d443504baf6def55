"""Ray for Flower's simulation engine: an embedded Ray on loopback with token
authentication, or an existing cluster whose protection is measured and recorded.

Runs inside the worker process (:mod:`sealfl.platform.worker`); the supervisor only calls
:func:`plan_ray` and :func:`ray_environment` (neither imports Ray).

**Embedded Ray** (default). The supervisor starts the worker with

- ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray 2.55 then takes the loopback address as the
  node IP (``ray._private.services.get_node_ip_address`` returns ``get_localhost_ip()``),
  and Ray binds its gRPC servers (GCS, raylet, object manager, core workers) and agents
  to that address instead of every interface. ``ray.init(_node_ip_address="127.0.0.1")``
  does not do it: ``resolve_ip_for_localhost`` maps 127.0.0.1 back to the outward IP.
  Measured here: without the variable GCS, raylet and workers listened on ``::`` and the
  autoscaler monitor on ``0.0.0.0``; with it every socket was on 127.0.0.1.
- ``RAY_AUTH_MODE=token`` and a fresh 256-bit ``RAY_AUTH_TOKEN`` per run (Ray's token
  authentication, Ray >= 2.52): every Ray gRPC call must carry it; the token lives only
  in the environment of this run's processes (never on disk, never in git) and is not
  logged. Ray's own ``ray.init`` would otherwise write a token to ``~/.ray/auth_token``.

After start-up :func:`start_ray` checks both properties and refuses to go on if either
fails (the partners' secret kits are reachable from Ray workers in simulation).

**Existing cluster** (``--ray-address`` / ``RAY_ADDRESS``): the user's ``RAY_AUTH_*``
variables pass through; a cluster on a loopback address (a multi-node cluster on one
host, started with ``ray.cluster_utils.Cluster`` and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``)
gets the same loopback variable, or the driver would look for it on the outward address; :func:`probe_auth` asks the cluster's GCS for its cluster id
without a token and records whether it refused (``"token"``) or answered (``"none"``,
logged as a warning). Flower's Ray backend calls ``ray.init()`` only when Ray is not
running yet, so it uses the Ray started here (flwr 1.42, ray 2.55.1); its
``terminate()`` calls ``ray.shutdown()`` when the run ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
from pathlib import Path

from sealfl.platform.errors import SimulationError

log = logging.getLogger(__name__)

ENV_LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


# -- supervisor side (no Ray import) -----------------------------------------------------------

def check_reachable(address: str, timeout_s: float = 5.0) -> str:
    """Fail fast if a Ray GCS address (``host:port``, optionally ``ray://``; ``auto``: the
    last cluster started here) does not accept TCP connections -- ``ray.init`` would
    retry for minutes. Returns the resolved address. Raises SimulationError."""
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
    return address


def plan_ray(ray_address: str | None, cpus_per_partner: float = 1.0) -> dict:
    """Decide embedded vs attach before anything starts: ``{"mode": "embedded"}`` or
    ``{"mode": "attach", "address"}`` (reachability checked). ``"local"`` or nothing
    (and no ``RAY_ADDRESS``) means embedded. Raises SimulationError."""
    address = ray_address or os.environ.get("RAY_ADDRESS")
    if not address or address == "local":
        return {"mode": "embedded", "cpus_per_partner": cpus_per_partner}
    return {"mode": "attach", "address": check_reachable(address), "cpus_per_partner": cpus_per_partner}


def ray_environment(plan: dict, base: dict) -> dict:
    """The worker's environment for ``plan``: embedded Ray gets loopback binding and a
    fresh auth token (any inherited Ray address/token is dropped); an attach keeps the
    user's ``RAY_AUTH_*``. Returns a new dict."""
    env = {k: v for k, v in base.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs here; silences Ray's tip
    if plan["mode"] == "embedded":
        for k in _AUTH_VARS:
            env.pop(k, None)
        env.update({ENV_LOOPBACK: "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    elif is_loopback_address(plan["address"]):
        # a cluster on loopback (e.g. ``ray.cluster_utils.Cluster``): without the variable
        # Ray rewrites 127.0.0.1 to the host's outward address and never reaches the GCS
        env[ENV_LOOPBACK] = "0"
    else:
        env.pop(ENV_LOOPBACK, None)
    return env


@contextlib.contextmanager
def attached_ray(address: str):
    """Connect this process to the Ray cluster at ``address`` for the duration (the
    release pipeline's tasks), then disconnect. The user's ``RAY_AUTH_*`` apply; a
    loopback address sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray reads it when it is
    first imported: this only helps a process that has not imported Ray yet). Raises
    SimulationError if the address cannot be reached."""
    address = check_reachable(address)
    saved = os.environ.get(ENV_LOOPBACK)
    if is_loopback_address(address) and saved is None:
        os.environ[ENV_LOOPBACK] = "0"
    import ray

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop(ENV_LOOPBACK, None)


def is_loopback_address(address: str) -> bool:
    """Whether a Ray address (``[ray://]host:port``) names a loopback host
    (``127.0.0.0/8``, ``::1`` or ``localhost``). Pure."""
    import ipaddress

    host = address.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- worker side -------------------------------------------------------------------------------

def classify_probe(code_name: str | None) -> str:
    """Protection of a Ray cluster from the answer to an unauthenticated GCS call:
    ``UNAUTHENTICATED`` -> ``"token"``; success (``None``) -> ``"none"``; anything else
    -> ``"unknown (<code>)"``. Pure."""
    if code_name is None:
        return "none"
    if code_name == "UNAUTHENTICATED":
        return "token"
    return f"unknown ({code_name})"


def probe_auth(gcs_address: str, token: str | None = None, timeout_s: float = 5.0) -> str:
    """Call ``NodeInfoGcsService/GetClusterId`` on ``gcs_address`` (with ``token`` as a
    bearer token if given) and classify the answer with :func:`classify_probe`."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(gcs_address) as ch:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(ch).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            return classify_probe(exc.code().name)
    return classify_probe(None)


def _session_pids() -> list[int]:
    from sealfl.common.procs import run_members

    return run_members(os.environ.get("SEALFL_RUN_TOKEN", "-"), os.getsid(0))


#: Ray 2.55 gives a new node's raylet a fixed 30 s to register with the GCS
#: (``raylet_start_wait_time_s = 30`` in ``ray/_private/node.py``, not configurable) and
#: then raises this; on a host whose cores are all busy it is missed now and then
#: (seen here at load 25 on 2 cores).
RAY_START_TIMEOUT_TEXT = "timed out during startup"
RAY_START_ATTEMPTS = 3


def is_ray_start_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is Ray's "node timed out during startup" (a busy host), not a
    configuration error: only that one is worth another attempt. Pure."""
    return type(exc) is Exception and RAY_START_TIMEOUT_TEXT in str(exc)


def init_local_ray(init, shutdown, attempts: int = RAY_START_ATTEMPTS, members=None, kill=None) -> None:
    """Call ``init()`` (a ``ray.init`` starting a local node) up to ``attempts`` times while
    it fails with Ray's start-up timeout (:func:`is_ray_start_timeout`); before each new
    attempt ``shutdown()`` runs and the processes the failed attempt started in this run
    (``members()``: this run's pids, default :func:`_session_pids`) are killed by pid.

    Raises:
        SimulationError: still timing out after ``attempts`` (the host is too busy),
            saying so; any other exception of ``init`` passes through unchanged.
    """
    members = members or _session_pids
    kill = kill or _kill_pids
    for attempt in range(1, attempts + 1):
        before = set(members())
        try:
            init()
            return
        except Exception as exc:
            if not is_ray_start_timeout(exc):
                raise
            shutdown()
            kill(sorted(set(members()) - before - {os.getpid()}))
            if attempt == attempts:
                raise SimulationError(f"Ray's node did not register within its fixed 30 s in {attempts} attempts "
                                      "(the host's cores are busy): try again when the machine is less loaded") from exc
            log.warning("Ray's node missed its 30 s start-up deadline (a busy host); starting it again (%d of %d)",
                        attempt + 1, attempts)


def _kill_pids(pids: list[int]) -> None:
    import signal

    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def start_ray(plan: dict, temp_dir: str | None) -> dict:
    """Start the embedded Ray or attach to ``plan["address"]``; check and describe its
    protection. Returns ``{"gcs_address", "started_here", "mode", "auth", "loopback_only"}``.

    Raises:
        SimulationError: the embedded Ray is not token-protected or listens on a
            non-loopback address (nothing runs then).
    """
    import ray

    from sealfl.common.procs import listening_sockets, non_loopback

    if plan["mode"] == "attach":
        log.info("attaching to the Ray cluster at %s", plan["address"])
        ray.init(address=plan["address"], log_to_driver=False, logging_level=logging.WARNING)
        gcs = ray.get_runtime_context().gcs_address
        auth = "unknown (Ray Client address)" if "://" in plan["address"] else probe_auth(gcs)
        info = {"gcs_address": gcs, "started_here": False, "mode": "attach", "auth": auth, "loopback_only": None}
        if auth == "none":
            log.warning("the Ray cluster at %s accepts drivers WITHOUT authentication: anyone who can reach it can "
                        "run code next to the partners' kits; start it with RAY_AUTH_MODE=token", plan["address"])
        else:
            log.warning("the Ray cluster at %s: authentication %s", plan["address"], auth)
        return info
    if os.environ.get(ENV_LOOPBACK) != "0" or os.environ.get("RAY_AUTH_MODE") != "token":
        raise SimulationError("the embedded Ray must be started by the supervisor (loopback + token environment)")
    kw = {"_temp_dir": temp_dir} if temp_dir else {}
    init_local_ray(lambda: ray.init(address="local", include_dashboard=False, log_to_driver=False,
                                    logging_level=logging.WARNING, **kw), ray.shutdown)
    gcs = ray.get_runtime_context().gcs_address
    exposed = non_loopback(listening_sockets(_session_pids()))
    auth = probe_auth(gcs)
    if exposed or auth != "token":
        ray.shutdown()
        raise SimulationError(f"refusing to run: the embedded Ray is not private (sockets off loopback: {exposed}; "
                              f"unauthenticated GCS call: {auth})")
    log.info("embedded Ray at %s: loopback only, token authentication", gcs)
    return {"gcs_address": gcs, "started_here": True, "mode": "embedded", "auth": "token", "loopback_only": True}


# A partner actor whose node dies is restarted elsewhere and its pending call retried
# (Ray's actor fault tolerance); Flower passes these options to ``ClientAppActor.options``.
# Calls retry without a count (-1): until the GCS has declared the node dead (health
# checks, ~15 s by default) every retry fails at once with ActorUnavailableError, so a
# small count runs out before the restart; the restarts bound it (an actor past
# ACTOR_MAX_RESTARTS is dead and its calls fail), and so does the round's reply timeout.
ACTOR_MAX_RESTARTS = 4
ACTOR_MAX_TASK_RETRIES = -1


def actor_options(cpus_per_partner: float) -> dict:
    """Flower's ``client_resources`` for one simulated SuperNode actor: its CPUs, no GPU,
    and Ray's restart/retry budget, so a lost node costs a retry, not the partner's reply
    (Flower 1.42's ``BasicActorPool`` calls ``ClientAppActor.options(**client_resources)``
    and sizes the pool from ``num_cpus`` only). Pure."""
    return {"num_cpus": cpus_per_partner, "num_gpus": 0.0,
            "max_restarts": ACTOR_MAX_RESTARTS, "max_task_retries": ACTOR_MAX_TASK_RETRIES}


class _DropDeprecation(logging.Filter):
    """Flower 1.42 warns that ``run_simulation`` is deprecated in favour of ``flwr run``;
    we call it on purpose (SuperLink deployment is a separate path), so drop that one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`run_simulation` function is deprecated" not in record.getMessage()


def run_flower(server_app, client_app, num_supernodes: int, *, cpus_per_partner: float = 1.0,
               flower_log_level: str = "WARNING") -> BaseException | None:
    """Run one Flower app pair to completion on the Ray started by :func:`start_ray`.

    Returns the ServerApp's exception (Flower re-raises it) or None. Flower's Ray
    backend stops or disconnects Ray at the end.
    """
    from flwr.simulation import run_simulation
    from flwr.supercore.logger import update_console_handler

    update_console_handler(level=flower_log_level)
    for h in logging.getLogger("flwr").handlers:
        if not any(isinstance(f, _DropDeprecation) for f in h.filters):
            h.addFilter(_DropDeprecation())
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_supernodes,
                       backend_config={"client_resources": actor_options(cpus_per_partner)})
    except Exception as exc:  # run_simulation re-raises the ServerApp thread's error
        return exc
    return None
