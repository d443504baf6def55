"""Long-lived Flower processes run from a startup kit: the SuperLink and a partner's SuperNode.

:func:`superlink_command` / :func:`supernode_command` build the command lines (pure, tested
directly); :func:`run_service` starts one in its own session with a fresh
``SEALFL_RUN_TOKEN`` (every descendant inherits it: ``flower-superexec``, the
``flwr-serverapp`` / ``flwr-clientapp`` processes Flower starts per run or message,
even though Flower puts them in sessions of their own), waits, and on SIGINT/SIGTERM
(inside :func:`sealfl.platform.supervisor.interruptible`) SIGKILLs every process carrying
the token before raising :class:`~sealfl.common.errors.Interrupted`: nothing is left
behind. SIGKILL is safe for Flower's state: the SuperLink's ``--database`` is SQLite
(transactions), and the campaign files are written atomically by the ServerApp.

SuperLink (Flower 1.42): one HTTPS port for Fleet, Control and the ServerApp runtime; TLS
from the kit, ``--enable-supernode-auth``, ``--database``, no runtime dependency
installation (offline hosts work; every host has sealfl installed). Once it answers,
:func:`register_supernodes` registers each key of the kit's ``supernodes.json`` with
``flwr supernode register`` (a key already registered is skipped).

SuperNode: Flower's ``flower-supernode``, run through :mod:`sealfl.platform.supernode_main`
(the same entry point with its fixed 3 s / 0.5 s waits shortened), with
``--root-certificates`` (the kit's CA), ``--auth-supernode-private-key``, and
``--node-config kit-dir=...``, and ``--isolation process``: the partner process itself takes the
SuperNode's ClientApp tasks (:mod:`sealfl.clients.executor`) and answers them with the
handlers of :mod:`sealfl.clients.app`, which load this kit.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sealfl.common.errors import Interrupted
from sealfl.common.procs import ENV_TOKEN, follow_parent_preexec, kill_run
from sealfl.platform import flwr_cli
from sealfl.platform.errors import DeploymentError
from sealfl.platform.startup_kits import (
    CA_FILE,
    SUPERLINK_CERT,
    SUPERLINK_KEY,
    SUPERNODE_KEY_FILE,
    SUPERNODES_FILE,
)

__all__ = ["superlink_command", "supernode_command", "supernode_refusal", "register_supernodes", "run_service", "check_kit_files",
           "parse_hostport"]

log = logging.getLogger(__name__)

#: the module ``sealfl partner start`` runs the SuperNode with (Flower's flower-supernode, shorter waits)
SUPERNODE_MAIN = "sealfl.platform.supernode_main"


def parse_hostport(text: str, what: str = "--superlink") -> tuple[str, int]:
    """``"HOST:PORT"`` (IPv6 as ``[::1]:PORT``) -> (host, port). Raises DeploymentError."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DeploymentError(f"{what} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9092")
    return host, int(port)


def check_kit_files(kit: Path, names: list[str], who: str) -> None:
    """Every file of ``names`` exists in ``kit``; else DeploymentError naming the first missing."""
    if not kit.is_dir():
        raise DeploymentError(f"{kit} is not a directory; give the {who} kit written by 'sealfl consortium create'")
    for n in names:
        if not (kit / n).is_file():
            raise DeploymentError(f"the {who} kit {kit} has no {n}; re-issue it with 'sealfl consortium create'")


def superlink_command(kit: Path, host: str, port: int, database: Path) -> list[str]:
    """The ``flower-superlink`` command line for the SuperLink kit ``kit``."""
    check_kit_files(kit, [CA_FILE, SUPERLINK_CERT, SUPERLINK_KEY, SUPERNODES_FILE], "SuperLink")
    k = kit.resolve()
    return [flwr_cli.flower_bin("flower-superlink"), "--ssl-ca-certfile", str(k / CA_FILE),
            "--ssl-certfile", str(k / SUPERLINK_CERT), "--ssl-keyfile", str(k / SUPERLINK_KEY),
            "--enable-supernode-auth", "--database", str(Path(database).resolve()),
            "--disable-runtime-dependency-installation", "--host", host, "--port", str(port)]


