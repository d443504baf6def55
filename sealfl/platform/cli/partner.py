"""``sealfl partner``: what a consortium partner runs on its own machine."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sealfl.common.errors import SealflError
from sealfl.platform.cli.output import command_group, console, err, error_text, fail

__all__ = ["app"]

app = command_group("partner")


KEY_OPTION = typer.Option(None, "--key", help="Your private partner_key.pem ('sealfl partner keygen'), when the kit "
                                                "was made from your public key and the key is not in the kit.")
DATA_OPTION = typer.Option(None, "--data", help="Your own data: heart: a CSV with heart_disease_uci.csv's columns "
                                                "(docs/partner.md); causal-lm: a directory of text files. Default: "
                                                "the bundled demo data of this partner.")


@app.command("keygen")
def keygen(
    directory: Path = typer.Argument(..., help="Where to write partner_key.pem (0600) and partner_key.pub.pem."),
) -> None:
    """Make this partner's P-256 key pair here, on the partner's machine. Send only
    partner_key.pub.pem to the coordinator (consortium create --partner-key NAME=PUB.pem);
    partner_key.pem never leaves this machine."""
    from Crypto.PublicKey import ECC

    from sealfl.clients.kit import PARTNER_KEY_FILE, PARTNER_PUB_FILE
    from sealfl.common.fsutil import atomic_write

    priv, pub = directory / PARTNER_KEY_FILE, directory / PARTNER_PUB_FILE
    if priv.exists() or pub.exists():
        fail(f"{directory} already holds a partner key ({priv.name}); keep it, or choose another directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        key = ECC.generate(curve="P-256")
        atomic_write(priv, key.export_key(format="PEM").encode(), 0o600)
        atomic_write(pub, key.public_key().export_key(format="PEM").encode(), 0o644)
    except OSError as exc:
        fail(f"cannot write the key into {directory}: {exc.strerror or exc}; choose a directory you can write")
    console.print(f"partner key written: {priv} (private, 0600: it never leaves this machine); send {pub} to the "
                  "coordinator (consortium create --partner-key NAME=" + pub.name + ")", markup=False, highlight=False)


def _open(kit: Path, key: Path | None):
    """Load the kit with the partner's key and unwrap its SuperNode key into the kit."""
    from sealfl.clients.kit import load_kit, unwrap_supernode_key

    k = load_kit(str(kit.resolve()), str(key.resolve()) if key else None)
    unwrap_supernode_key(kit, k.signing_key)
    return k


def _data_config(task, data: Path | None, partner: str) -> dict:
    """The task's training settings with ``--data``; without it, only a partner the task has
    bundled demo data for may go on (a partner with its own key brings its own data)."""
    from sealfl.clients.app import check_bundled_partner
    from sealfl.clients.errors import DataError

    if data is None:
        try:
            check_bundled_partner(task, partner)
        except DataError as exc:
            fail(f"{exc} (heart: a CSV with heart_disease_uci.csv's columns; causal-lm: a directory of text files; "
                 "docs/partner.md)")
    conf = dict(task.train_defaults())
    if data is not None:
        conf["data-path"] = str(data.resolve())
    return conf


