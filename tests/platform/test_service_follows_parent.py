"""A service that ``sealfl superlink start`` / ``partner start`` runs (``run_service``) dies
with its parent, also when the parent is SIGKILLed (issue 19, item 3: kill -9 leaves no
process behind). Real processes: a parent running ``run_service`` on a sleeping child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_PARENT = """
import os, sys
from pathlib import Path
from sealfl.platform.services import run_service
run_service([sys.executable, "-c", "import os, time; open(os.environ['PIDFILE'], 'w').write(str(os.getpid())); time.sleep(600)"],
            log_path=Path(sys.argv[1]), env=dict(os.environ))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_service_dies_when_its_parent_is_killed_with_sigkill(tmp_path):
    pidfile = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path / "service.log")],
                              env={**os.environ, "PIDFILE": str(pidfile)})
    child = None
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            assert parent.poll() is None, (tmp_path / "service.log").read_text()
            time.sleep(0.1)
        child = int(pidfile.read_text())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the service outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
