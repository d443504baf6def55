"""The supervisor: long commands run Ray and Flower in a worker process tree that can be
stopped at any moment, and are the only writer of their state once it is stopped.

Why (issue 10). Flower's simulation runtime runs the ServerApp and its backend worker
threads in the process that called ``run_simulation``. A SIGINT handler in that process
that called ``ray.shutdown()`` raced those threads: a backend thread (Flower's
``vce_api.worker`` in a ThreadPoolExecutor, in ``RayBackend.process_message`` ->
``ray.get``) saw ``ActorDiedError``, looped, called into Ray again, and Ray's C++ core
worker -- already destroyed by ``ray.shutdown()`` -- logged "The core worker has already
been shutdown ... The process will exit" and called ``QuickExit()`` (``_exit(1)``) before
the handler reached ``os._exit(130)``: exit 1 in 2 of 6 runs here. A SIGINT during
``ray.init`` (before that handler existed) raised KeyboardInterrupt inside Ray's start-up
and left Ray's agents running and no ``status.json`` at all.

How. This process never imports Ray or Flower. :func:`run_worker` starts
``python -m sealfl.platform.worker JOB`` in a new session (so a terminal's Ctrl-C reaches
only the supervisor), with a unique ``SEALFL_RUN_TOKEN`` every descendant inherits,
stderr to a log file; the worker sets ``PR_SET_PDEATHSIG`` (it dies with the
supervisor) and starts a reaper (:mod:`sealfl.common.procs`) that kills the rest of the
tree when the worker dies. Inside :func:`interruptible` the SIGINT/SIGTERM handler only
records the signal. The wait loop then SIGKILLs the whole tree (session, process group,
token), waits until every process is gone, and only then raises :class:`Interrupted`
-- callers record ``interrupted`` and clean temporaries with no concurrent writer left.
SIGKILL at once, no grace period: every file the tree writes is written atomically and
in commit order, so there is nothing to flush, and a grace period would give Ray's and
Flower's own signal handling (the race above) the time to run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import sealfl
from sealfl.common.errors import Interrupted
from sealfl.common.procs import ENV_TOKEN, kill_run
from sealfl.common.testpoints import check_environment
from sealfl.platform.errors import WorkerError

log = logging.getLogger(__name__)

ENV_SUPERVISOR = "SEALFL_SUPERVISOR_PID"
SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []

__all__ = ["interruptible", "requested", "check", "run_worker", "Interrupted"]


def _on_signal(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
    # Only record: the main thread acts on it at its next check, with no Ray, Flower or
    # half-done write of its own in the way.
    if not _received:
        _received.append(signum)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within this block (main thread), SIGINT and SIGTERM only set a flag that
    :func:`check` and :func:`run_worker` act on. Off the main thread: no change.

    Raises TestpointError on entry if the test pause-point variables are malformed."""
    check_environment()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def requested() -> int | None:
    """The signal received inside :func:`interruptible`, or None."""
    return _received[0] if _received else None


def check() -> None:
    """Raise :class:`Interrupted` if a signal arrived (call between steps of a long command)."""
    if _received:
        raise Interrupted(_received[0])


def _worker_env(env: dict, app_dir: str | None, token: str) -> dict:
    paths = [p for p in (app_dir, str(Path(sealfl.__file__).resolve().parents[1])) if p]
    old = env.get("PYTHONPATH")
    return {**env, ENV_TOKEN: token, ENV_SUPERVISOR: str(os.getpid()),
            "PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}


def _stop_tree(proc: subprocess.Popen, token: str) -> list[int]:
    # kill before wait: until it is reaped the worker's pid (= the run's session id)
    # cannot be recycled, so no stranger's session is mistaken for the run
    survivors = kill_run(token, proc.pid, deadline_s=30.0)
    proc.wait()
    if survivors:
        log.error("processes %s of the worker tree survived SIGKILL for 30 s", survivors)
    return survivors


def run_worker(job: dict, *, env: dict, log_path: str | os.PathLike, app_dir: str | None = None,
               on_tick: Callable[[], None] | None = None, tick_s: float = 0.25) -> dict:
    """Run ``job`` in a worker process tree and return the worker's result.

    Args:
        job: JSON-serialisable job for :mod:`sealfl.platform.worker` (``"result"`` and
            ``"run_dir"`` are filled in here).
        env: the worker's base environment (see :func:`sealfl.platform.simulate.ray_environment`).
        log_path: the worker's stderr and stdout (created or truncated).
        app_dir: directory put first on ``PYTHONPATH`` of the worker and Ray's workers.
        on_tick: called about every ``tick_s`` seconds while the worker runs, and once
            after it ended (progress display; exceptions are logged, not raised).

    Returns:
        The worker's result dict (``{"ok": True, ...}`` or ``{"ok": False, "error", "type"}``).

    Raises:
        Interrupted: a signal arrived (inside :func:`interruptible`); the tree is gone.
        WorkerError: the worker died without a result (the message names the log).
        KeyboardInterrupt: outside :func:`interruptible`; the tree is gone as well.
    """
    check()
    check_environment()
    run_dir = Path(tempfile.mkdtemp(prefix="sealfl-run-"))
    token = os.urandom(16).hex()
    job = {**job, "result": str(run_dir / "result.json"), "run_dir": str(run_dir)}
    (run_dir / "job.json").write_text(json.dumps(job))
    log_file = open(log_path, "wb")
    proc = None
    keep_run_dir = False
    try:
        proc = subprocess.Popen([sys.executable, "-m", "sealfl.platform.worker", str(run_dir / "job.json")],
                                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, close_fds=True,
                                start_new_session=True, env=_worker_env(env, app_dir, token))
        pidfd = os.pidfd_open(proc.pid)
        try:
            while True:
                ready, _, _ = select.select([pidfd], [], [], tick_s)
                if ready:
                    break
                if _received:
                    _stop_tree(proc, token)
                    raise Interrupted(_received[0])
                _tick(on_tick)
        finally:
            os.close(pidfd)
        _stop_tree(proc, token)  # the reaper and anything Ray left behind; then reap the worker
        _tick(on_tick)
        try:
            result = json.loads((run_dir / "result.json").read_text())
        except (OSError, ValueError) as exc:
            keep_run_dir = True
            how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited {proc.returncode}"
            raise WorkerError(f"the worker process {how} without a result; see {log_path} (its job and Ray's "
                              f"session files are kept in {run_dir} for that; remove it when done)") from exc
        return result  # a failure's story is in the log and the result; Ray's session files go
    finally:
        if proc is not None and proc.poll() is None:  # KeyboardInterrupt, or any error above
            _stop_tree(proc, token)
        log_file.close()
        if not keep_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def _tick(on_tick: Callable[[], None] | None) -> None:
    if on_tick is None:
        return
    try:
        on_tick()
    except Exception:  # a progress display must never stop the run
        log.exception("progress callback failed")