@app.command("check")
def check(
    kit: Path = typer.Argument(..., help="The partner's startup kit directory (consortium/partners/<name>)."),
    key: Optional[Path] = KEY_OPTION,
    data: Optional[Path] = DATA_OPTION,
) -> None:
    """Unwrap the kit's HE secret with the partner key, round-trip a test ciphertext, and
    load the partner's data (its own with --data), showing each phase as it starts (plain
    lines on stderr off a terminal). Nothing leaves this machine."""
    import time

    import numpy as np

    from sealfl.clients.plugins import get_task

    t0 = time.perf_counter()
    interactive = err.is_terminal

    def phase(name: str) -> None:  # each phase as it starts: a spinner on a terminal, a plain line in a log
        if interactive:
            status.update(f"{name}…")
        else:
            err.print(f"[{time.perf_counter() - t0:6.1f} s] {name}", markup=False, highlight=False)

    try:
        with err.status("partner check…") as status:
            phase("open the kit and unwrap the HE secret with the partner key")
            k = _open(kit, key)
            from sealfl.platform.services import check_kit_files
            from sealfl.platform.startup_kits import CA_FILE, SUPERNODE_KEY_FILE

            check_kit_files(kit, [CA_FILE, SUPERNODE_KEY_FILE], "partner")  # what 'partner start' needs too
            phase("round-trip a test ciphertext")
            probe = np.array([1.25, -2.5, 3.0])
            err_max = float(np.max(np.abs(k.codec.decrypt(k.codec.encrypt(probe)) - probe)))
            phase(f"load the task ({k.task}) and the partner's data")
            task = get_task(k.task)
            loaded = task.load_data(k.partner, _data_config(task, data, k.partner))
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    console.print(f"partner {k.partner} of consortium {k.consortium} (task {task.name}): HE secret "
                  f"unwrapped (context {k.codec.context_id.hex()[:16]}…, round-trip error {err_max:.1e}); "
                  f"data{' ' + str(data) if data else ' (bundled)'}: {task.n_train(loaded)} training examples",
                  markup=False, highlight=False)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warm_up(kit, data: Path | None = None) -> None:
    """Import the partner's handlers and task, load its data and run the task's warm-up once,
    in this long-lived process that answers every message; a bad --data is refused here,
    before joining."""
    import sealfl.clients.app  # noqa: F401 - the handlers the executor calls
    from sealfl.clients.plugins import get_task

    task = get_task(kit.task)
    loaded = task.load_data(kit.partner, _data_config(task, data, kit.partner))
    warm = getattr(task, "warm_up", None)
    if warm is not None:
        warm(loaded)


#: the executor secret's private directory in the temporary directory: PREFIX<pid>-<start>-<random>
PRIVATE_PREFIX = "sealfl-partner-"


def stale_private_dir(name: str, alive) -> bool:
    """Is ``name`` (an entry of the temporary directory) a private directory of a ``partner
    start`` process that is gone? ``alive({"pid", "start"})`` says whether that process runs
    (:func:`sealfl.common.procs.identity_alive`). Names that do not parse are never stale. Pure."""
    if not name.startswith(PRIVATE_PREFIX):
        return False
    parts = name[len(PRIVATE_PREFIX):].split("-")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return False
    return alive({"pid": int(parts[0]), "start": int(parts[1]), "host": None}) is False


def _sweep_private_dirs() -> None:
    """Remove this user's private directories left by ``partner start`` processes killed with -9."""
    import os
    import shutil
    import tempfile

    from sealfl.common.procs import identity_alive

    root = Path(tempfile.gettempdir())
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for e in entries:
        try:
            if (e.is_dir(follow_symlinks=False) and e.stat(follow_symlinks=False).st_uid == os.getuid()
                    and stale_private_dir(e.name, identity_alive)):
                shutil.rmtree(e.path, ignore_errors=True)
        except OSError:
            continue


