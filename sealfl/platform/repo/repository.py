"""A TUF repository of sealfl releases, on python-tuf's Metadata API.

Layout of a repository directory ``REPO``::

    REPO/repo.json                  {"schema": "sealfl.tuf-repo/v1", "expiry_days": {role: days}}
    REPO/keys/<role>.pem            online keys: timestamp, snapshot, targets (0600; never served)
    REPO/www/                       what ``sealfl repo serve`` serves, and nothing else
        metadata/<N>.root.json      every root version (a client walks them one by one)
        metadata/<N>.snapshot.json, <N>.targets.json   consistent snapshots
        metadata/timestamp.json     the one unversioned file a client fetches
        metadata/{root,snapshot,targets}.json          the newest of each, for this module
        targets/releases/<name>/<version>/<sha256>.<file>   consistent-snapshot targets
    OFFLINE/root-<keyid16>.pem      the root keys (:data:`~.keys.ROOT_KEYS`, threshold
                                    :data:`~.keys.ROOT_THRESHOLD`), kept offline

Roles: root (threshold 2 of 3 offline keys), targets, snapshot, timestamp (one online key
each), ``consistent_snapshot`` on; each role's expiry comes from ``repo.json``
(:data:`DEFAULT_EXPIRY_DAYS`). A release is published as one target per file plus the index
:data:`~sealfl.attestation.repo_index.INDEX_TARGET` (:mod:`sealfl.attestation.repo_index`);
every change re-signs snapshot and timestamp. Every document this module writes is checked
against its delegator before it is written (:mod:`.signing`), so a threshold that is not
met fails here, not on the devices.

Sources: TUF specification 1.0 (sections 4 and 5 for the roles and the client workflow),
python-tuf's ``examples/manual_repo``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from securesystemslib.signer import Signer
from tuf.api.metadata import (
    Metadata,
    MetaFile,
    Root,
    Snapshot,
    TargetFile,
    Targets,
    Timestamp,
)
from tuf.api.serialization.json import JSONSerializer

from sealfl.attestation.repo_index import (
    INDEX_TARGET,
    IndexedRelease,
    custom_of,
    delta_target_path,
    index_bytes,
    parse_index,
    target_path,
)
from sealfl.common.fsutil import atomic_write, ensure_private_dir
from sealfl.platform.repo.keys import (
    ONLINE_ROLES,
    ROOT_KEYS,
    ROOT_THRESHOLD,
    RepoError,
    new_signer,
    read_key,
    read_root_keys,
    write_key,
    write_root_keys,
)
from sealfl.platform.repo.signing import sign_delegated, sign_root

__all__ = ["REPO_FILE", "REPO_SCHEMA", "DEFAULT_EXPIRY_DAYS", "ROLES", "Repository", "PublishedRelease"]

log = logging.getLogger(__name__)

REPO_SCHEMA = "sealfl.tuf-repo/v1"
#: the file that makes a directory a repository
REPO_FILE = "repo.json"
ROLES = ("root", "targets", "snapshot", "timestamp")
#: days each role's metadata stays valid after it is signed
DEFAULT_EXPIRY_DAYS = {"root": 365, "targets": 90, "snapshot": 7, "timestamp": 1}
_SERIALIZER = JSONSerializer(compact=False)


@dataclass(frozen=True)
class PublishedRelease:
    """What :meth:`Repository.publish` added: the release and its target paths."""

    release: IndexedRelease
    targets: tuple[str, ...]
    targets_version: int


def _expiry(days: int) -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0) + timedelta(days=days)


class Repository:
    """One repository directory (module docstring). Methods raise :class:`RepoError`."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.www = self.dir / "www"
        self.metadata_dir = self.www / "metadata"
        self.targets_dir = self.www / "targets"
        self.keys_dir = self.dir / "keys"

    # ---- set-up -------------------------------------------------------------------------
    @classmethod
    def init(cls, directory: str | Path, offline_dir: str | Path,
             expiry_days: dict[str, int] | None = None, *, use_existing_keys: bool = False) -> "Repository":
        """Create a repository: 3 root keys into ``offline_dir``, the online keys, version 1
        of every role (no targets yet but an empty index).

        Args:
            use_existing_keys: take the :data:`~.keys.ROOT_KEYS` root keys ``offline_dir``
                holds already (made at ``consortium create``, :func:`~.keys.make_authority_root_keys`)
                instead of making new ones.

        Raises:
            RepoError: ``directory`` is not empty, ``offline_dir`` holds root keys (or, with
                ``use_existing_keys``, not exactly three), or an expiry is not 1..3650 days.
        """
        repo = cls(directory)
        days = dict(DEFAULT_EXPIRY_DAYS)
        for role, d in (expiry_days or {}).items():
            if role not in DEFAULT_EXPIRY_DAYS:
                raise RepoError(f"unknown role {role!r} for an expiry (roles: {', '.join(ROLES)})")
            if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 3650:
                raise RepoError(f"expiry of {role} must be 1..3650 days, got {d!r}")
            days[role] = d
        if repo.dir.exists() and any(repo.dir.iterdir()):
            raise RepoError(f"{repo.dir} is not empty; give a new directory for the repository")
        offline = Path(offline_dir).resolve()
        if offline == repo.dir.resolve() or repo.dir.resolve() in offline.parents:
            raise RepoError("the offline keys directory must lie outside the repository (the repository is served "
                            "and copied; root keys stay offline)")
        if use_existing_keys:
            root_signers = list(read_root_keys(Path(offline_dir)).values())
            if len(root_signers) != ROOT_KEYS:
                raise RepoError(f"{offline_dir} holds {len(root_signers)} root keys, not {ROOT_KEYS}")
        else:
            root_signers = [new_signer() for _ in range(ROOT_KEYS)]
            write_root_keys(Path(offline_dir), root_signers)
        ensure_private_dir(repo.dir)
        atomic_write(repo.dir / REPO_FILE, json.dumps({"schema": REPO_SCHEMA, "expiry_days": days}, indent=1,
                                                        sort_keys=True).encode() + b"\n", 0o644)
        online = {role: new_signer() for role in ONLINE_ROLES}
        for role, s in online.items():
            write_key(repo.keys_dir / f"{role}.pem", s)
        repo.metadata_dir.mkdir(parents=True)
        repo.targets_dir.mkdir(parents=True)

        root = Root(expires=_expiry(days["root"]), consistent_snapshot=True)
        for s in root_signers:
            root.add_key(s.public_key, "root")
        root.roles["root"].threshold = ROOT_THRESHOLD
        for role, s in online.items():
            root.add_key(s.public_key, role)
        root_md = Metadata(root)
        repo._sign_root(root_md, {s.public_key.keyid: s for s in root_signers}, previous=None)
        targets_md = Metadata(Targets(expires=_expiry(days["targets"])))
        repo._put_index(targets_md, ())
        repo._sign_write(targets_md, online["targets"], root_md)
        repo._resnapshot(root_md, targets_md, online["snapshot"], online["timestamp"], days)
        log.info("initialised TUF repository %s (root keys in %s)", repo.dir, offline_dir)
        return repo

    # ---- reading ------------------------------------------------------------------------
    def expiry_days(self) -> dict[str, int]:
        """The per-role expiry of ``repo.json``."""
        try:
            doc = json.loads((self.dir / REPO_FILE).read_bytes())
        except FileNotFoundError:
            raise RepoError(f"{self.dir} is not a sealfl repository (no repo.json); create one with "
                            "'sealfl repo init'") from None
        except (OSError, ValueError) as exc:
            raise RepoError(f"{self.dir / 'repo.json'}: unreadable ({exc})") from None
        if doc.get("schema") != REPO_SCHEMA or not isinstance(doc.get("expiry_days"), dict):
            raise RepoError(f"{self.dir / 'repo.json'}: not a {REPO_SCHEMA} document")
        return {**DEFAULT_EXPIRY_DAYS, **doc["expiry_days"]}

    def load(self, role: str) -> Metadata:
        """The newest metadata of ``role``."""
        path = self.metadata_dir / f"{role}.json"
        try:
            return Metadata.from_file(str(path))
        except FileNotFoundError:
            raise RepoError(f"{path} missing: {self.dir} is not an initialised repository") from None
        except Exception as exc:  # python-tuf raises several types for a damaged file
            raise RepoError(f"{path}: cannot be read as TUF metadata ({exc})") from None

    def root_bytes(self, version: int = 1) -> bytes:
        """``<version>.root.json`` (version 1 is what a device is provisioned with)."""
        try:
            return (self.metadata_dir / f"{version}.root.json").read_bytes()
        except FileNotFoundError:
            raise RepoError(f"{self.metadata_dir}/{version}.root.json missing") from None

    def releases(self) -> tuple[IndexedRelease, ...]:
        """The releases the index lists."""
        data = (self.targets_dir / self._hashed_path(self.load("targets"), INDEX_TARGET)).read_bytes()
        return parse_index(data)

    # ---- changes ------------------------------------------------------------------------
    def publish(self, files: dict[str, bytes], name: str, version: int, root_digest: str) -> PublishedRelease:
        """Add a release (``{file name: bytes}`` of its directory) as targets, update the
        index, bump targets, snapshot and timestamp.

        Raises:
            RepoError: that name and version are published already, or the files do not
                make a valid index entry (names, count).
        """
        days = self.expiry_days()
        root_md = self.load("root")
        targets_md = self.load("targets")
        current = self.releases()
        if any(r.name == name and r.version == version for r in current):
            raise RepoError(f"{name} v{version} is published already; a release version is published once")
        entry = IndexedRelease(name, version, root_digest, tuple(sorted(files)))
        try:
            index_bytes([*current, entry])
        except Exception as exc:
            raise RepoError(f"cannot publish {name} v{version}: {exc}") from None
        paths = []
        for file, data in sorted(files.items()):
            path = target_path(name, version, file)
            tf = TargetFile.from_data(path, data, ["sha256"])
            tf.unrecognized_fields["custom"] = custom_of(name, version, root_digest)
            self._store_target(path, data, tf)
            targets_md.signed.targets[path] = tf
            paths.append(path)
        self._put_index(targets_md, (*current, entry))
        self._bump(targets_md, days["targets"])
        self._sign_write(targets_md, self._online("targets"), root_md)
        self._resnapshot(root_md, targets_md, self._online("snapshot"), self._online("timestamp"), days)
        log.info("published %s v%d (%d files) as targets v%d", name, version, len(paths), targets_md.signed.version)
        return PublishedRelease(entry, tuple(paths), targets_md.signed.version)

    def publish_delta(self, files: dict[str, bytes], name: str, version: int, root_digest: str,
                      base_root_digest: str) -> PublishedRelease:
        """Add a signed delta (``{"delta.dsse.json": ..., "<patch>.hdiff": ...}``, checked by
        the caller against the trust directory) to the published release ``name`` v``version``
        as targets under :func:`~sealfl.attestation.repo_index.delta_target_path`, and re-sign
        targets, snapshot and timestamp. Devices still verify everything themselves.

        Raises:
            RepoError: the release is not published with that root digest, or that delta is
                published already.
        """
        days = self.expiry_days()
        root_md, targets_md = self.load("root"), self.load("targets")
        entry = next((r for r in self.releases() if r.name == name and r.version == version), None)
        if entry is None or entry.root_digest != root_digest:
            raise RepoError(f"publish {name} v{version} (root digest {root_digest}) before its delta")
        paths = []
        for file, data in sorted(files.items()):
            path = delta_target_path(name, version, base_root_digest, file)
            if path in targets_md.signed.targets:
                raise RepoError(f"the delta to {name} v{version} from {base_root_digest} is published already")
            tf = TargetFile.from_data(path, data, ["sha256"])
            tf.unrecognized_fields["custom"] = {"sealfl": {"delta_to": custom_of(name, version, root_digest)["sealfl"],
                                                           "base_root_digest": base_root_digest}}
            self._store_target(path, data, tf)
            targets_md.signed.targets[path] = tf
            paths.append(path)
        self._bump(targets_md, days["targets"])
        self._sign_write(targets_md, self._online("targets"), root_md)
        self._resnapshot(root_md, targets_md, self._online("snapshot"), self._online("timestamp"), days)
        log.info("published the delta to %s v%d from %s (%d files)", name, version, base_root_digest[:16], len(paths))
        return PublishedRelease(entry, tuple(paths), targets_md.signed.version)

    def refresh(self) -> int:
        """Re-sign snapshot and timestamp with fresh expiry (run more often than the
        timestamp's expiry, e.g. from a timer); return the new timestamp version."""
        days = self.expiry_days()
        root_md, targets_md = self.load("root"), self.load("targets")
        return self._resnapshot(root_md, targets_md, self._online("snapshot"), self._online("timestamp"), days)

    def rotate(self, role: str, offline_dir: str | Path, new_offline_dir: str | Path | None = None) -> int:
        """Replace ``role``'s key(s); return the new root version.

        ``timestamp``, ``snapshot``, ``targets``: a new online key; the root (signed by
        :data:`ROOT_THRESHOLD` keys of ``offline_dir``) lists it instead of the old one, and
        the role and those below it are re-signed. ``root``: three new root keys into
        ``new_offline_dir``; the new root is signed by the old threshold and the new one.

        Raises:
            RepoError: unknown role, fewer than the threshold of root keys in
                ``offline_dir``, or ``root`` without a new (empty) ``new_offline_dir``.
        """
        if role not in ROLES:
            raise RepoError(f"unknown role {role!r}; rotate one of {', '.join(ROLES)}")
        days = self.expiry_days()
        old_root = self.load("root")
        signers = read_root_keys(Path(offline_dir))
        root_md = Metadata.from_bytes(old_root.to_bytes())
        root = root_md.signed
        if role == "root":
            if new_offline_dir is None:
                raise RepoError("rotating root needs --new-offline-keys DIR for the three new root keys")
            new_signers = [new_signer() for _ in range(ROOT_KEYS)]
            for keyid in list(root.roles["root"].keyids):
                root.revoke_key(keyid, "root")
            for s in new_signers:
                root.add_key(s.public_key, "root")
            root.roles["root"].threshold = ROOT_THRESHOLD
            self._bump(root_md, days["root"])
            self._sign_root(root_md, {**signers, **{s.public_key.keyid: s for s in new_signers}}, previous=old_root)
            write_root_keys(Path(new_offline_dir), new_signers)
            log.info("rotated the root keys: root v%d", root.version)
            return root.version
        fresh = new_signer()
        for keyid in list(root.roles[role].keyids):
            root.revoke_key(keyid, role)
        root.add_key(fresh.public_key, role)
        self._bump(root_md, days["root"])
        self._sign_root(root_md, signers, previous=old_root)
        write_key(self.keys_dir / f"{role}.pem", fresh)
        targets_md = self.load("targets")
        if role == "targets":
            self._bump(targets_md, days["targets"])
            self._sign_write(targets_md, fresh, root_md)
        self._resnapshot(root_md, targets_md, self._online("snapshot"), self._online("timestamp"), days)
        log.info("rotated the %s key: root v%d", role, root.version)
        return root.version

    # ---- internals ----------------------------------------------------------------------
    def _online(self, role: str) -> Signer:
        return read_key(self.keys_dir / f"{role}.pem")

    @staticmethod
    def _bump(md: Metadata, days: int) -> None:
        md.signed.version += 1
        md.signed.expires = _expiry(days)

    def _hashed_path(self, targets_md: Metadata, path: str) -> str:
        tf = targets_md.signed.targets.get(path)
        if tf is None:
            raise RepoError(f"target {path} is not in targets v{targets_md.signed.version}")
        directory, _, base = path.rpartition("/")
        return f"{directory}/{tf.hashes['sha256']}.{base}" if directory else f"{tf.hashes['sha256']}.{base}"

    def _store_target(self, path: str, data: bytes, tf: TargetFile) -> None:
        directory, _, base = path.rpartition("/")
        out = self.targets_dir / directory / f"{tf.hashes['sha256']}.{base}"
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, data, 0o644)

    def _put_index(self, targets_md: Metadata, releases) -> None:
        data = index_bytes(releases)
        tf = TargetFile.from_data(INDEX_TARGET, data, ["sha256"])
        self._store_target(INDEX_TARGET, data, tf)
        targets_md.signed.targets[INDEX_TARGET] = tf

    def _write(self, md: Metadata) -> None:
        role = md.signed.type
        data = md.to_bytes(_SERIALIZER)
        if role == Timestamp.type:
            atomic_write(self.metadata_dir / "timestamp.json", data, 0o644)
            return
        atomic_write(self.metadata_dir / f"{md.signed.version}.{role}.json", data, 0o644)
        atomic_write(self.metadata_dir / f"{role}.json", data, 0o644)

    def _sign_root(self, root_md: Metadata, signers: dict[str, Signer], previous: Metadata | None) -> None:
        sign_root(root_md, signers, previous)
        self._write(root_md)

    def _sign_write(self, md: Metadata, signer: Signer, root_md: Metadata) -> None:
        sign_delegated(md, signer, root_md, f"{self.keys_dir}/{md.signed.type}.pem")
        self._write(md)

    def _resnapshot(self, root_md: Metadata, targets_md: Metadata, snap_signer: Signer, ts_signer: Signer,
                    days: dict[str, int]) -> int:
        try:
            snap_md = self.load("snapshot")
            self._bump(snap_md, days["snapshot"])
        except RepoError:
            if (self.metadata_dir / "snapshot.json").exists():
                raise
            snap_md = Metadata(Snapshot(expires=_expiry(days["snapshot"])))
        snap_md.signed.meta["targets.json"] = MetaFile(version=targets_md.signed.version)
        self._sign_write(snap_md, snap_signer, root_md)
        snap_bytes = snap_md.to_bytes(_SERIALIZER)
        ts_path = self.metadata_dir / "timestamp.json"
        if ts_path.exists():
            ts_md = Metadata.from_file(str(ts_path))
            self._bump(ts_md, days["timestamp"])
        else:
            ts_md = Metadata(Timestamp(expires=_expiry(days["timestamp"])))
        ts_md.signed.snapshot_meta = MetaFile(version=snap_md.signed.version, length=len(snap_bytes),
                                              hashes={"sha256": hashlib.sha256(snap_bytes).hexdigest()})
        self._sign_write(ts_md, ts_signer, root_md)
        return ts_md.signed.version
