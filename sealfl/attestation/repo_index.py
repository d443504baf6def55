"""The repository's release index and the device's choice of update: pure functions over bytes.

A sealfl TUF repository (:mod:`sealfl.platform.repo`) publishes every file of a release as
a TUF target under ``releases/<name>/<version>/<file>`` and one more target,
:data:`INDEX_TARGET`, that lists the releases::

    {"schema": "sealfl.repo-index/v1",
     "releases": [{"name": str,                 # release name, [A-Za-z0-9._-]{1,64}
                   "version": int,              # 0..2**31-1
                   "root_digest": hex64,        # the release manifest's root digest
                   "files": [str, ...]},        # file names of the release directory
                  ...]}

The index is only as trusted as TUF makes it: the device downloads it through
``tuf.ngclient`` (length and hashes from the signed targets metadata), parses it here
(:func:`parse_index`: every field type-checked, unknown fields kept out, names that could
leave a directory refused), and :func:`choose_update` decides what to fetch. The release's
own signature, manifest and version rules are checked afterwards by the device's existing
verifier on the downloaded bytes (:func:`sealfl.attestation.reader.load_release`); the
version and root digest the index claims must then match what was signed
(:func:`check_claims`).

Each file's TUF target carries the same claim as custom metadata
(``{"sealfl": {"release": name, "version": v, "root_digest": d}}``), so a target of one
release cannot be listed under another (:func:`check_target_custom`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sealfl.attestation.errors import AttestationError
from sealfl.common.fields import MAX_VERSION

__all__ = ["INDEX_SCHEMA", "TUF_ROOT_FILE", "INDEX_TARGET", "MAX_INDEX_BYTES", "MAX_RELEASE_FILES", "RepoIndexError",
           "IndexedRelease", "UpdateChoice", "target_path", "delta_target_path", "custom_of", "index_bytes", "parse_index",
           "check_target_custom", "choose_update", "check_claims"]

INDEX_SCHEMA = "sealfl.repo-index/v1"
#: the device's TUF trust root (root.json version 1, or a later one) in its trust directory
TUF_ROOT_FILE = "tuf-root.json"
INDEX_TARGET = "releases/index.json"
#: the index is refused beyond this many bytes whatever the targets metadata says
MAX_INDEX_BYTES = 1 << 20
#: files one release may have
MAX_RELEASE_FILES = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class RepoIndexError(AttestationError):
    """The repository's index or a target's claim is malformed or disagrees with the
    release; the message names the field and what was found."""


@dataclass(frozen=True)
class IndexedRelease:
    """One release the index lists (fields as in the module docstring)."""

    name: str
    version: int
    root_digest: str
    files: tuple[str, ...]

    def target(self, file: str) -> str:
        """The TUF target path of ``file``."""
        return target_path(self.name, self.version, file)


@dataclass(frozen=True)
class UpdateChoice:
    """What :func:`choose_update` decided.

    Attributes:
        action: ``"install"`` (``release`` is newer), ``"current"`` (the device runs the
            newest release already) or ``"none"`` (the index lists no release of that name).
        release: the release to install or the one running, None for ``"none"``.
    """

    action: str
    release: IndexedRelease | None


def target_path(name: str, version: int, file: str) -> str:
    """``releases/<name>/<version>/<file>``."""
    return f"releases/{name}/{version}/{file}"


def delta_target_path(name: str, version: int, base_root_digest: str, file: str) -> str:
    """``deltas/<name>/<version>/<base root digest>/<file>``: a signed delta to release
    ``name`` v``version`` from the release of that root digest (``file`` is
    ``delta.dsse.json`` or a patch name: :mod:`sealfl.attestation.delta`). A device looks
    only under its own running release's root digest, so it never even fetches a delta made
    for another base."""
    return f"deltas/{name}/{version}/{base_root_digest}/{file}"


def custom_of(name: str, version: int, root_digest: str) -> dict:
    """The custom metadata every target of a release carries."""
    return {"sealfl": {"release": name, "version": version, "root_digest": root_digest}}


def index_bytes(releases: Iterable[IndexedRelease]) -> bytes:
    """Serialise an index (sorted by name, then version); parses back with :func:`parse_index`."""
    rows = sorted(releases, key=lambda r: (r.name, r.version))
    doc = {"schema": INDEX_SCHEMA,
           "releases": [{"name": r.name, "version": r.version, "root_digest": r.root_digest,
                         "files": sorted(r.files)} for r in rows]}
    out = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
    parse_index(out)
    return out


def _check_release(row: object, where: str) -> IndexedRelease:
    if not isinstance(row, dict) or set(row) != {"name", "version", "root_digest", "files"}:
        raise RepoIndexError(f"{where}: must be an object with exactly name, version, root_digest, files")
    name, version, digest, files = row["name"], row["version"], row["root_digest"], row["files"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RepoIndexError(f"{where}.name: must match {_NAME.pattern}, got {str(name)[:80]!r}")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise RepoIndexError(f"{where}.version: must be an integer 0..{MAX_VERSION}, got {str(version)[:40]!r}")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise RepoIndexError(f"{where}.root_digest: must be 64 lowercase hex digits, got {str(digest)[:80]!r}")
    if not isinstance(files, list) or not 1 <= len(files) <= MAX_RELEASE_FILES:
        raise RepoIndexError(f"{where}.files: must be a list of 1..{MAX_RELEASE_FILES} file names")
    for i, f in enumerate(files):
        if not isinstance(f, str) or not _FILE.fullmatch(f):
            raise RepoIndexError(f"{where}.files[{i}]: a plain file name ({_FILE.pattern}) is required, got "
                                 f"{str(f)[:80]!r}")
    if len(set(files)) != len(files):
        raise RepoIndexError(f"{where}.files: lists a file twice")
    return IndexedRelease(name, version, digest, tuple(files))


def parse_index(data: bytes) -> tuple[IndexedRelease, ...]:
    """Parse the index's bytes (module docstring).

    Raises:
        RepoIndexError: too large, not UTF-8 JSON, a wrong schema, a field of the wrong type
            or value, or a (name, version) listed twice; the message names the field.
    """
    if len(data) > MAX_INDEX_BYTES:
        raise RepoIndexError(f"{INDEX_TARGET}: {len(data)} bytes, more than the {MAX_INDEX_BYTES} allowed")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RepoIndexError(f"{INDEX_TARGET}: not UTF-8 JSON ({str(exc)[:120]})") from None
    if not isinstance(doc, dict) or set(doc) != {"schema", "releases"}:
        raise RepoIndexError(f"{INDEX_TARGET}: must be an object with exactly schema and releases")
    if doc["schema"] != INDEX_SCHEMA:
        raise RepoIndexError(f"{INDEX_TARGET}: schema must be {INDEX_SCHEMA!r}, got {str(doc['schema'])[:80]!r}")
    rows = doc["releases"]
    if not isinstance(rows, list) or len(rows) > 4096:
        raise RepoIndexError(f"{INDEX_TARGET}: releases must be a list of at most 4096 entries")
    out = tuple(_check_release(row, f"{INDEX_TARGET} releases[{i}]") for i, row in enumerate(rows))
    seen = set()
    for r in out:
        if (r.name, r.version) in seen:
            raise RepoIndexError(f"{INDEX_TARGET}: {r.name} v{r.version} is listed twice")
        seen.add((r.name, r.version))
    return out


def check_target_custom(release: IndexedRelease, file: str, custom: object) -> None:
    """Refuse a target whose custom metadata does not claim ``release``.

    Raises:
        RepoIndexError: naming the target and the claim found.
    """
    want = custom_of(release.name, release.version, release.root_digest)
    if not isinstance(custom, Mapping) or custom.get("sealfl") != want["sealfl"]:
        found = custom.get("sealfl") if isinstance(custom, Mapping) else custom
        raise RepoIndexError(f"target {release.target(file)}: its custom metadata claims {str(found)[:200]}, the "
                             f"index lists {release.name} v{release.version} ({release.root_digest})")


def choose_update(index: Iterable[IndexedRelease], name: str, running_version: int | None,
                  running_root: str | None) -> UpdateChoice:
    """Pick the newest release of ``name``; compare it with what runs.

    Raises:
        RepoIndexError: the newest release is older than the running one (a rollback: the
            device never goes back), or has the running version with another root digest.
    """
    mine = [r for r in index if r.name == name]
    if not mine:
        return UpdateChoice("none", None)
    newest = max(mine, key=lambda r: r.version)
    if running_version is None:
        return UpdateChoice("install", newest)
    if newest.version < running_version:
        raise RepoIndexError(f"the repository's newest {name} is v{newest.version}, older than the running "
                             f"v{running_version}: refused (a device never goes back to an older version; to go "
                             "back, re-release the old content as a new version)")
    if newest.version == running_version:
        if newest.root_digest != running_root:
            raise RepoIndexError(f"the repository's {name} v{newest.version} has root digest {newest.root_digest}, "
                                 f"the running v{running_version} has {running_root}: two releases with one version "
                                 "number, refused")
        return UpdateChoice("current", newest)
    return UpdateChoice("install", newest)


def check_claims(release: IndexedRelease, name: str, version: int, root_digest: str) -> None:
    """Refuse a verified release that is not the one the index (and TUF) promised.

    Raises:
        RepoIndexError: name, version or root digest differ; the message gives both.
    """
    got = (name, version, root_digest)
    want = (release.name, release.version, release.root_digest)
    if got != want:
        raise RepoIndexError(f"the downloaded release is {name} v{version} ({root_digest}); the repository "
                             f"promised {release.name} v{release.version} ({release.root_digest}): wrong software, "
                             "refused")
