"""Processes of one run, read from Linux ``/proc`` (proc(5)): who belongs to a run, is
an owner still alive, which TCP ports do they listen on, and stopping them all.

A run (one campaign or one federated evaluation) is a worker process started in a new
session (``setsid``) with a unique token in its environment. Its descendants -- Ray's
GCS, raylet, agents and workers, the reaper -- stay in that session and inherit the
token. Both marks are needed: a process can leave the session (``setsid``) and a process
that rewrites its title (Ray's agents, ``setproctitle``) overwrites the environment
block ``/proc/PID/environ`` shows, so neither mark alone finds every process.

Process identity is ``(pid, start time)`` (field 22 of ``/proc/PID/stat``, clock ticks
since boot), so a recycled pid is never mistaken for the original owner.

``python -m sealfl.common.procs reap FD TOKEN SID RUN_DIR SUP_PID SUP_START`` is the
reaper: it blocks reading pipe ``FD`` whose write end only the worker holds; when the
worker dies -- even by SIGKILL, even when its supervisor was SIGKILLed and the worker
followed through ``PR_SET_PDEATHSIG`` -- the read returns EOF and the reaper kills the
rest of the run (Ray's agents otherwise outlive a killed raylet by about a minute,
measured here). If the supervisor is gone too, it removes the run directory, which
nobody else would.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sealfl.common.errors import ProcessInfoError

ENV_TOKEN = "SEALFL_RUN_TOKEN"

__all__ = ["ENV_TOKEN", "ProcStat", "parse_stat", "read_stat", "identity", "identity_alive", "run_members",
           "kill_run", "set_parent_death_signal", "follow_parent_preexec", "parse_proc_net", "listening_sockets", "non_loopback",
           "memory_status", "reset_peak_rss"]


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` sealfl uses (proc(5) numbering in brackets)."""

    pid: int        # (1)
    comm: str       # (2) executable name, may contain spaces and parentheses
    state: str      # (3) R, S, D, Z (zombie), T, ...
    ppid: int       # (4)
    pgid: int       # (5)
    sid: int        # (6)
    start: int      # (22) start time, clock ticks after boot


def parse_stat(text: str) -> ProcStat:
    """Parse one ``/proc/PID/stat`` line. ``comm`` is everything between the first ``(``
    and the LAST ``)`` (a process may name itself ``a) b``). Raises ValueError."""
    open_, close = text.index("("), text.rindex(")")
    rest = text[close + 2:].split()
    if len(rest) < 20:
        raise ProcessInfoError(f"/proc stat line has {len(rest) + 2} fields, expected at least 22")
    return ProcStat(pid=int(text[:open_]), comm=text[open_ + 1:close], state=rest[0], ppid=int(rest[1]),
                    pgid=int(rest[2]), sid=int(rest[3]), start=int(rest[19]))


