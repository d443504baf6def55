"""Reading a large file into one new ``bytes`` object backed by transparent huge pages.

Why: reading a release payload used to cost as much as hashing it. ``os.read(fd, n)``
copies from the page cache into a freshly allocated object, and the kernel faults that
fresh memory in 4 KiB page by page: ~1.3 s per GiB here, against 0.6 s to hash it and
0.9 s for the whole of ``openssl dgst -sha256`` (issue 9, P4). Backed by 2 MiB
transparent huge pages the same copy takes ~0.2 s per GiB.

How: Linux gives huge pages to a mapping only when asked (``madvise(MADV_HUGEPAGE)``, the
default ``transparent_hugepage=madvise`` on common distributions), and CPython offers no
way to ask for the memory of a ``bytes`` object. So :func:`read_new_bytes` does what
``os.read`` does in C -- allocate an uninitialised ``bytes`` of the final size, fill it
with ``read(2)``, hand it out -- except that it advises the kernel between the two steps,
through ``ctypes``. The object is written only before anyone else can see it; what comes
out is an ordinary immutable ``bytes`` (``verify_payload`` requires exactly that).

Where any step is unavailable (not CPython, no ``madvise``, a layout probe that fails, a
file below :data:`MIN_BYTES`) it returns None and the caller reads with ``os.read``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
from collections.abc import Callable

__all__ = ["MIN_BYTES", "read_new_bytes"]

log = logging.getLogger(__name__)

#: below this size the 4 KiB faults cost little and plain ``os.read`` is used
MIN_BYTES = 8 << 20
_PAGE = mmap.PAGESIZE
_MAX_CALL = 1 << 30  # bytes per read(2) call (Linux returns at most 0x7ffff000)


def _libc():
    if sys.implementation.name != "cpython" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # ctypes.CDLL releases the GIL during calls
        libc.read.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
        libc.read.restype = ctypes.c_ssize_t
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _data_offset() -> int | None:
    """Offset of a ``bytes`` object's data from its address (``id``), checked on a probe:
    CPython's ``PyBytesObject`` header is ``sys.getsizeof(b"") - 1`` bytes (the trailing
    NUL is the 1)."""
    off = sys.getsizeof(b"") - 1
    probe = bytes(range(7, 47))
    try:
        ok = ctypes.string_at(id(probe) + off, len(probe)) == probe
    except Exception:  # noqa: BLE001 -- any failure means: do not use this path
        ok = False
    return off if ok else None


_LIBC = _libc()
_OFFSET = _data_offset() if _LIBC is not None else None


#: bytes per read(2) call when a reader watches the progress (``on_chunk``): small enough
#: that a chunk is still in the CPU's caches when its consumer (the hash) reads it
WATCHED_CHUNK = 8 << 20


def read_new_bytes(fd: int, size: int, on_chunk: Callable[[memoryview], None] | None = None) -> bytes | None:
    """Read up to ``size`` bytes from ``fd`` (from its current offset, until EOF) into one
    new ``bytes`` object whose memory was advised ``MADV_HUGEPAGE`` before it was touched.

    Args:
        fd: an open file descriptor (blocking reads; a regular file).
        size: bytes wanted (the result is shorter only at EOF).
        on_chunk: if given, called after every :data:`WATCHED_CHUNK` bytes (and at the
            end) with a read-only view of the bytes just read, in order -- they are never
            written again (the reader hashes them meanwhile, in another thread).
    Returns:
        the bytes read, or None when this path is unavailable or ``size < MIN_BYTES``
        (nothing was read then; the caller reads as usual).
    Raises:
        OSError: ``read(2)`` failed (errno set as by ``os.read``).
    """
    if _OFFSET is None or size < MIN_BYTES:
        return None
    buf = bytes(size)  # calloc: a fresh mapping whose pages are not touched yet
    addr = id(buf) + _OFFSET
    start = (addr + _PAGE - 1) // _PAGE * _PAGE
    end = (addr + size) // _PAGE * _PAGE
    if end > start and _LIBC.madvise(start, end - start, mmap.MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed: %s", os.strerror(ctypes.get_errno()))  # still correct, slower
    got, step = 0, WATCHED_CHUNK if on_chunk is not None else _MAX_CALL
    view = memoryview(buf) if on_chunk is not None else None
    try:
        while got < size:
            n = _LIBC.read(fd, addr + got, min(step, size - got))
            if n < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise OSError(err, os.strerror(err))
            if n == 0:
                break
            if view is not None:
                on_chunk(view[got:got + n])
            got += n
    finally:
        if view is not None:
            view.release()
    return buf if got == size else buf[:got]