def _say_reachable(host: str, port: int, superlink: str) -> None:
    """Refuse a --superlink whose host name does not resolve (the SuperNode would retry it
    silently forever); say so when nothing answers there yet (it keeps trying)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=3.0):
            return
    except socket.gaierror as exc:
        fail(f"--superlink {superlink}: the name {host!r} does not resolve ({exc.strerror or exc}); give the "
             "SuperLink's address the coordinator sent (HOST:PORT)")
    except OSError as exc:
        from sealfl.platform.cli.output import say

        say(f"nothing answers at {superlink} yet ({exc.strerror or exc}); the SuperNode keeps trying until the "
            "SuperLink is up (Ctrl-C stops it)")


def _say_task(kind: str, run_id: int | None, seconds: float, error: str | None) -> None:
    """One line per message answered: what, for which run, how long, refused or not."""
    import time

    from sealfl.common.errors import plain_text

    stamp = time.strftime("%H:%M:%S")
    if error is None:
        console.print(f"{stamp} {kind} message of run {run_id} answered in {seconds:.2f} s", markup=False,
                      highlight=False)
    else:
        console.print(f"{stamp} {kind} message of run {run_id} refused: {plain_text(error, 300)}", markup=False,
                      highlight=False)


@app.command("start")
def start(
    kit: Path = typer.Argument(..., help="The partner's startup kit directory (consortium/partners/<name>)."),
    superlink: str = typer.Option(..., "--superlink", help="HOST:PORT of the consortium's SuperLink."),
    port: int = typer.Option(0, min=0, max=65535, help="Local port of this SuperNode's Runtime API on 127.0.0.1, "
                                                       "which this process takes its tasks from (0: a free one; two "
                                                       "SuperNodes on one host need two ports)."),
    log_file: Path = typer.Option(None, "--log", help="SuperNode log (default: supernode-<partner>.log here)."),
    key: Optional[Path] = KEY_OPTION,
    data: Optional[Path] = DATA_OPTION,
    heartbeat: float = typer.Option(30.0, "--heartbeat", min=10, max=1800,
                                    help="Seconds between this SuperNode's heartbeats as declared to the SuperLink "
                                         "(Flower's 30 by default); the SuperLink lists a SuperNode that stopped "
                                         "offline after two intervals, and refuses its key until then."),
) -> None:
    """Run a Flower SuperNode with this kit: TLS against the kit's CA, node authentication with
    the kit's key. This process loads the kit, the task and the data once and answers every
    message itself (the SuperNode runs with --isolation process and starts no ClientApp
    process; sealfl.clients.executor): only the sealfl installed here runs, never code the
    SuperLink sends. Runs until Ctrl-C / SIGTERM (exit 130 / 143, every process it started
    stopped)."""
    from sealfl.platform.supervisor import interruptible

    with interruptible():
        import os
        import shutil
        import tempfile

        from sealfl.clients.app import DATA_KEY, PARTNER_KEY_KEY
        from sealfl.clients.executor import PartnerExecutor
        from sealfl.common.errors import Interrupted
        from sealfl.common.fsutil import atomic_write
        from sealfl.common.procs import identity
        from sealfl.platform import flwr_cli
        from sealfl.platform.cli.output import stopped
        from sealfl.platform.services import parse_hostport, run_service, supernode_command

        try:
            host, sl_port = parse_hostport(superlink)  # before the kit and the data load (seconds)
        except SealflError as exc:
            fail(str(exc))
        _say_reachable(host, sl_port, superlink)
        _sweep_private_dirs()
        me = identity()
        # mode 0700: the executor secret's directory, named by this process (a later start sweeps it after a kill -9)
        private_dir = tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{me['pid']}-{me['start']}-")
        executor = None
        try:
            k = _open(kit, key)  # the kit opens here, before anything connects
            node = {"kit-dir": str(kit.resolve())}
            if key is not None:
                node[PARTNER_KEY_KEY] = str(key.resolve())
            if data is not None:
                node[DATA_KEY] = str(data.resolve())
            _warm_up(k, data)
            secret = os.urandom(32)
            secret_file = Path(private_dir) / "superexec.secret"
            atomic_write(secret_file, secret, 0o600)
            runtime_port = port or _free_port()
            executor = PartnerExecutor(f"127.0.0.1:{runtime_port}", secret, node_config=node,
                                       on_task=_say_task).start()
            cmd = supernode_command(kit, superlink, runtime_port, executor_secret=secret_file, heartbeat_s=heartbeat)
            log_path = log_file or Path(f"supernode-{kit.resolve().name}.log")
            console.print(f"SuperNode of {k.partner} joining {superlink} (TLS, node authentication); "
                          f"log: {log_path}", markup=False, highlight=False)
            code = run_service(cmd, log_path=log_path, env=flwr_cli.flower_env(), name="flower-supernode")
        except Interrupted as exc:
            stopped(Interrupted(exc.signum, f"SuperNode of {kit.resolve().name} stopped by signal"))
        except (SealflError, OSError) as exc:
            fail(error_text(exc))
        finally:
            if executor is not None:
                executor.stop(timeout_s=0)
            shutil.rmtree(private_dir, ignore_errors=True)
    from sealfl.platform.services import supernode_refusal

    try:
        why = supernode_refusal(log_path.read_text(errors="replace"))
    except OSError:
        why = "its log is unreadable"
    fail(f"SuperNode of {k.partner} ({kit}) stopped (flower-supernode exit {code}): {why}; log: {log_path}")