def read_stat(pid: int) -> ProcStat | None:
    """``/proc/PID/stat`` parsed, or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return parse_stat(fh.read())
    except (OSError, ValueError):
        return None


def identity(pid: int | None = None) -> dict:
    """``{"pid", "start", "host"}`` of a process (default: this one), for status files."""
    pid = os.getpid() if pid is None else pid
    st = read_stat(pid)
    return {"pid": pid, "start": st.start if st else None, "host": socket.gethostname()}


def identity_alive(ident: dict) -> bool | None:
    """Is the process ``ident`` (from :func:`identity`) still running? ``None`` when this
    machine cannot tell (recorded on another host). A zombie counts as dead; a pid whose
    start time differs is another process (the pid was recycled)."""
    pid, start, host = ident.get("pid"), ident.get("start"), ident.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    if host is not None and host != socket.gethostname():
        return None
    st = read_stat(pid)
    if st is None or st.state in ("Z", "X"):
        return False
    return not (isinstance(start, int) and st.start != start)


def _has_token(pid: int, token: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return token in fh.read().split(b"\0")
    except OSError:
        return False


def run_members(token: str, sid: int | None, exclude: tuple[int, ...] = ()) -> list[int]:
    """Live (non-zombie) processes of a run: in session ``sid`` (or its process group)
    or carrying ``SEALFL_RUN_TOKEN=token`` in their environment. ``exclude``: pids to skip."""
    mark = f"{ENV_TOKEN}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        st = read_stat(int(name))
        if st is None or st.state in ("Z", "X"):
            continue
        if (sid is not None and sid in (st.sid, st.pgid)) or _has_token(st.pid, mark):
            found.append(st.pid)
    return found


def kill_run(token: str, sid: int | None, deadline_s: float = 30.0, exclude: tuple[int, ...] = ()) -> list[int]:
    """SIGKILL every process of the run until none is left or ``deadline_s`` passes
    (a process may fork while we kill, so scan again). Returns the survivors' pids.

    Killed children of the caller stay zombies (which count as gone) until the caller
    waits for them; this function never reaps, so a ``Popen`` keeps its exit status."""
    exclude = (*exclude, os.getpid())
    end = time.monotonic() + deadline_s
    while True:
        left = run_members(token, sid, exclude)
        if not left or time.monotonic() > end:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)  # let the kernel finish the kills before the next scan


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """``prctl(PR_SET_PDEATHSIG, sig)``: the kernel sends ``sig`` to this process when the
    thread that created it exits (prctl(2)). Linux only; raises OSError on failure."""
    if ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1 (linux/prctl.h)
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")


def follow_parent_preexec(sig: int = signal.SIGKILL):
    """A ``subprocess.Popen(preexec_fn=...)`` that gives the child ``sig`` when the calling
    thread's process dies, even by SIGKILL (``PR_SET_PDEATHSIG``); a parent already gone
    before the prctl took effect ends the child at once. ``prctl`` is looked up here, in the
    parent, so the forked child calls it without loading anything (no lock another thread
    may have held at the fork)."""
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def follow() -> None:
        if prctl(1, int(sig), 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(1)
    return follow


# -- listening sockets ------------------------------------------------------------------

_LISTEN = "0A"  # TCP_LISTEN in include/net/tcp_states.h


def memory_status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` (resident now) and ``VmHWM`` (resident peak) of a process in bytes, from
    ``/proc/PID/status`` (proc(5)); {} if the process is gone or the fields are missing."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM") and value.strip().endswith("kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Reset a process's resident peak (``VmHWM``) to its current RSS by writing ``5`` to
    ``/proc/PID/clear_refs`` (proc(5), Linux >= 4.0), so a later ``VmHWM`` is the peak
    since now, not a start-up peak. Returns False where that is not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def parse_proc_net(text: str, ipv6: bool) -> list[tuple[str, int, str]]:
    """Listening sockets of a ``/proc/net/tcp`` or ``tcp6`` table: ``[(ip, port, inode)]``.

    Addresses are hex in host byte order per 32-bit word (little-endian here), e.g.
    ``0100007F:1F90`` is 127.0.0.1:8080. Raises ValueError on a malformed line."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or f[3] != _LISTEN:
            continue
        hexip, hexport = f[1].split(":")
        raw = bytes.fromhex(hexip)
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each word is little-endian
        ip = socket.inet_ntop(socket.AF_INET6 if ipv6 else socket.AF_INET, raw)
        out.append((ip, int(hexport, 16), f[9]))
    return out


def listening_sockets(pids: list[int]) -> dict[int, list[tuple[str, int]]]:
    """TCP sockets in LISTEN state owned by ``pids`` (via ``/proc/PID/fd`` socket inodes)."""
    by_inode: dict[str, tuple[str, int]] = {}
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(path) as fh:
                by_inode.update({ino: (ip, port) for ip, port, ino in parse_proc_net(fh.read(), v6)})
        except OSError:
            continue
    out: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in by_inode:
                out.setdefault(pid, []).append(by_inode[target[8:-1]])
    return out


def non_loopback(sockets: dict[int, list[tuple[str, int]]]) -> list[tuple[int, str, int]]:
    """The ``(pid, ip, port)`` entries that do not listen on a loopback address only
    (127.0.0.0/8, ::1, or IPv4-mapped ``::ffff:127.x.y.z``); ``0.0.0.0`` and ``::`` are
    every interface."""
    bad = []
    for pid, socks in sockets.items():
        for ip, port in socks:
            v4 = ip[7:] if ip.startswith("::ffff:") and "." in ip else ip
            if not (v4.startswith("127.") or ip == "::1"):
                bad.append((pid, ip, port))
    return bad


# -- the reaper ---------------------------------------------------------------------------

def _reap_main(argv: list[str]) -> int:
    fd, token, sid, run_dir = int(argv[0]), argv[1], int(argv[2]), argv[3]
    supervisor = {"pid": int(argv[4]), "start": int(argv[5])}
    while True:
        try:
            if not os.read(fd, 1):
                break  # EOF: the worker is gone
        except InterruptedError:
            continue
        except OSError:
            break
    left = kill_run(token, sid, deadline_s=30.0)
    if not left and identity_alive(supervisor) is False:
        # nobody will read the run's result: remove its directory (job, Ray's session files)
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "reap":
        sys.exit(_reap_main(sys.argv[2:]))
    sys.stderr.write("usage: python -m sealfl.common.procs reap FD TOKEN SID RUN_DIR SUPERVISOR_PID SUPERVISOR_START\n")
    sys.exit(2)
