"""Crash-consistent device storage: release slots and ``state.json``.

State directory layout (mode 0700)::

    state.json        the device's trusted state (:class:`~sealfl.attestation.device_state.DeviceState`)
    slots/<name>/     private copies of verified releases (the exact bytes that were verified)
    tee/              the device TEE's state
    .lock             serialises boots of one device

Every change is *write new -> fsync -> rename -> fsync the directory -> only then remove the
old* (:func:`commit`):

1. the verified files are written into ``slots/.tmp-<random>/``, each file fsynced, then the
   directory fsynced; files the boot verified without keeping them (a causal-LM release's
   other variants, ``VerifiedRelease.streamed``) are copied from the release directory
   through a small buffer and hashed as they are copied: a copy that does not have its
   signed size and SHA-256 (the file changed since it was verified) is refused;
2. that directory is renamed to a **new** name ``slots/<label>-<random>``
   (never over an existing slot, so booting the same release again never touches the slot
   ``state.json`` points at) and ``slots/`` is fsynced;
3. ``state.json`` is replaced atomically (temp file, fsync, rename, fsync of the state
   directory; :func:`sealfl.common.fsutil.atomic_write`);
4. only then are the other slots and stale temp directories removed; a failure here is
   logged, not raised, and the next commit removes them.

After a crash or an I/O error at any point, ``state.json`` names a complete slot: before
step 3 the old one, untouched; after it the new one.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from sealfl.attestation.device_state import SLOTS_DIR, STATE_FILE, DeviceState, check_slot_path
from sealfl.attestation.errors import DeviceStateError, VerificationError
from sealfl.attestation.reader import stream_sha256
from sealfl.attestation.verify import FileEntry
from sealfl.common.fsutil import atomic_write, ensure_private_dir
from sealfl.common.testpoints import testpoint

__all__ = ["read_state", "store_slot", "write_state", "prune_slots", "commit", "slot_path"]

log = logging.getLogger(__name__)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new_file(dir_fd: int, name: str, data: bytes) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_verified(dir_fd: int, source: Path, entry: FileEntry) -> None:
    """Copy ``source/entry.path`` into a new file of ``dir_fd``, hashing it as it is copied.

    Raises:
        VerificationError: (check ``hash``) the copy does not have the signed size and SHA-256.
        OSError: a read, write or fsync failed.
    """
    src = os.open(Path(source) / entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst = os.open(entry.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=dir_fd)
        try:
            def write(chunk: memoryview) -> None:
                while chunk:
                    chunk = chunk[os.write(dst, chunk):]

            size, digest = stream_sha256(src, entry.size, write)
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    if size != entry.size or digest != entry.sha256:
        raise VerificationError(entry.path, "hash", f"changed in {source} after it was verified (size {size}, "
                                f"sha256 {digest}; signed {entry.size}, {entry.sha256}); not recorded")


def read_state(state_root: Path) -> DeviceState:
    """The device state in ``state_root/state.json``; a fresh :class:`DeviceState` if absent.

    Raises:
        DeviceStateError: the file exists but is unreadable or malformed (names the field).
    """
    path = Path(state_root) / STATE_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return DeviceState()
    except OSError as exc:
        raise DeviceStateError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return DeviceState.from_bytes(data)
    except DeviceStateError as exc:
        raise DeviceStateError(f"{path}: {exc}") from exc


def slot_path(state_root: Path, slot: str) -> Path:
    """Absolute path of the slot ``slot`` (``"slots/<name>"``) under ``state_root``.

    Raises:
        DeviceStateError: ``slot`` is not ``"slots/<name>"``.
    """
    return Path(state_root) / check_slot_path(slot)


def store_slot(state_root: Path, files: Mapping[str, bytes], label: str,
               streamed: Mapping[str, FileEntry] | None = None, source: Path | None = None) -> str:
    """Steps 1-2 of :func:`commit`: copy ``files`` (and the ``streamed`` files, from the
    release directory ``source``, which they need) into a new slot; return ``"slots/<name>"``.

    Raises:
        OSError: a write, fsync or rename failed (the temp directory is removed).
        VerificationError: a streamed file changed after it was verified (the temp
            directory is removed).
    """
    slots = ensure_private_dir(Path(state_root) / SLOTS_DIR)
    token = secrets.token_hex(4)
    tmp = slots / f".tmp-{token}"
    os.mkdir(tmp, 0o700)
    try:
        dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name, data in sorted(files.items()):
                _write_new_file(dfd, name, data)
            for name, entry in sorted((streamed or {}).items()):
                _copy_verified(dfd, source, entry)
            os.fsync(dfd)
        finally:
            os.close(dfd)
        testpoint("slot-written")
        name = f"{label}-{token}"
        os.rename(tmp, slots / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(slots)
    testpoint("slot-renamed")
    return f"{SLOTS_DIR}/{name}"


def write_state(state_root: Path, state: DeviceState) -> None:
    """Step 3 of :func:`commit`: replace ``state.json`` atomically (mode 0600).

    Raises:
        OSError: the write, fsync or rename failed (the old ``state.json`` is untouched).
    """
    atomic_write(Path(state_root) / STATE_FILE, state.to_bytes(), 0o600)


def prune_slots(state_root: Path, keep: str) -> None:
    """Step 4 of :func:`commit`: remove every entry of ``slots/`` but ``keep``. Never raises."""
    slots = Path(state_root) / SLOTS_DIR
    keep_name = Path(keep).name
    try:
        entries = list(os.scandir(slots))
    except OSError as exc:
        log.warning("cannot list %s to remove old slots: %s", slots, exc)
        return
    for entry in entries:
        if entry.name == keep_name:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError as exc:
            log.warning("cannot remove old slot %s (removed on the next update): %s", entry.path, exc)


def commit(state_root: Path, files: Mapping[str, bytes], label: str,
           transition: Callable[[str], DeviceState], streamed: Mapping[str, FileEntry] | None = None,
           source: Path | None = None) -> DeviceState:
    """Record a booted release crash-consistently (steps in the module docstring).

    Args:
        state_root: the device state directory.
        files: every verified file of the release (``VerifiedRelease.files()``).
        label: start of the new slot's name (letters, digits, ``.``, ``_``, ``-``), e.g.
            ``"v3-<statement digest prefix>"``; a random suffix makes the name new.
        transition: ``slot -> DeviceState``, the pure transition (e.g. wrapping
            :meth:`DeviceState.accept`), called once the slot exists.
        streamed, source: files verified without being kept (``VerifiedRelease.streamed``)
            and the release directory to copy them from (:func:`store_slot`).

    Returns:
        the new :class:`DeviceState`, now in ``state.json``.

    Raises:
        OSError: steps 1-3 failed; ``state.json`` names a complete slot (the previous one,
            or the new one if only the final directory fsync failed). A new slot left
            behind is removed by the next commit.
        DeviceStateError: the transition refused the release (nothing was changed but a new,
            unreferenced slot).
        VerificationError: a streamed file changed after it was verified (nothing changed).
    """
    slot = store_slot(state_root, files, label, streamed, source)
    new_state = transition(slot)
    write_state(state_root, new_state)
    testpoint("state-written")
    prune_slots(state_root, keep=slot)
    testpoint("slots-pruned")
    return new_state
