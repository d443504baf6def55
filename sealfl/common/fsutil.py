"""Small file-system helpers: the one atomic write (with an explicit mode and a hook before
the rename), private directories.

Every file sealfl writes for keeps (keys, TEE state, consortium files, campaign status and
checkpoints, trust anchors, policies) goes through :func:`atomic_write`, so a crash or a
``kill -9`` leaves either the old file or the new one, never a part of either."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "read_capped", "ensure_private_dir", "check_private_file"]


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o600, *,
                 before_rename: Callable[[], None] | None = None) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file ``.<name>.<random>.tmp`` in the
    same directory, created with ``mode`` (default 0600) before any byte is written,
    written, fsynced, renamed over ``path``; then the directory is fsynced.

    Args:
        path: the file to write or replace.
        data: its new content.
        mode: permission bits of the new file.
        before_rename: called after the temporary file is complete and before the rename
            (a test pause point, e.g. ``lambda: testpoint("checkpoint", round)``); if it
            raises, the temporary file is removed and ``path`` is unchanged.

    Raises:
        OSError: the directory is missing or not writable.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_capped(path: str | os.PathLike, cap: int, *, regular_only: bool = True) -> bytes:
    """At most ``cap + 1`` bytes of the file ``path``: a caller refuses ``len(data) > cap``
    without reading the rest of a hostile or damaged file.

    With ``regular_only`` (the default) ``path`` must be a regular file (symbolic links to
    one are followed): a FIFO, a device or a socket is refused at once -- opened without
    blocking and checked with ``fstat``, where a plain ``open`` of a FIFO waits for a writer
    forever. ``regular_only=False`` reads a pipe too (``--input <(...)``).

    Raises:
        OSError: the file cannot be opened or read; ``IsADirectoryError`` for a directory,
            ``OSError(EINVAL)`` ("not a regular file ...") for a FIFO, device or socket.
    """
    if not regular_only:
        with open(path, "rb") as fh:
            return fh.read(cap + 1)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or socket); give a file", str(path))
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(cap + 1)
    finally:
        os.close(fd)


def ensure_private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and parents) if needed and set mode 0700 on it; return it as a Path."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    os.chmod(p, 0o700)
    return p


def check_private_file(path: str | os.PathLike) -> bool:
    """True iff ``path`` is a regular file not readable/writable by group or others."""
    st = os.stat(path, follow_symlinks=False)
    return (st.st_mode & 0o077) == 0
