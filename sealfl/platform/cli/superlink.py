"""``sealfl superlink``: the coordinator runs the consortium's SuperLink from its kit."""

from __future__ import annotations

import socket
from pathlib import Path

import typer

from sealfl.common.errors import Interrupted, SealflError
from sealfl.platform.cli.output import command_group, console, error_text, fail, stopped
from sealfl.platform.supervisor import interruptible

__all__ = ["app"]

app = command_group("superlink")


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _check_port_free(host: str, port: int) -> None:
    """Refuse up front a port something already listens on, or a --host this machine cannot
    listen on (Flower would fail after start-up); the message says which of the two it is."""
    import errno

    if host.startswith("[") and host.endswith("]"):
        fail(f"--host {host}: give an IPv6 address without brackets (e.g. --host {host[1:-1]})")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as exc:
            fail(f"cannot listen on {host}:{port}: --host {host!r} is not an address or a name of this machine "
                 f"({exc.strerror or exc}); give one of its addresses, e.g. 127.0.0.1 or 0.0.0.0 (all)")
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                fail(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another SuperLink or service has it); "
                     "choose another --port")
            if exc.errno == errno.EADDRNOTAVAIL:
                fail(f"cannot listen on {host}:{port}: {host} is not an address of this machine; give one of its "
                     "addresses, e.g. 127.0.0.1 or 0.0.0.0 (all)")
            fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")


def _lock_state(state: Path):
    """An exclusive lock on STATE/.lock for this process's life; refuse a state directory another
    SuperLink uses (two would share one database and log)."""
    import fcntl
    import os

    fd = os.open(state / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        fail(f"another SuperLink uses the state directory {state}; stop it first or give another --state")
    return fd


@app.command("start")
def start(
    kit: Path = typer.Argument(..., help="The SuperLink kit (<consortium>/superlink)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (Fleet, Control and ServerApp API: one port)."),
    port: int = typer.Option(9092, min=1, max=65535, help="Port to listen on."),
    state: Path = typer.Option(Path("superlink-state"), "--state",
                               help="Directory for the SuperLink's database (runs and nodes survive a restart) and "
                                    "its log."),
) -> None:
    """Run flower-superlink with the kit's TLS certificate, SuperNode authentication and a
    database; register the kit's SuperNode keys; run until Ctrl-C / SIGTERM (exit 130 / 143,
    every process it started stopped)."""
    with interruptible():
        from sealfl.platform import flwr_cli
        from sealfl.platform.services import register_supernodes, registered_keys, run_service, superlink_command

        try:
            # everything that can be refused is, before the state directory is made
            cmd = superlink_command(kit, host, port, state / "superlink.db")
            registered_keys(kit)  # a damaged supernodes.json: refused now, not once the SuperLink runs
            _check_port_free(host, port)
            try:
                state.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                fail(f"cannot create the state directory {state}: {exc.strerror or exc}; give a --state you can write")
            _lock_state(state)  # held (fd kept open) while this process lives: one SuperLink per state dir
            log_path = state / "superlink.log"
            connect = "127.0.0.1" if host in ("0.0.0.0", "::") else host
            home = flwr_cli.write_flwr_home(state / "flwr-home", f"{connect}:{port}", kit / "ca.crt")

            def ready() -> None:
                names = register_supernodes(kit, home, state / "registered")
                console.print(f"SuperLink on {host}:{port} (TLS, SuperNode authentication; state {state}); "
                              f"{len(names)} SuperNode key(s) registered now; log: {log_path}", markup=False,
                              highlight=False)

            code = run_service(cmd, log_path=log_path, env=flwr_cli.flower_env(flwr_home=home),
                               ready=lambda: _accepts(connect, port), on_ready=ready)
        except Interrupted as exc:
            stopped(Interrupted(exc.signum, f"SuperLink on {host}:{port} stopped by signal; state kept in {state}"))
        except (SealflError, OSError) as exc:
            fail(error_text(exc))
    fail(f"flower-superlink exited {code}; see {log_path}")
