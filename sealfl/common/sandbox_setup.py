"""The sandboxed runtime's private directories and option checks
(:mod:`sealfl.common.sandbox`).

Each runtime's working directory and ``HOME`` are fresh mode-0700 directories in the temp
directory, named ``sealfl-sandbox-[home-]<parent pid>-<suffix>`` so that the first runtime
a later process starts can remove those of a parent that died without closing them
(SIGKILL, OOM killer, power loss of a container's tmpfs aside).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import stat
import tempfile

from .errors import RuntimeSandboxError

__all__ = ["MIN_MEMORY_LIMIT_BYTES", "check_options", "private_dir", "sweep_stale_dirs"]

log = logging.getLogger(__name__)

#: the smallest non-zero cap accepted (below it the child could not even start Python, and
#: the error would say nothing useful)
MIN_MEMORY_LIMIT_BYTES = 16 * 1024**2

#: the private directories' names: sealfl-sandbox-[home-]<parent pid>-<mkdtemp suffix>
_DIR_PREFIX = "sealfl-sandbox-"
_DIR_RE = re.compile(r"^sealfl-sandbox-(?:home-)?([0-9]{1,10})-[A-Za-z0-9_]{1,64}$")
_swept = False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process (or not a pid we can ask about): leave it
    return True


def sweep_stale_dirs(tmp: str | None = None) -> list[str]:
    """Remove the private directories (see the module doc) that runtimes of a parent
    process that is gone left behind in ``tmp`` (default: :func:`tempfile.gettempdir`):
    only directories (not symlinks) named like ours, owned by this user, whose parent pid
    is not a live process. Returns the paths removed. Never raises for a directory it
    cannot read or remove (it logs and goes on)."""
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
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    if removed:
        log.info("removed %d sandbox directories of runtimes whose process is gone", len(removed))
    return removed


def private_dir(kind: str = "") -> str:
    """A fresh, empty, mode-0700 directory named after this process (for the sweep)."""
    global _swept
    if not _swept:
        _swept = True
        sweep_stale_dirs()
    return tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{kind}{os.getpid()}-")


def check_options(memory_limit_bytes, timeout_s, start_timeout_s, intra_op_threads) -> None:
    """Refuse constructor options of :class:`sealfl.common.sandbox.SandboxedRuntime` that
    cannot work, with a RuntimeSandboxError that names the option."""
    m = memory_limit_bytes
    if isinstance(m, bool) or not isinstance(m, int) or (m != 0 and not MIN_MEMORY_LIMIT_BYTES <= m < 1 << 50):
        raise RuntimeSandboxError(f"memory_limit_bytes must be 0 (no limit) or a whole number of bytes of at least "
                                  f"{MIN_MEMORY_LIMIT_BYTES} (16 MiB), got {m!r}")
    for label, t in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise RuntimeSandboxError(f"{label} must be a positive number of seconds, got {t!r}")
    n = intra_op_threads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
        raise RuntimeSandboxError(f"intra_op_threads must be a whole number in [1, 1024], got {n!r}")

