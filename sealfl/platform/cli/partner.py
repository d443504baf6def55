"""``sealfl partner``: what a consortium partner runs on its own machine."""

from __future__ import annotations

from pathlib import Path

import typer

from sealfl.common.errors import SealflError
from sealfl.platform.cli.output import command_group, console, fail

__all__ = ["app"]

app = command_group("partner")


@app.command("check")
def check(
    kit: Path = typer.Argument(..., help="The partner's startup kit directory (consortium/partners/<name>)."),
) -> None:
    """Unwrap the kit's HE secret with the partner key, round-trip a test ciphertext, and
    load the partner's own data split. Nothing leaves this machine."""
    import numpy as np

    from sealfl.clients.kit import load_kit
    from sealfl.clients.plugins import get_task

    try:
        k = load_kit(str(kit))
        probe = np.array([1.25, -2.5, 3.0])
        err_max = float(np.max(np.abs(k.codec.decrypt(k.codec.encrypt(probe)) - probe)))
        task = get_task(k.task)
        data = task.load_data(k.partner, task.train_defaults())
    except (SealflError, OSError) as exc:
        fail(str(exc))
    console.print(f"partner [bold]{k.partner}[/] of consortium {k.consortium} (task {task.name}): HE secret "
                  f"unwrapped (context {k.codec.context_id.hex()[:16]}…, round-trip error {err_max:.1e}); "
                  f"data: {task.n_train(data)} training examples")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warm_up(kit) -> None:
    """Import the partner's handlers and task once, in this long-lived process (what every
    per-message ClientApp process paid before the relay)."""
    import sealfl.clients.app  # noqa: F401 - the handlers the relay calls
    from sealfl.clients.plugins import get_task

    task = get_task(kit.task)
    task.load_data(kit.partner, task.train_defaults())


@app.command("start")
def start(
    kit: Path = typer.Argument(..., help="The partner's startup kit directory (consortium/partners/<name>)."),
    superlink: str = typer.Option(..., "--superlink", help="HOST:PORT of the consortium's SuperLink."),
    port: int = typer.Option(0, min=0, max=65535, help="Local port of this SuperNode's ClientApp API on 127.0.0.1 "
                                                       "(0: a free one; two SuperNodes on one host need two ports)."),
    log_file: Path = typer.Option(None, "--log", help="SuperNode log (default: supernode-<partner>.log here)."),
) -> None:
    """Run a Flower SuperNode with this kit: TLS against the kit's CA, node authentication with
    the kit's key; this process loads the kit, the task and the data once and answers every
    message the SuperNode's per-message ClientApp relays to it (sealfl.clients.relay). Runs until Ctrl-C / SIGTERM (exit 130 / 143,
    every process it started stopped)."""
    from sealfl.platform.supervisor import interruptible

    with interruptible():
        import os
        import shutil
        import tempfile

        from sealfl.clients.kit import load_kit
        from sealfl.clients.relay import PartnerRelay
        from sealfl.common.errors import Interrupted
        from sealfl.platform import flwr_cli
        from sealfl.platform.cli.output import stopped
        from sealfl.platform.services import run_service, supernode_command

        relay_dir = tempfile.mkdtemp(prefix="sealfl-partner-")  # mode 0700: the relay socket's directory
        relay = None
        try:
            k = load_kit(str(kit.resolve()))  # the kit opens here, before anything connects
            relay = PartnerRelay(os.path.join(relay_dir, "relay.sock"), {"kit-dir": str(kit.resolve())})
            _warm_up(k)
            relay.start()
            cmd = supernode_command(kit, superlink, port or _free_port(), relay_socket=relay.path)
            log_path = log_file or Path(f"supernode-{kit.resolve().name}.log")
            console.print(f"SuperNode of [bold]{k.partner}[/] joining {superlink} (TLS, node authentication); "
                          f"log: {log_path}", highlight=False)
            code = run_service(cmd, log_path=log_path, env=flwr_cli.flower_env())
        except Interrupted as exc:
            stopped(Interrupted(exc.signum, f"SuperNode of {kit.resolve().name} stopped by signal"))
        except (SealflError, OSError) as exc:
            fail(str(exc))
        finally:
            if relay is not None:
                relay.close()
            shutil.rmtree(relay_dir, ignore_errors=True)
    from sealfl.platform.services import supernode_refusal

    try:
        why = supernode_refusal(log_path.read_text(errors="replace"))
    except OSError:
        why = "its log is unreadable"
    fail(f"SuperNode of {kit.resolve().name} stopped (flower-supernode exit {code}): {why}; log: {log_path}")