def supernode_command(kit: Path, superlink: str, local_port: int, *, executor_secret: Path | None = None,
                      heartbeat_s: float | None = None) -> list[str]:
    """The ``flower-supernode`` command line for the partner kit ``kit`` joining ``superlink``
    (``HOST:PORT``), run as ``python -m sealfl.platform.supernode_main`` (Flower's entry
    point with shorter fixed waits); its own Runtime API listens on 127.0.0.1:``local_port``.
    With ``executor_secret`` (a file of random bytes) the SuperNode runs with
    ``--isolation process``: it starts no ClientApp process, and the partner process takes its
    tasks itself, authenticated with that secret (:mod:`sealfl.clients.executor`); without it,
    Flower's own per-message ``flwr-clientapp`` runs the FAB's ClientApp. ``heartbeat_s``: the
    SuperNode's heartbeat interval in seconds (Flower's 30 s otherwise; see
    :mod:`sealfl.platform.supernode_main`).

    Raises:
        DeploymentError: a kit file missing, ``superlink`` not HOST:PORT, or ``heartbeat_s``
            outside what the SuperLink accepts (10..1800 s).
    """
    check_kit_files(kit, [CA_FILE, SUPERNODE_KEY_FILE, "kit.json"], "partner")
    parse_hostport(superlink)
    k = kit.resolve()
    node = {"kit-dir": str(k)}
    beat: list[str] = []
    if heartbeat_s is not None:
        from sealfl.platform.supernode_main import HEARTBEAT_ARG, heartbeat_bounds

        low, high = heartbeat_bounds()
        if not low <= heartbeat_s <= high:
            raise DeploymentError(f"--heartbeat {heartbeat_s:g} s: the SuperLink accepts {low:g} to {high:g} s")
        beat = [HEARTBEAT_ARG, f"{heartbeat_s:g}"]
    isolation = ([] if executor_secret is None else
                 ["--isolation", "process", "--superexec-auth-secret-file", str(Path(executor_secret).resolve())])
    return [sys.executable, "-m", SUPERNODE_MAIN, *beat, "--superlink", superlink, "--root-certificates",
            str(k / CA_FILE), "--auth-supernode-private-key", str(k / SUPERNODE_KEY_FILE),
            "--node-config", flwr_cli.toml_config(node), *isolation, "--host", "127.0.0.1", "--port", str(local_port)]


def supernode_refusal(log_text: str) -> str:
    """Why a SuperNode stopped, from its log (Flower 1.42's wording): a TLS certificate
    that does not chain to the kit's CA, an authentication key the SuperLink refused
    (unregistered, or a SuperNode with that key is online already), or Flower's own
    ERROR lines. Pure."""
    from sealfl.common.errors import plain_text

    if "CERTIFICATE_VERIFY_FAILED" in log_text:
        return ("TLS refused: the SuperLink's certificate does not chain to this kit's ca.crt (a kit of another "
                "consortium, or a SuperLink with another kit); ask the coordinator for this consortium's kit")
    if "Failed to activate SuperNode" in log_text:
        return ("node authentication refused: the SuperLink does not accept this kit's supernode_auth_key (not "
                "registered by 'sealfl superlink start', or a SuperNode with this key is connected already)")
    lines = [plain_text(ln) for ln in log_text.splitlines()]
    errors = [ln.split("ERROR", 1)[1].strip(" :") for ln in lines if "ERROR" in ln]
    return plain_text(" | ".join(errors[-3:]), 400) or "no error in its log"


