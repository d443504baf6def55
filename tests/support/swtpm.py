"""A real software TPM 2.0 for tests: ``swtpm`` in socket mode on free loopback ports.

Started per test that asks for it (a fresh TPM state in ``tmp_path``), reached by the ``tpm``
backend through ``SEALFL_TPM_TCTI``, stopped by its pid. Never skipped: if swtpm or
tpm2-tools are missing, the fixture fails and says how to install them
(``scripts/install-tpm.sh``, run by ``make test``'s venv step).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sealfl.enclave.tee.tpm import TCTI_ENV

_DEADLINE_S = 30.0


def _free_port_pair() -> int:
    """A free loopback port P with P+1 free too (the swtpm TCTI takes the control port as P+1)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError("swtpm: no pair of free loopback ports")


def _wait(predicate, what: str) -> None:
    end = time.monotonic() + _DEADLINE_S
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"swtpm: {what} within {_DEADLINE_S} s")
        time.sleep(0.02)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _exited(pid: int) -> bool:
    """True once ``pid`` has exited. swtpm daemonises, so its parent is PID 1, which may reap
    it seconds later: a zombie (state ``Z`` in /proc) has exited too."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


class SwTPM:
    """A running swtpm: ``tcti`` string, ``pid``, ``state`` directory."""

    def __init__(self, state: Path) -> None:
        missing = [t for t in ("swtpm", "tpm2_quote") if shutil.which(t) is None]
        if missing:
            raise AssertionError(f"{missing} not installed: run scripts/install-tpm.sh (make test does)")
        self.state = state.resolve()
        self.state.mkdir(parents=True, exist_ok=True)
        self.port = _free_port_pair()
        self.ctrl = self.port + 1
        self.start()
        self.tcti = f"swtpm:host=127.0.0.1,port={self.port}"

    def start(self) -> None:
        """Start swtpm on this TPM state and these ports (a TPM power-on: PCRs reset)."""
        pidfile = self.state / "swtpm.pid"
        pidfile.unlink(missing_ok=True)
        subprocess.run(
            ["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={self.state}",
             "--server", f"type=tcp,bindaddr=127.0.0.1,port={self.port}",
             "--ctrl", f"type=tcp,bindaddr=127.0.0.1,port={self.ctrl}",
             "--flags", "not-need-init,startup-clear", "--daemon", "--pid", f"file={pidfile}",
             "--log", f"file={self.state / 'swtpm.log'}"],
            check=True, timeout=_DEADLINE_S)
        _wait(lambda: pidfile.exists() and pidfile.read_text().strip().isdigit(), "no pid file")
        self.pid = int(pidfile.read_text().strip())
        _wait(lambda: _listening(self.port), f"port {self.port} not listening")

    def restart(self) -> None:
        """Power-cycle the TPM (stop, start on the same state: e.g. after ``tpm2_pcrallocate``)."""
        self.stop()
        self.start()

    def tools(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a tpm2-tools command against this TPM, as other software on the machine would."""
        return subprocess.run(list(args), env={**os.environ, "TPM2TOOLS_TCTI": self.tcti}, capture_output=True,
                              text=True, timeout=_DEADLINE_S, check=check)

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return

        _wait(lambda: _exited(self.pid), f"pid {self.pid} did not exit")


@pytest.fixture
def swtpm(tmp_path: Path, monkeypatch) -> Iterator[SwTPM]:
    """A fresh swtpm for this test; ``SEALFL_TPM_TCTI`` points the ``tpm`` backend at it."""
    tpm = SwTPM(tmp_path / "swtpm")
    monkeypatch.setenv(TCTI_ENV, tpm.tcti)
    try:
        yield tpm
    finally:
        tpm.stop()


@pytest.fixture(params=["sim", "tpm"])
def backend(request) -> str:
    """Each TEE backend in turn; for ``tpm`` a fresh swtpm is running."""
    if request.param == "tpm":
        request.getfixturevalue("swtpm")
    return request.param
