"""Pipe I/O with deadlines between :class:`sealfl.enclave.sandbox.runtime.SandboxedRuntime` and its
child: every wait is bounded, and the pipe is widened so large models cross quickly."""

from __future__ import annotations

import logging
import os
import select
import time
from collections.abc import Callable, Sequence

__all__ = ["PIPE_BYTES", "read_exact_until", "widen_pipe", "write_all"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20

#: fcntl F_SETPIPE_SZ (Linux >= 2.6.35, fcntl(2)); the stdlib names it from Python 3.10 on
_F_SETPIPE_SZ = 1031
#: the pipe size asked for: Linux's default unprivileged maximum (/proc/sys/fs/pipe-max-size)
PIPE_BYTES = 1 << 20


def widen_pipe(fd: int) -> None:
    """Grow the pipe to the child to :data:`PIPE_BYTES` (default 64 KiB): a 100 MB model then
    crosses in ~100 writes instead of ~1,600, about 0.1 s less at boot (bench/verify_bench).
    Best effort: a kernel that refuses keeps the default."""
    import fcntl

    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", _F_SETPIPE_SZ), PIPE_BYTES)
    except OSError as exc:
        log.debug("pipe to the sandbox child stays at its default size: %s", exc)


def write_all(fd: int, chunks: Sequence[bytes], deadline: float) -> None:
    """Write every chunk to the non-blocking ``fd`` before ``deadline`` (time.monotonic()
    seconds). Raises TimeoutError past it, OSError (BrokenPipeError) if the reader is gone."""
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            _, writable, _ = select.select([], [fd], [], remaining)
            if not writable:
                continue
            try:
                view = view[os.write(fd, view[:_CHUNK]):]
            except BlockingIOError:
                continue


def read_exact_until(fd: int, deadline: float) -> Callable[[int], bytes]:
    """A ``read_exact(n)`` over ``fd`` for :func:`sealfl.enclave.sandbox.child.read_message`
    that raises TimeoutError past ``deadline`` and EOFError when the writer is gone."""

    def read_exact(n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, min(n - got, _CHUNK))
            if not chunk:
                raise EOFError
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    return read_exact
