"""The sandboxed runtime's private directories and option checks
(:mod:`sealfl.enclave.sandbox.runtime`).

Each runtime's working directory and ``HOME`` are fresh mode-0700 directories in the temp
directory, named ``sealfl-sandbox-[home-]<parent pid>-<suffix>`` and held with an exclusive
``flock(2)`` by the parent for as long as the runtime lives, so that the first runtime a
later process starts can remove those of a parent that died without closing them (SIGKILL,
the OOM killer). The lock, not the pid, decides: the kernel drops it when its holder dies,
and it is seen across PID namespaces (containers sharing ``/tmp``), where a pid is not.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
import time

from sealfl.common.errors import short_repr
from sealfl.common.procs import read_stat
from sealfl.common.seconds import MAX_SECONDS, is_seconds
from sealfl.enclave.errors import RuntimeSandboxError

__all__ = ["MAX_TIMEOUT_S", "MIN_MEMORY_LIMIT_BYTES", "check_options", "check_timeout", "private_dir",
           "remove_private_dir", "sweep_stale_dirs"]

log = logging.getLogger(__name__)

#: the smallest non-zero cap accepted (below it the child could not even start Python, and
#: the error would say nothing useful)
MIN_MEMORY_LIMIT_BYTES = 16 * 1024**2

#: the private directories' names: sealfl-sandbox-[home-]<parent pid>-<mkdtemp suffix>
_DIR_PREFIX = "sealfl-sandbox-"
_DIR_RE = re.compile(r"^sealfl-sandbox-(?:home-)?([0-9]{1,10})-[A-Za-z0-9_]{1,64}$")
_swept = False
#: directories younger than this are never swept (one being created, not yet locked)
MIN_AGE_S = 10.0
#: path -> the descriptor holding its flock
_held: dict[str, int] = {}


def _pid_alive(pid: int) -> bool:
    """A live, non-zombie process has this pid here (:func:`sealfl.common.procs.read_stat`)."""
    st = read_stat(pid)
    return st is not None and st.state not in ("Z", "X")


def sweep_stale_dirs(tmp: str | None = None) -> list[str]:
    """Remove the private directories (see the module doc) that runtimes of a parent
    process that is gone left behind in ``tmp`` (default: :func:`tempfile.gettempdir`):
    only directories (not symlinks) named like ours, owned by this user, older than
    :data:`MIN_AGE_S`, whose parent pid is not a live process here and whose ``flock`` no
    process holds. Returns the paths removed. Never raises for a directory it cannot read
    or remove (it logs and goes on)."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(tmp)
    except OSError as exc:
        log.debug("cannot list %s for stale sandbox directories: %s", tmp, exc)
        return removed
    for name in names:
        m = _DIR_RE.match(name)
        if not m or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or time.time() - st.st_mtime < MIN_AGE_S:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live runtime, perhaps in another PID namespace
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        if not os.path.lexists(path):
            removed.append(path)
    if removed:
        log.info("removed %d sandbox directories of runtimes whose process is gone", len(removed))
    return removed


def private_dir(kind: str = "") -> str:
    """A fresh, empty, mode-0700 directory named after this process and locked by it (see
    the module doc; unlocked where the file system has no ``flock``) until
    :func:`remove_private_dir`. Raises OSError if it cannot be made (nothing is left)."""
    global _swept
    if not _swept:
        _swept = True
        sweep_stale_dirs()
    path = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{kind}{os.getpid()}-")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:  # a file system without flock (ENOLCK, EOPNOTSUPP): go on unlocked;
        # the sweep then has only the pid (and the age) to go by
        os.close(fd)
        log.debug("cannot lock %s (%s); the sweep will judge it by its pid", path, exc)
        return path
    _held[path] = fd
    return path


def remove_private_dir(path: str) -> None:
    """Remove a directory of :func:`private_dir` and drop its lock. Idempotent."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def check_options(memory_limit_bytes, timeout_s, start_timeout_s, intra_op_threads) -> None:
    """Refuse constructor options of :class:`sealfl.enclave.sandbox.runtime.SandboxedRuntime` that
    cannot work, with a RuntimeSandboxError that names the option."""
    m = memory_limit_bytes
    if isinstance(m, bool) or not isinstance(m, int) or (m != 0 and not MIN_MEMORY_LIMIT_BYTES <= m < 1 << 50):
        raise RuntimeSandboxError(f"memory_limit_bytes must be 0 (no limit) or a whole number of bytes in "
                                  f"[{MIN_MEMORY_LIMIT_BYTES} (16 MiB), 2^50), got {short_repr(m)}")
    check_timeout(timeout_s, "timeout_s")
    check_timeout(start_timeout_s, "start_timeout_s")
    n = intra_op_threads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
        raise RuntimeSandboxError(f"intra_op_threads must be a whole number in [1, 1024], got {n!r}")


#: the longest wait accepted (seconds; about 11.6 days): longer ones overflow time_t deadlines
MAX_TIMEOUT_S = MAX_SECONDS


def check_timeout(t, label: str = "timeout") -> float:
    """``t`` as float seconds if it is a real number in (0, :data:`MAX_TIMEOUT_S`], else
    RuntimeSandboxError naming ``label``."""
    if not is_seconds(t, hi=MAX_TIMEOUT_S):
        raise RuntimeSandboxError(f"{label} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {short_repr(t)}")
    return float(t)
