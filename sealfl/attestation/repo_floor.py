"""The device's repository floor and how it moves with TUF root rotation. Pure; no I/O.

Beside the rollback floor of the running release (``state.json`` and the TEE,
:mod:`.device_state`, :mod:`.tee_floor`: only a verified, booted release raises it), a
device updating from a TUF repository keeps a **repository floor**: the highest version of
the release name it follows that a trusted release index ever offered, *anchored* to the
TUF root that was trusted then (its version and the SHA-256 of its bytes; the root and
targets keys that vouched for that index are the ones this root lists).

``STATE/repo-floor.json`` (schema ``sealfl.repo-floor/v1``)::

    {"schema": "sealfl.repo-floor/v1", "name": str, "version": int,
     "root_version": int, "root_sha256": hex}

It refuses an index whose newest release is below a version the same keys offered before
(an index that hides a release). A floor raised by keys that are later revoked may be a
fast-forward (a stolen targets key listing ``v999``): the TUF specification recovers from
that by forgetting the trusted versions vouched for by rotated keys (5.3.11), and so does
:func:`decide_floor`, over the root chain python-tuf accepted (``STATE/tuf/root_history``):

* **refuse** (check ``chain``): the chain does not start at the floor's own root (same
  version, same bytes) or does not step version by version with each root signed by the
  threshold of its predecessor and of itself -- a re-base without a valid root chain;
* **keep**: every root and targets key the floor's root listed is still listed by the
  newest root: the floor stays (raised to the offered version if higher, re-anchored to
  the newest root); an offered version below it is refused (check ``rollback``);
* **rebase**: the newest root no longer lists a root or targets key of the floor's root:
  the floor becomes the version the newest root's targets offer, anchored to the newest
  root -- but never below the version the device runs (that is refused, check
  ``rollback``: the device keeps running what it runs).

The running release is never touched by a decision: a refusal keeps it running.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from tuf.api.metadata import Metadata, Root

from sealfl.attestation.errors import DeviceStateError
from sealfl.common.fields import MAX_VERSION

__all__ = ["REPO_FLOOR_FILE", "REPO_FLOOR_SCHEMA", "RepoFloor", "FloorDecision", "decide_floor"]

REPO_FLOOR_FILE = "repo-floor.json"
REPO_FLOOR_SCHEMA = "sealfl.repo-floor/v1"
_FIELDS = ("schema", "name", "version", "root_version", "root_sha256")
#: the roles whose keys vouch for a release index (timestamp and snapshot keys only vouch for freshness)
_ANCHOR_ROLES = ("root", "targets")


def _version_ok(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_VERSION


@dataclass(frozen=True)
class RepoFloor:
    """The repository floor (module docstring).

    Attributes:
        name: the release name it applies to.
        version: the highest version of ``name`` a trusted index offered.
        root_version: the TUF root version trusted when it was set.
        root_sha256: hex SHA-256 of that root's bytes (``root_history/<v>.root.json``).
    """

    name: str
    version: int
    root_version: int
    root_sha256: str

    @classmethod
    def from_bytes(cls, data: bytes) -> "RepoFloor":
        """Parse ``repo-floor.json``.

        Raises:
            DeviceStateError: not JSON, another schema, or a field missing, extra or of the
                wrong type (the message names the file and the field).
        """
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise DeviceStateError(f"{REPO_FLOOR_FILE} is not JSON: {str(exc)[:120]}") from None
        if not isinstance(doc, dict) or sorted(doc) != sorted(_FIELDS):
            raise DeviceStateError(f"{REPO_FLOOR_FILE} must be an object with exactly {', '.join(_FIELDS)}")
        if doc["schema"] != REPO_FLOOR_SCHEMA:
            raise DeviceStateError(f"{REPO_FLOOR_FILE}: schema must be {REPO_FLOOR_SCHEMA!r}")
        if not isinstance(doc["name"], str) or not doc["name"]:
            raise DeviceStateError(f"{REPO_FLOOR_FILE}: name must be a non-empty string")
        for key in ("version", "root_version"):
            if not _version_ok(doc[key]):
                raise DeviceStateError(f"{REPO_FLOOR_FILE}: {key} must be an integer 0..{MAX_VERSION}")
        digest = doc["root_sha256"]
        if not isinstance(digest, str) or len(digest) != 64 or digest.strip("0123456789abcdef"):
            raise DeviceStateError(f"{REPO_FLOOR_FILE}: root_sha256 must be 64 lowercase hex digits")
        return cls(doc["name"], doc["version"], doc["root_version"], digest)

    def to_bytes(self) -> bytes:
        """Serialise (sorted keys, newline)."""
        return json.dumps({"schema": REPO_FLOOR_SCHEMA, "name": self.name, "version": self.version,
                           "root_version": self.root_version, "root_sha256": self.root_sha256},
                          sort_keys=True).encode() + b"\n"


@dataclass(frozen=True)
class FloorDecision:
    """What :func:`decide_floor` decided.

    Attributes:
        action: ``"keep"``, ``"rebase"`` or ``"refuse"``.
        reason: one sentence saying why (logged and recorded in ``update.json``).
        floor: the record to store (``keep``/``rebase``), None for ``refuse``.
        check: for ``refuse``, ``"chain"`` (no valid root chain) or ``"rollback"``.
    """

    action: str
    reason: str
    floor: RepoFloor | None = None
    check: str | None = None


@dataclass(frozen=True)
class _Anchor:
    """A trusted root (version, SHA-256 of its bytes) a floor is anchored to."""

    version: int
    sha256: str

    def floor(self, name: str, version: int) -> RepoFloor:
        """The floor ``name`` v``version`` anchored here."""
        return RepoFloor(name, version, self.version, self.sha256)


class _Refused(Exception):
    pass


def _parse_root(data: bytes, where: str) -> Metadata:
    try:
        md = Metadata.from_bytes(data)
    except Exception as exc:  # python-tuf raises several types for bytes that are not root metadata
        raise _Refused(f"{where} is not TUF metadata ({type(exc).__name__})") from None
    if not isinstance(md.signed, Root):
        raise _Refused(f"{where} is {md.signed.type} metadata, not a root")
    return md


def _check_chain(floor: RepoFloor | None, chain: Sequence[bytes]) -> list[Metadata]:
    if not chain:
        raise _Refused("no trusted root was given")
    roots = [_parse_root(data, f"root #{i + 1} of the chain") for i, data in enumerate(chain)]
    if floor is not None:
        first = roots[0].signed.version
        if first != floor.root_version or hashlib.sha256(chain[0]).hexdigest() != floor.root_sha256:
            raise _Refused(f"the chain starts at root v{first}, not at the root v{floor.root_version} the floor was "
                           "anchored to (other bytes or another version)")
    for prev, cur in zip(roots, roots[1:]):
        want = prev.signed.version + 1
        if cur.signed.version != want:
            raise _Refused(f"root v{cur.signed.version} follows root v{prev.signed.version} (expected v{want})")
        for signer, label in ((prev, f"v{prev.signed.version}"), (cur, f"v{cur.signed.version} itself")):
            try:
                signer.signed.verify_delegate(Root.type, cur.signed_bytes, cur.signatures)
            except Exception as exc:  # UnsignedMetadataError, or a malformed key
                raise _Refused(f"root v{cur.signed.version} is not signed by the root threshold of {label} "
                               f"({type(exc).__name__})") from None
    return roots


def _anchor_keys(root: Root) -> dict[str, set[str]]:
    return {role: set(root.roles[role].keyids) for role in _ANCHOR_ROLES}


def decide_floor(floor: RepoFloor | None, chain: Sequence[bytes], name: str, offered_version: int,
                 running_version: int | None) -> FloorDecision:
    """Keep, re-base or refuse the repository floor for an offered release (module docstring).

    Args:
        floor: the stored floor, or None (none yet, or it names another release).
        chain: root metadata bytes from the floor's root version up to the root python-tuf
            trusts now, one per version in order (with ``floor`` None: the current root alone).
        name: the release name followed.
        offered_version: the newest version of ``name`` the trusted index offers.
        running_version: the version the device runs, or None.

    Returns:
        a :class:`FloorDecision`; never raises for bad input (a malformed chain is a refusal).
    """
    if floor is not None and floor.name != name:
        floor = None
    try:
        roots = _check_chain(floor, chain if floor is not None else chain[-1:])
    except _Refused as exc:
        return FloorDecision("refuse", f"no valid root chain from the floor's root: {exc}", check="chain")
    newest = roots[-1]
    anchored = _Anchor(newest.signed.version, hashlib.sha256(chain[-1]).hexdigest())
    if floor is None:
        version = max(offered_version, running_version or 0)
        return FloorDecision("keep", f"first floor for {name}: v{version} under root v{anchored.version}",
                             anchored.floor(name, version))
    old, new = _anchor_keys(roots[0].signed), _anchor_keys(newest.signed)
    gone = sorted(f"{role} key {k[:12]}" for role in _ANCHOR_ROLES for k in old[role] - new[role])
    if not gone:
        if offered_version < floor.version:
            return FloorDecision("refuse", f"the repository's newest {name} is v{offered_version}, but the same keys "
                                 f"offered v{floor.version} before (an index that hides a release)", check="rollback")
        return FloorDecision("keep", f"the keys that set the floor v{floor.version} are still listed",
                             anchored.floor(name, max(floor.version, offered_version)))
    if running_version is not None and offered_version < running_version:
        return FloorDecision("refuse", f"root v{anchored.version} no longer lists {', '.join(gone)}, but its targets "
                             f"offer {name} v{offered_version}, below the running v{running_version}: a floor is "
                             "never re-based below what the device runs", check="rollback")
    return FloorDecision("rebase", f"the floor v{floor.version} was set under root v{floor.root_version}, whose "
                         f"{', '.join(gone)} root v{anchored.version} no longer lists: re-based to v{offered_version} "
                         "offered by the new root's targets", anchored.floor(name, offered_version))

