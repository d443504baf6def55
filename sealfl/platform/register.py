"""The consortium's release register ``releases.json``: which versions exist, so that no
version is ever issued twice (devices refuse a version they already ran, and two
different releases under one version would be indistinguishable to them).

Format: a JSON list of ``{"version": int, "state": "reserved"|"issued", "dir": str,
"time": float, "root_digest": hex (issued only)}``; entries without ``state`` (sealfl
0.1) are ``issued``.

Order of writes in a build (:func:`sealfl.platform.release.release`): the version is
**reserved** (register rewritten atomically, under an exclusive ``flock`` so two builds
cannot both reserve it) *before* the release directory is renamed into place, and marked
**issued** after. A build killed between the two leaves a reserved version that is never
used again -- a gap in the version sequence, which devices tolerate -- instead of a
release on disk that the register does not know.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from sealfl.common.fields import Fields
from sealfl.common.fsutil import atomic_write
from sealfl.platform.errors import ReleaseError

REGISTER = "releases.json"
LOCK = ".releases.lock"
MAX_VERSION = 2**31 - 1
STATES = ("reserved", "issued")

__all__ = ["REGISTER", "MAX_VERSION", "parse_register", "check_new_version", "read_register", "reserve",
           "unreserve", "mark_issued", "register_lock", "same_content"]


def parse_register(data: bytes, where: str = REGISTER) -> list[dict]:
    """Parse and check every entry of a register. Pure.

    Raises:
        ReleaseError: not a JSON list; an entry that is not an object; a version that is
            not an integer in [0, 2^31-1] or appears twice; an unknown state; an issued
            entry without a 64-hex root digest (the message names the entry and field).
    """
    fix = "restore it from a backup (editing it by hand can let a version be issued twice)"
    try:
        entries = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ReleaseError(f"{where} is not JSON ({exc}); {fix}") from exc
    Fields(where, lambda m: ReleaseError(f"{m}; {fix}")).array(entries, "")
    seen: set[int] = set()
    out = []
    for i, e in enumerate(entries):
        fields = Fields(f"{where}: entry {i}", lambda m: ReleaseError(f"{m}; {fix}"))
        fields.object(e, "")
        v = fields.get(e, "version", "integer", lo=0, hi=MAX_VERSION)
        if v in seen:
            raise ReleaseError(f"{where}: version {v} appears twice; {fix}")
        seen.add(v)
        state = fields.get(e, "state", "choice", default="issued", choices=STATES)
        if state == "issued":
            fields.get(e, "root_digest", "hex64")
        out.append({**e, "state": state})
    return out


def check_new_version(entries: list[dict], version: int) -> None:
    """Refuse ``version`` unless it is newer than every registered one, reserved or
    issued. Pure. Raises ReleaseError that names the next usable version."""
    Fields("release", ReleaseError).integer(version, "version", lo=0, hi=MAX_VERSION)
    if not entries:
        return
    latest = max(entries, key=lambda e: e["version"])
    if version <= latest["version"]:
        what = (f"the latest release v{latest['version']}" if latest["state"] == "issued" else
                f"v{latest['version']}, reserved by a build that did not finish (no device ever saw it)")
        raise ReleaseError(f"version {version} is not newer than {what} of this consortium; devices would refuse "
                           f"it -- use --version {latest['version'] + 1}")


def same_content(entries: list[dict], root_digest: str, version: int) -> list[int]:
    """The other issued versions whose root digest is ``root_digest`` (a release of the
    same content under a new version: worth a warning, since devices will see nothing new)."""
    return sorted(int(e["version"]) for e in entries if e.get("state", "issued") == "issued"
                  and e.get("root_digest") == root_digest and e.get("version") != version)


def read_register(consortium_dir: Path) -> list[dict]:
    """The checked entries of ``<consortium>/releases.json`` ([] if there is none)."""
    p = Path(consortium_dir) / REGISTER
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ReleaseError(f"{p} is unreadable ({exc.strerror or exc}); restore it before releasing") from exc
    return parse_register(data, str(p))


@contextlib.contextmanager
def register_lock(consortium_dir: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``<consortium>/.releases.lock`` for a read-check-write."""
    fd = os.open(Path(consortium_dir) / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _write(consortium_dir: Path, entries: list[dict]) -> None:
    atomic_write(Path(consortium_dir) / REGISTER, json.dumps(entries, indent=2).encode(), 0o644)


def reserve(consortium_dir: Path, version: int, out_dir: str) -> None:
    """Reserve ``version`` for a build writing ``out_dir`` (before anything is written).
    Raises ReleaseError if it is not newer than every registered version."""
    with register_lock(consortium_dir):
        entries = read_register(consortium_dir)
        check_new_version(entries, version)
        _write(consortium_dir, entries + [{"version": version, "state": "reserved", "dir": out_dir,
                                           "time": time.time(), "pid": os.getpid()}])


def mark_issued(consortium_dir: Path, version: int, root_digest: str, out_dir: str) -> None:
    """Mark a reserved version issued, with the release's root digest."""
    with register_lock(consortium_dir):
        entries = read_register(consortium_dir)
        for e in entries:
            if e["version"] == version:
                e.update(state="issued", root_digest=root_digest, dir=out_dir, time=time.time())
                e.pop("pid", None)
                break
        else:
            raise ReleaseError(f"version {version} was not reserved in {REGISTER}; the release in {out_dir} is not "
                               "registered")
        _write(consortium_dir, entries)


def unreserve(consortium_dir: Path, version: int) -> None:
    """Drop the reservation of ``version`` after a build failed before its release
    directory was renamed into place (so the version was never used)."""
    with register_lock(consortium_dir):
        entries = read_register(consortium_dir)
        kept = [e for e in entries if not (e["version"] == version and e["state"] == "reserved")]
        if kept != entries:
            _write(consortium_dir, kept)