def registered_keys(kit: Path) -> list[dict]:
    """``[{"name", "public_key"}]`` of the SuperLink kit's ``supernodes.json``, checked:
    each an OpenSSH ECDSA public key line. Raises DeploymentError naming the entry."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key

    path = kit / SUPERNODES_FILE
    try:
        doc = json.loads(path.read_bytes()[: 1 << 20])
        entries = doc["partners"]
        assert isinstance(entries, list)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        raise DeploymentError(f"{path} is not a SuperNode key list ({exc}); re-issue the SuperLink kit") from exc
    out = []
    for i, e in enumerate(entries):
        try:
            key = load_ssh_public_key(str(e["public_key"]).encode())
            assert isinstance(key, ec.EllipticCurvePublicKey)
            out.append({"name": str(e["name"]), "public_key": str(e["public_key"])})
        except Exception as exc:  # noqa: BLE001 - any failure: the entry is not a key
            raise DeploymentError(f"{path}: partners[{i}] is not an OpenSSH ECDSA public key ({exc})") from exc
    return out


def register_supernodes(kit: Path, flwr_home: Path, keys_dir: Path) -> list[str]:
    """Register every key of the kit's list with ``flwr supernode register`` (skipping keys
    the SuperLink lists already). Returns the names registered now. Raises DeploymentError."""
    entries = registered_keys(kit)
    keys_dir.mkdir(parents=True, exist_ok=True)
    done = []
    for e in entries:
        from sealfl.clients.kit import slug

        pub = keys_dir / f"{slug(e['name'])}.pub"
        pub.write_text(e["public_key"] + "\n")
        try:
            flwr_cli.flwr_json(["supernode", "register", str(pub), flwr_cli.CONNECTION, "--name", slug(e["name"])],
                               flwr_home)
        except DeploymentError as exc:
            if "already" in str(exc).lower():
                continue
            raise
        done.append(e["name"])
    return done


def run_service(cmd: list[str], *, log_path: Path, env: dict, on_ready: Callable[[], None] | None = None,
                ready: Callable[[], bool] | None = None, ready_timeout_s: float = 60.0,
                announce: Callable[[str], None] | None = None, tick_s: float = 0.5, name: str | None = None) -> int:
    """Run ``cmd`` until it exits or a signal arrives; returns its exit code. The service
    dies with this process, also when this one is SIGKILLed (``PR_SET_PDEATHSIG``; Flower's
    own children follow it through their ``--parent-pid``).

    ``ready()`` is polled until true (then ``on_ready()`` runs once); the process exiting
    first, or ``ready_timeout_s`` passing, raises DeploymentError naming ``log_path``.
    ``name`` names the service in messages (default: ``cmd[0]``'s file name).

    Raises:
        Interrupted: SIGINT/SIGTERM inside :func:`~sealfl.platform.supervisor.interruptible`;
            every process of the service (token) is gone by then.
    """
    from sealfl.platform import supervisor

    supervisor.check()
    name = name or Path(cmd[0]).name
    token = os.urandom(16).hex()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, close_fds=True,
                                start_new_session=True, env={**env, ENV_TOKEN: token},
                                preexec_fn=follow_parent_preexec())
    pidfd = os.pidfd_open(proc.pid)
    is_ready = ready is None
    t0 = time.monotonic()
    try:
        if is_ready and on_ready:
            on_ready()
        while True:
            r, _, _ = select.select([pidfd], [], [], tick_s)
            if r:
                break
            sig = supervisor.requested()
            if sig:
                raise Interrupted(sig)
            if not is_ready:
                if ready():
                    is_ready = True
                    if on_ready:
                        on_ready()
                elif time.monotonic() - t0 > ready_timeout_s:
                    raise DeploymentError(f"{name} did not come up within {ready_timeout_s:.0f} s; "
                                          f"see {log_path}")
        code = proc.wait()
        if not is_ready:
            raise DeploymentError(f"{name} exited {code} before it was ready; see {log_path}")
        return code
    finally:
        os.close(pidfd)
        survivors = kill_run(token, proc.pid, deadline_s=30.0)
        proc.wait()
        if survivors:
            log.error("processes %s of %s survived SIGKILL", survivors, name)
