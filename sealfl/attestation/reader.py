"""Reading a release directory: bounded by what was signed (the I/O around :mod:`.verify`).

:func:`load_release` is what ``sealfl verify`` and ``device boot`` use:

1. list the directory's names (at most ``VerifyConfig.max_entries``); nothing is opened;
2. read ``manifest.dsse.json``, ``manifest.json``, ``attestation.json``, ``model.sig``, each no further than
   its cap + 1 byte (:class:`~sealfl.attestation.config.VerifyConfig`);
3. :func:`~sealfl.attestation.verify.verify_metadata` on those bytes and the names -- an
   unlisted name is refused as ``extra-file`` without ever being opened;
4. open each *listed* file, refuse it if ``fstat`` gives a size other than its signed size,
   and read it no further than its signed size + 1 byte;
5. :func:`~sealfl.attestation.verify.verify_payload` on those bytes.

With ``keep`` (a choice made on the signed metadata, after step 3), a listed file that is
not kept is *streamed* instead in step 4: read through one small buffer
(:data:`STREAM_CHUNK`) and hashed, to EOF or its signed size + 1 byte, its bytes never held
together -- a device booting the INT4 variant of a causal-LM release does not hold the
172 MB INT8 one it verifies (issue 24). The release is accepted or refused exactly as
without ``keep``, except that a streamed ``.onnx`` file is not parsed (check 10: it is not
loaded).

Every file is opened relative to a directory fd with ``O_NOFOLLOW | O_NONBLOCK`` and checked
with ``fstat`` on the open fd (no check-then-open race; symlinks, FIFOs and devices are
refused as ``file-type``). So the memory and time a release costs the device are bounded by
the caps and by what the release enclave signed, never by what else sits on the disk.

:func:`read_release_dir` reads *every* regular file of a directory (under a per-file cap);
it is for tools and tests that want the raw bytes, not for verification.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from sealfl.attestation.bigread import MIN_BYTES, read_new_bytes
from sealfl.attestation.bundle import METADATA_FILES
from sealfl.attestation.config import DEFAULT_CONFIG, DEFAULT_MAX_FILE_BYTES, VerifyConfig
from sealfl.attestation.device_state import DeviceState
from sealfl.attestation.errors import VerificationError
from sealfl.attestation.trust import TrustAnchors
from sealfl.attestation.verify import SignedRelease, VerifiedRelease, verify_metadata, verify_payload

__all__ = ["STREAM_CHUNK", "load_release", "read_release_dir", "stream_sha256"]

log = logging.getLogger(__name__)

_MAX_READ = 1 << 30  # bytes per read() call: one allocation each, below Linux's 0x7ffff000 cap
#: bytes per read of a streamed (hashed, not kept) file: large enough for hashlib to run at
#: openssl's speed, small enough to stay in the CPU's caches
STREAM_CHUNK = 1 << 20


def _open_dir(root: str) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise VerificationError(root, "read", f"cannot open release directory: {exc.strerror or exc}") from exc


def _list_dir(dfd: int, root: str, max_entries: int) -> list[str]:
    names: list[str] = []
    try:
        with os.scandir(dfd) as it:
            for entry in it:
                names.append(entry.name)
                if len(names) > max_entries:
                    raise VerificationError(root, "read", f"more than {max_entries} directory entries "
                                            "(VerifyConfig.max_entries)")
    except OSError as exc:
        raise VerificationError(root, "read", f"cannot list release directory: {exc.strerror or exc}") from exc
    return sorted(names)


def _open_regular(dfd: int, name: str) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise VerificationError(name, "file-type", "is a symbolic link") from exc
        raise VerificationError(name, "read", f"cannot open: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise VerificationError(name, "file-type", "is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise VerificationError(name, "file-type", "is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class _ChunkHasher:
    """SHA-256 of a file computed while it is read: :func:`~.bigread.read_new_bytes` hands
    each chunk it has read to :meth:`feed`, a worker thread hashes it while the next chunk
    is read (``read(2)`` through ctypes and ``hashlib`` both release the GIL), so reading
    and hashing a large payload take about as long as hashing it alone -- what
    ``openssl dgst`` does with its small buffers (issue 9, P4)."""

    def __init__(self) -> None:
        import hashlib
        import queue
        import threading

        self._h = hashlib.sha256()
        self.fed = 0  # bytes fed so far
        self._q: "queue.SimpleQueue[memoryview | None]" = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="sealfl-hash", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (chunk := self._q.get()) is not None:
            self._h.update(chunk)
            chunk.release()

    def feed(self, chunk: memoryview) -> None:
        self.fed += chunk.nbytes
        self._q.put(chunk)

    def hexdigest(self) -> str:
        """The digest of everything fed (waits for the worker)."""
        self.close()
        return self._h.hexdigest()

    def close(self) -> None:
        if self._t.is_alive():
            self._q.put(None)
            self._t.join()


def _read_at_most(fd: int, name: str, limit: int, hasher: _ChunkHasher | None = None) -> bytes:
    """Read from ``fd`` until EOF or ``limit + 1`` bytes, whichever comes first.

    One ``read`` of ``limit + 1`` bytes into one new bytes object (a single copy from the
    page cache; the kernel returns at most ~2 GiB per call, so larger files loop), instead
    of 1 MiB pieces joined afterwards -- the join was a second full copy, the main reason
    verification ran at ~0.6 of ``openssl dgst``'s throughput (issue 9, P4). Files of
    :data:`~.bigread.MIN_BYTES` and more go into memory backed by huge pages
    (:func:`~.bigread.read_new_bytes`); then one more ``read`` checks for a byte past
    ``limit`` (its join copies only a file that is too large anyway)."""
    want = limit + 1
    parts: list[bytes] = []
    got = 0
    try:
        # huge-page backed (bigread.py), hashed meanwhile if asked; None: small or unavailable
        big = read_new_bytes(fd, limit, hasher.feed if hasher is not None else None)
        if big is not None:
            if len(big) < limit:
                return big
            parts.append(big)
            got = len(big)
        while got < want:
            chunk = os.read(fd, min(_MAX_READ, want - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise VerificationError(name, "read", f"cannot read: {exc.strerror or exc}") from exc
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _read_document(dfd: int, name: str, cap: int) -> bytes:
    fd, st = _open_regular(dfd, name)
    try:
        if st.st_size > cap:
            raise VerificationError(name, "size", f"{st.st_size} bytes > cap {cap} (VerifyConfig)")
        data = _read_at_most(fd, name, cap)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise VerificationError(name, "size", f"more than {cap} bytes (VerifyConfig); the file grew while read")
    return data


def _read_payload(dfd: int, name: str, signed_size: int) -> tuple[bytes, str | None]:
    """(the file's bytes, their SHA-256 hex computed while reading -- or None where the
    bytes were not read in one piece: small files, or a file that grew, which
    verify_payload refuses by its size anyway)."""
    fd, st = _open_regular(dfd, name)
    hasher = _ChunkHasher() if signed_size >= MIN_BYTES else None
    try:
        if st.st_size != signed_size:
            raise VerificationError(name, "hash", f"size {st.st_size} bytes != signed size {signed_size} "
                                    "(refused before reading)")
        data = _read_at_most(fd, name, signed_size, hasher)  # verify_payload refuses a length != signed_size
        digest = hasher.hexdigest() if hasher is not None and len(data) == signed_size else None
        if digest is not None and hasher.fed != len(data):
            digest = None
        return data, digest
    finally:
        if hasher is not None:
            hasher.close()
        os.close(fd)


def stream_sha256(fd: int, limit: int, sink: Callable[[memoryview], None] | None = None) -> tuple[int, str]:
    """Read ``fd`` from its offset to EOF, but no further than ``limit + 1`` bytes, through one
    :data:`STREAM_CHUNK` buffer; returns ``(bytes read, SHA-256 hex of them)``. ``sink``, if
    given, gets a view of each chunk (valid only during the call) after it was hashed (a
    slot copy writes it). Raises OSError from ``read(2)`` or the sink."""
    import hashlib

    h = hashlib.sha256()
    buf = bytearray(STREAM_CHUNK)
    view = memoryview(buf)
    got, want = 0, limit + 1
    try:
        while got < want:
            n = os.readv(fd, [view[:min(STREAM_CHUNK, want - got)]])
            if n == 0:
                break
            h.update(view[:n])
            if sink is not None:
                sink(view[:n])
            got += n
    finally:
        view.release()
    return got, h.hexdigest()


def _stream_payload(dfd: int, name: str, signed_size: int) -> tuple[int, str]:
    """(bytes read, their SHA-256) of a listed file that is not kept (:func:`stream_sha256`)."""
    fd, st = _open_regular(dfd, name)
    try:
        if st.st_size != signed_size:
            raise VerificationError(name, "hash", f"size {st.st_size} bytes != signed size {signed_size} "
                                    "(refused before reading)")
        return stream_sha256(fd, signed_size)
    except OSError as exc:
        raise VerificationError(name, "read", f"cannot read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def load_release(path: str | os.PathLike, trust: TrustAnchors, *, state: DeviceState | None = None,
                 config: VerifyConfig = DEFAULT_CONFIG,
                 on_payload: Callable[[SignedRelease, Mapping[str, bytes]], None] | None = None,
                 keep: Callable[[SignedRelease], Collection[str] | None] | None = None) -> VerifiedRelease:
    """Read and verify the release directory ``path`` (steps in the module docstring).

    Args:
        path: the release directory (may itself be a symlink, e.g. an A/B "current" link).
        trust: pinned keys and policy.
        state: the device's trusted state (rollback floor); None = a fresh device.
        config: size caps.
        on_payload: called with the signed release (checks 1-8 passed) and the payload
            files as read, *before* they are checked (hash, ONNX) -- for work that may overlap
            the hashing but must not trust the bytes (device boot stages the model in the
            sandboxed child's stage file, :meth:`sealfl.enclave.sandbox.runtime.SandboxedRuntime.stage`). It must
            not raise; the release is refused or accepted by the checks alone.
        keep: called with the signed release (checks 1-8 passed); returns the payload file
            names whose bytes to keep, or None for all. The others are streamed (module
            docstring): verified, then listed in ``VerifiedRelease.streamed``. It must not
            raise (a choice it cannot make: return None).

    Returns:
        the :class:`~sealfl.attestation.verify.VerifiedRelease`; its ``payload`` and
        ``documents`` hold the bytes that were verified.

    Raises:
        VerificationError: ``read`` (directory missing/unreadable, too many entries),
            ``file-type`` (a listed or document name is a symlink, directory or special
            file), ``size`` (a document over its cap), or any check of
            :mod:`sealfl.attestation.verify`.
    """
    root = str(path)
    dfd = _open_dir(root)
    try:
        names = _list_dir(dfd, root, config.max_entries)
        documents = {}
        for name in METADATA_FILES:  # verify_metadata refuses a missing one (and says why it matters)
            if name in names:
                documents[name] = _read_document(dfd, name, config.document_cap(name))
        signed = verify_metadata(documents, names, trust, state=state, config=config)
        wanted = keep(signed) if keep is not None else None
        held = [e for e in signed.files if wanted is None or e.path in wanted]
        # streamed first: the kept files are read last, each freed file's memory reused
        streamed = {e.path: _stream_payload(dfd, e.path, e.size) for e in signed.files if e not in held}
        read = {entry.path: _read_payload(dfd, entry.path, entry.size) for entry in held}
    finally:
        os.close(dfd)
    payload = {path: data for path, (data, _) in read.items()}
    digests = {path: digest for path, (_, digest) in read.items() if digest is not None}
    if on_payload is not None:
        on_payload(signed, payload)
    log.debug("read %d signed files from release dir %s (%d streamed, not kept)", len(payload) + len(documents),
              Path(root), len(streamed))
    return verify_payload(signed, payload, digests, streamed)


def read_release_dir(path: str | os.PathLike, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                     max_files: int = 4096) -> dict[str, bytes]:
    """Read every regular file of a flat directory exactly once (for tools and tests; the
    device uses :func:`load_release`, which never reads an unlisted file).

    Args:
        path: the directory.
        max_file_bytes: per-file cap in bytes (default 2 GiB).
        max_files: cap on the number of directory entries.

    Returns:
        ``{file name: bytes}``.

    Raises:
        VerificationError: ``read`` (directory missing/unreadable, too many entries, a file
            changing size while read), ``file-type`` (symlink, subdirectory or special
            file), ``size`` (file over cap).
    """
    root = str(path)
    dfd = _open_dir(root)
    out: dict[str, bytes] = {}
    try:
        for name in _list_dir(dfd, root, max_files):
            fd, st = _open_regular(dfd, name)
            try:
                if st.st_size > max_file_bytes:
                    raise VerificationError(name, "size", f"{st.st_size} bytes > cap {max_file_bytes}")
                data = _read_at_most(fd, name, st.st_size)
            finally:
                os.close(fd)
            if len(data) != st.st_size:
                raise VerificationError(name, "read", "file changed size while being read; retry")
            out[name] = data
    finally:
        os.close(dfd)
    return out
