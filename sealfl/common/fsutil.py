"""Small file-system helpers: atomic writes with explicit modes, private directories.

Used by the enclave (key and TEE state) and the aggregator (round log, checkpoints)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "ensure_private_dir", "check_private_file"]


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same dir, fsync, rename).

    The file is created with ``mode`` (default 0600) before any byte is written.

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
