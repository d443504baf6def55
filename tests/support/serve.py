"""``sealfl device serve`` run as a child process on a free loopback port, started and
stopped by its pid (used by the serve tests of both APIs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

DEADLINE_S = 120.0


def _wait(predicate, what: str, deadline_s: float = DEADLINE_S, proc: subprocess.Popen | None = None):
    """Poll ``predicate`` until it returns a truthy value (a generous deadline, not a delay)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode} while waiting for {what}: {_stderr(proc)}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _stderr(proc) -> str:
    return proc.log_path.read_text()


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (Linux /proc)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as fh:
                    kids = [int(c) for c in fh.read().split()]
                out.update(kids)
                todo += kids
        except OSError:
            continue
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class Server:
    """``sealfl device serve`` in a child process on a free port (``--port 0``)."""

    def __init__(self, root: Path, tmp: Path, release: Path | None = None, env: dict | None = None,
                 args: tuple = ()) -> None:
        self.port_file = tmp / "port"
        self.log = tmp / "serve.log"
        self.port_file.unlink(missing_ok=True)  # a port file from an earlier server on this state is stale
        cmd = [sys.executable, "-m", "sealfl.platform.cli", "device", "serve", "--trust", str(root / "trust"),
               "--release", str(release or root / "release"), "--state", str(tmp / "state"), "--port", "0",
               "--port-file", str(self.port_file), "--tee", "sim", *args]
        self._fh = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=self._fh, env={**os.environ, **(env or {})})
        self.proc.log_path = self.log
        self.port = int(_wait(lambda: self.port_file.exists() and self.port_file.read_text().strip(), "the port file",
                              proc=self.proc))
        self.url = f"http://127.0.0.1:{self.port}"
        self._client = None

    @property
    def client(self):
        """The official ``openai`` client on this server's ``/v1``."""
        import openai

        if self._client is None:
            self._client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                         timeout=DEADLINE_S)
        return self._client

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=DEADLINE_S)

    def wait_ready(self) -> dict:
        return _wait(lambda: (r := self.health()).status_code == 200 and r.json(), "/health 200", proc=self.proc)

    def metric(self, name: str, labels: dict | None = None) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=DEADLINE_S).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                    return s.value
        raise KeyError(name)

    def stop(self, sig=signal.SIGTERM) -> tuple[int, str, set[int]]:
        """Signal the server by its pid; returns (exit code, log, pids of its former children)."""
        kids = _children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:  # never leave it running: the failure is the test's
            for pid in [self.proc.pid, *kids]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(timeout=DEADLINE_S)
            self._fh.close()
            raise AssertionError(f"the server did not exit within {DEADLINE_S} s of signal {int(sig)}; "
                                 f"killed it: {self.log.read_text()[-2000:]}") from None
        self._fh.close()
        return code, self.log.read_text(), kids

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=DEADLINE_S)
        self._fh.close()
