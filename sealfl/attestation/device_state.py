"""The device's trusted state: its rollback floor and where its last good release is kept.

One typed, immutable object with pure transitions, as python-tuf treats its trusted
metadata: :meth:`DeviceState.from_bytes` / :meth:`DeviceState.to_bytes` convert to and from
``state.json``, :meth:`DeviceState.check` is the version decision a release must pass, and
:meth:`DeviceState.accept` returns the state after a release was booted. Disk I/O (and
crash consistency) is the caller's job (:mod:`sealfl.enclave.device.slots`).

``state.json`` (schema ``sealfl.device-state/v2``)::

    {"schema": "sealfl.device-state/v2",
     "last_good": {"name": str, "version": int,        # 0..2**31-1: the rollback floor
                   "root_digest": hex, "statement_digest": hex,
                   "slot": "slots/<name>",              # the device's copy, relative to the state dir
                   "source_dir": str,                   # where it was installed from (informational)
                   "model_file": str}}                  # payload file run by the device

A device that has accepted nothing yet has no ``state.json`` (``DeviceState()``). The reader also takes
``sealfl.device-state/v1`` (``release_dir`` instead of ``slot``, no ``statement_digest``);
for such a state the same-version check compares root digests.

Version decision (:meth:`DeviceState.check`), for a release of version ``v``:

* ``v >= policy min_version`` (check ``version``);
* ``v >= last_good.version`` (check ``rollback``);
* ``v == last_good.version`` only for the very same signed release (same statement
  digest), i.e. a re-boot (check ``rollback``);
* ``v - last_good.version <= policy max_version_step`` (check ``version``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sealfl.attestation.canonical import JSONFormatError, canonical_json, loads_strict
from sealfl.attestation.errors import DeviceStateError, ManifestError, VerificationError
from sealfl.attestation.manifest import MANIFEST_FILE, check_name_version, validate_path
from sealfl.common.fields import MAX_VERSION, Fields

if TYPE_CHECKING:  # pragma: no cover
    from sealfl.attestation.trust import TrustAnchors

__all__ = ["STATE_FILE", "STATE_SCHEMA", "STATE_SCHEMA_V1", "SLOTS_DIR", "LastGood", "DeviceState",
           "check_slot_path"]

STATE_FILE = "state.json"
STATE_SCHEMA = "sealfl.device-state/v2"
STATE_SCHEMA_V1 = "sealfl.device-state/v1"
SLOTS_DIR = "slots"
_SLOT = re.compile(r"\Aslots/[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_LAST_GOOD_V2 = ("name", "version", "root_digest", "statement_digest", "slot", "source_dir", "model_file")
_LAST_GOOD_V1 = ("name", "version", "root_digest", "release_dir", "source_dir", "model_file")


def _state_error(msg: str) -> DeviceStateError:
    return DeviceStateError(f"{msg}; the device will not boot without its rollback state: restore "
                            f"{STATE_FILE} from a backup or re-provision the device")


def check_slot_path(slot: Any) -> str:
    """Check a slot path: ``"slots/<name>"`` with one plain name segment (no ``..``, no ``/``,
    not hidden), so a state file can never point the device at a directory outside its slots.

    Raises:
        DeviceStateError: any other value.
    """
    if not isinstance(slot, str) or not _SLOT.match(slot):
        raise DeviceStateError(f"slot path {slot!r:.80} is not 'slots/<name>'")
    return slot


@dataclass(frozen=True)
class LastGood:
    """The last release this device booted and recorded.

    Attributes:
        name: release name.
        version: release version (0..2**31-1) -- the device's rollback floor.
        root_digest: manifest root digest, lowercase hex.
        statement_digest: SHA-256 of the signed statement, lowercase hex (None only when read
            from a v1 state file).
        slot: the device's private copy, ``"slots/<name>"`` relative to the state directory.
        source_dir: the directory it was installed from (informational).
        model_file: payload file name the device runs.
    """

    name: str
    version: int
    root_digest: str
    statement_digest: str | None
    slot: str
    source_dir: str
    model_file: str


@dataclass(frozen=True)
class DeviceState:
    """A device's trusted state (see module docstring). ``DeviceState()`` is a fresh device.

    Attributes:
        last_good: the last good release, or None on a fresh device.
    """

    last_good: LastGood | None = None

    @property
    def floor(self) -> int | None:
        """Lowest version the device accepts next (the last good version), or None."""
        return None if self.last_good is None else self.last_good.version

    # -- bytes -------------------------------------------------------------------------

    @classmethod
    def from_bytes(cls, data: bytes) -> "DeviceState":
        """Parse ``state.json`` bytes (schema v2, or v1 written by earlier sealfl).

        Raises:
            DeviceStateError: not strict JSON, unknown schema, or a field missing, unknown
                or of the wrong type or range; the message names ``state.json`` and the field.
        """
        try:
            doc = loads_strict(data)
        except JSONFormatError as exc:
            raise _state_error(f"{STATE_FILE} is not strict JSON: {exc}") from exc
        fields = Fields(STATE_FILE, _state_error)
        schema = fields.get(doc, "schema", "choice", choices=(STATE_SCHEMA, STATE_SCHEMA_V1))
        fields.only(doc, ("schema", "last_good"))
        raw = fields.get(doc, "last_good", "object")
        keys = _LAST_GOOD_V2 if schema == STATE_SCHEMA else _LAST_GOOD_V1
        for key in keys:
            if key not in raw:
                raise fields.fail(fields.join("last_good", key), "is missing")
        fields.only(raw, keys, "last_good")
        check_name_version(raw["name"], raw["version"], fields, "last_good")
        root = fields.get(raw, "root_digest", "hex64", "last_good")
        statement = fields.get(raw, "statement_digest", "hex64", "last_good") if schema == STATE_SCHEMA else None
        slot_key = "slot" if schema == STATE_SCHEMA else "release_dir"
        slot = fields.get(raw, slot_key, "string", "last_good")
        try:
            check_slot_path(slot)
        except DeviceStateError as exc:
            raise fields.fail(fields.join("last_good", slot_key), str(exc)) from exc
        source = fields.get(raw, "source_dir", "string", "last_good", nonempty=False)
        model = fields.get(raw, "model_file", "string", "last_good")
        try:
            validate_path(model)
        except ManifestError as exc:
            raise fields.fail("last_good.model_file", str(exc)) from exc
        return cls(LastGood(name=raw["name"], version=raw["version"], root_digest=root,
                            statement_digest=statement, slot=slot, source_dir=source, model_file=model))

    def to_bytes(self) -> bytes:
        """Serialise to ``state.json`` bytes (schema v2, canonical JSON + newline).

        Raises:
            DeviceStateError: a fresh state (nothing accepted yet has no ``state.json``).
        """
        last = self.last_good
        if last is None:
            raise DeviceStateError("a fresh device state has no state.json; accept a release first")
        doc: dict[str, Any] = {"schema": STATE_SCHEMA, "last_good": {
            "name": last.name, "version": last.version, "root_digest": last.root_digest,
            "statement_digest": last.statement_digest, "slot": last.slot, "source_dir": last.source_dir,
            "model_file": last.model_file}}
        return canonical_json(doc) + b"\n"

    # -- transitions -------------------------------------------------------------------

    def check(self, version: int, root_digest: str, statement_digest: str, trust: "TrustAnchors") -> None:
        """The version decision for a release (rules in the module docstring). Pure.

        Args:
            version: the release's signed version.
            root_digest: its signed root digest (hex).
            statement_digest: SHA-256 of its signed statement (hex).
            trust: the pinned policy (``min_version``, ``max_version_step``).

        Raises:
            VerificationError: ``manifest.json`` failed ``version`` or ``rollback``.
        """
        if version < trust.min_version:
            raise VerificationError(MANIFEST_FILE, "version",
                                    f"version {version} < pinned minimum version {trust.min_version}")
        last = self.last_good
        if last is None:
            return
        if version < last.version:
            raise VerificationError(MANIFEST_FILE, "rollback",
                                    f"version {version} < last version run on this device ({last.version})")
        if version == last.version:
            same = (statement_digest == last.statement_digest if last.statement_digest is not None
                    else root_digest == last.root_digest)
            if not same:
                raise VerificationError(
                    MANIFEST_FILE, "rollback",
                    f"version {version} already ran on this device as another signed release "
                    f"(root digest {last.root_digest[:16]}…); a different release must carry a higher version")
        if version - last.version > trust.max_version_step:
            raise VerificationError(
                MANIFEST_FILE, "version",
                f"version {version} jumps {version - last.version} above the last version run on this device "
                f"({last.version}); policy.json allows at most max_version_step = {trust.max_version_step}")

    def accept(self, *, name: str, version: int, root_digest: str, statement_digest: str, slot: str,
               source_dir: str, model_file: str) -> "DeviceState":
        """The state after the device booted this release from ``slot``. Pure.

        The arguments are those of a release that passed :meth:`check` (normally the fields
        of a :class:`~sealfl.attestation.release.VerifiedRelease`).

        Raises:
            DeviceStateError: the release would lower the floor or replace the release at the
                same version (it did not pass :meth:`check`), or a field is out of range.
        """
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
            raise DeviceStateError(f"version {version!r} is not an integer in 0..{MAX_VERSION}")
        last = self.last_good
        if last is not None and (version < last.version or (
                version == last.version and last.statement_digest not in (None, statement_digest))):
            raise DeviceStateError(f"refusing to record version {version} over last good version {last.version}: "
                                   "the release did not pass DeviceState.check")
        new = DeviceState(LastGood(name=name, version=version, root_digest=root_digest,
                                   statement_digest=statement_digest, slot=check_slot_path(slot),
                                   source_dir=source_dir, model_file=model_file))
        DeviceState.from_bytes(new.to_bytes())  # every field must survive a round trip
        return new
