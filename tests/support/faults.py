"""Faults to inject, and the harness that interrupts real CLI runs.

Client apps: campaigns build their ClientApp in a worker process (and Ray's workers) from
a spec ``"faults:<factory>"`` with ``app_dir`` = this directory; each factory is called
as ``factory(consortium_dir, **kwargs)`` with JSON-serialisable kwargs.

Harness: :func:`start_cli` runs ``python -m sealfl.platform.cli ...`` with a test pause
point (:mod:`sealfl.common.testpoints`); :meth:`CliRun.wait_paused` waits for its event
file, :meth:`CliRun.tree` finds the run's worker and token, :func:`assert_tree_gone`
waits (deadline, no fixed sleep) until no process of the run is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: the directory of the test ClientApps (faults_partner), put on the worker's PYTHONPATH as app_dir
APP_DIR = str(Path(__file__).resolve().parent)
REPO = str(Path(__file__).resolve().parents[2])
DEADLINE_S = 240.0  # generous: a loaded 2-core machine starts Ray in 5-20 s


# -- client apps ---------------------------------------------------------------------------

def make_broken_update_app(consortium_dir: str, bad_partitions: list[int] = (1,), mode: str = "garbage"):
    """The partner app, except that partners ``bad_partitions`` send a broken update:
    ``garbage`` (random bytes of the right length) or ``truncated`` (first half)."""
    from flwr.app import Array
    from flwr.clientapp import ClientApp

    from sealfl.clients import app as capp

    bad = set(bad_partitions)
    app = ClientApp()

    @app.query()
    def q(msg, ctx):
        return capp.handle_query(msg, ctx, consortium_dir)

    @app.train()
    def t(msg, ctx):
        reply = capp.handle_train(msg, ctx, consortium_dir)
        if int(ctx.node_config["partition-id"]) in bad:
            good = reply.content["update"]["update_ct"].numpy()
            if mode == "garbage":
                broken = np.random.default_rng(0).integers(0, 256, len(good), dtype=np.uint8)
            else:
                broken = good[: len(good) // 2].copy()
            reply.content["update"]["update_ct"] = Array(broken)
            # the partner itself sends it: signed with its own key, so the ciphertext checks must catch it
            from sealfl.clients.kit import kit_dir, load_kit

            capp.sign_reply(load_kit(str(kit_dir(consortium_dir, reply.content["partner"]["name"]))), msg,
                            reply.content)
        return reply

    @app.evaluate()
    def e(msg, ctx):
        return capp.handle_evaluate(msg, ctx, consortium_dir)

    return app


# -- waiting without sleeping blindly -----------------------------------------------------------

def wait_until(predicate, what: str, deadline_s: float = DEADLINE_S, proc: subprocess.Popen | None = None):
    """Poll ``predicate`` until it returns a truthy value (returned) or the deadline
    passes (AssertionError naming ``what``). If ``proc`` exits meanwhile, fail at once."""
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")
        time.sleep(0.1)


# -- the process tree of a run -----------------------------------------------------------------

def _stat(pid: int):
    from sealfl.common.procs import read_stat

    return read_stat(pid)


def children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st.ppid == pid and st.state != "Z":
                out.append(st.pid)
    return out


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        pairs = [e.split(b"=", 1) for e in fh.read().split(b"\0") if b"=" in e]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def find_worker(supervisor_pid: int) -> tuple[int, str]:
    """``(worker pid, run token)`` of the run the CLI process ``supervisor_pid`` started."""
    def probe():
        for c in children(supervisor_pid):
            try:
                env = environ(c)
            except OSError:
                continue
            if "SEALFL_RUN_TOKEN" in env:
                return c, env["SEALFL_RUN_TOKEN"]
        return None

    return wait_until(probe, f"the worker process of {supervisor_pid}")


def run_processes(token: str, sid: int) -> list[int]:
    from sealfl.common.procs import run_members

    return run_members(token, sid)


def assert_tree_gone(token: str, sid: int, deadline_s: float = 60.0) -> None:
    """Wait until no live process of the run (session ``sid`` or token) is left."""
    wait_until(lambda: not run_processes(token, sid), f"every process of run {token[:8]} to exit", deadline_s)


def hidden_files(root: Path) -> list[str]:
    """Temporary or hidden files anywhere under ``root`` (what a half-done write leaves)."""
    return sorted(str(p) for p in Path(root).rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp"))


# -- running the CLI ----------------------------------------------------------------------

@dataclass
class CliRun:
    proc: subprocess.Popen
    pause_dir: Path
    stderr_path: Path
    stage: str

    def wait_paused(self) -> dict:
        """Wait for the pause point's event file; returns its JSON."""
        from sealfl.common.testpoints import event_path

        path = Path(event_path(self.stage.partition("@")[0], self.pause_dir))
        wait_until(path.exists, f"pause point {self.stage}", proc=self.proc)
        return json.loads(path.read_text())

    def tree(self) -> tuple[int, str]:
        return find_worker(self.proc.pid)

    def kill(self) -> None:
        """Teardown: SIGKILL the CLI if it still runs (its worker tree follows it)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def finish(self, timeout_s: float = 180.0) -> tuple[int, str]:
        """Wait for the CLI to exit; returns ``(exit code, stderr)``."""
        try:
            rc = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return rc, self.stderr_path.read_text(errors="replace")


def cli_env(pause_at: str | None = None, pause_dir: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SEALFL_", "RAY_"))}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if pause_at:
        env.update(SEALFL_PAUSE_AT=pause_at, SEALFL_PAUSE_DIR=str(pause_dir))
    return env


def start_cli(args: list, pause_at: str, tmp_path: Path) -> CliRun:
    """Start ``sealfl <args>`` pausing at ``pause_at`` (stdout discarded, stderr to a file)."""
    pause_dir = tmp_path / "pause"
    pause_dir.mkdir(exist_ok=True)
    stderr_path = tmp_path / "cli.stderr"
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                env=cli_env(pause_at, pause_dir))
    return CliRun(proc, pause_dir, stderr_path, pause_at)


def run_cli(args: list, timeout_s: float = 600.0) -> subprocess.CompletedProcess:
    """Run ``sealfl <args>`` to its end (no pause point)."""
    return subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout_s, env=cli_env())
