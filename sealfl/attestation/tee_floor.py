"""The anti-rollback floor a device keeps *inside its TEE*. Pure; no I/O.

``state.json`` (:mod:`sealfl.attestation.device_state`) is a file: deleting it or restoring
an old copy would lower the device's rollback floor. So the floor is also kept by the TEE
-- in a TPM NV index on ``tpm`` (:mod:`sealfl.enclave.tee.tpm`), in a record sealed by the TEE
on ``sim`` -- as one fixed-size record (all integers big-endian)::

    magic       4 bytes  b"SFLF"
    format      u8       1
    has_floor   u8       0 (nothing booted yet) or 1
    version     u32      the floor: lowest version the device may boot (0 if has_floor=0)
    statement   32 bytes SHA-256 of the signed statement of the release at the floor
    ak_keyid    32 bytes SHA-256 of the DER SubjectPublicKeyInfo of the AK the record
                         belongs to (:func:`sealfl.attestation.keys.keyid`)

Decisions (pure transitions of :class:`FloorRecord`):

* :meth:`~FloorRecord.check_owner` -- the record belongs to this TEE's AK; otherwise the
  TEE state was replaced (another device's or a re-created key) and the device refuses to
  boot until re-provisioned on purpose.
* :meth:`~FloorRecord.check` -- a release of version ``v`` needs ``v > floor``, or
  ``v == floor`` with the floor's very statement (a re-boot).
* :meth:`~FloorRecord.raised` -- the record after booting a release (never lower).
* :meth:`~FloorRecord.rebound` -- the record after an on-purpose re-provisioning (new AK,
  same floor: provisioning never lowers it).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from sealfl.attestation.errors import DeviceStateError, VerificationError
from sealfl.attestation.manifest import MANIFEST_FILE
from sealfl.common.fields import MAX_VERSION

__all__ = ["FLOOR_MAGIC", "FLOOR_RECORD_SIZE", "FloorRecord"]

FLOOR_MAGIC = b"SFLF"
_FORMAT = 1
_LAYOUT = struct.Struct(">4sBBI32s32s")
#: Size of a serialised :class:`FloorRecord` in bytes (74).
FLOOR_RECORD_SIZE = _LAYOUT.size
_HEX64 = re.compile(r"\A[0-9a-f]{64}\Z")


def _hex64(value: object, what: str) -> str:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise DeviceStateError(f"TEE floor record: {what} must be 64 lowercase hex digits, got {value!r:.80}")
    return value


@dataclass(frozen=True)
class FloorRecord:
    """The TEE-held anti-rollback floor (layout and rules in the module docstring).

    Attributes:
        ak_keyid: keyid (hex) of the attestation key the record belongs to.
        version: the floor version (0..2**31-1), or None if the device booted nothing yet.
        statement_digest: hex SHA-256 of the statement of the release at the floor, or None.
    """

    ak_keyid: str
    version: int | None = None
    statement_digest: str | None = None

    def __post_init__(self) -> None:
        _hex64(self.ak_keyid, "ak_keyid")
        if (self.version is None) != (self.statement_digest is None):
            raise DeviceStateError("TEE floor record: version and statement digest must both be set or both unset")
        if self.version is not None:
            if not isinstance(self.version, int) or isinstance(self.version, bool) or not 0 <= self.version <= MAX_VERSION:
                raise DeviceStateError(f"TEE floor record: version {self.version!r} is not in 0..{MAX_VERSION}")
            _hex64(self.statement_digest, "statement digest")

    @classmethod
    def from_bytes(cls, data: bytes) -> "FloorRecord":
        """Parse a record read from the TEE.

        Raises:
            DeviceStateError: wrong size, magic, format or flag (the TEE state is not sealfl's
                or is damaged: re-provision the device).
        """
        if not isinstance(data, (bytes, bytearray)) or len(data) != FLOOR_RECORD_SIZE:
            raise DeviceStateError(f"TEE floor record must be {FLOOR_RECORD_SIZE} bytes, got "
                                   f"{len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__}; "
                                   "re-provision the device (sealfl device provision --force)")
        magic, fmt, has, version, statement, keyid = _LAYOUT.unpack(bytes(data))
        if magic != FLOOR_MAGIC or fmt != _FORMAT or has not in (0, 1):
            raise DeviceStateError("TEE floor record has a wrong magic, format or flag; it was not written by "
                                   "sealfl: re-provision the device (sealfl device provision --force)")
        if has == 0:
            return cls(keyid.hex())
        return cls(keyid.hex(), version, statement.hex())

    def to_bytes(self) -> bytes:
        """Serialise to :data:`FLOOR_RECORD_SIZE` bytes."""
        has = self.version is not None
        return _LAYOUT.pack(FLOOR_MAGIC, _FORMAT, int(has), self.version if has else 0,
                            bytes.fromhex(self.statement_digest) if has else b"\0" * 32, bytes.fromhex(self.ak_keyid))

    def check_owner(self, ak_keyid: str) -> None:
        """Raise unless the record belongs to the AK ``ak_keyid``.

        Raises:
            DeviceStateError: it belongs to another AK (TEE state replaced or copied from
                another device).
        """
        if self.ak_keyid != ak_keyid:
            raise DeviceStateError(
                f"the TEE's rollback floor belongs to attestation key {self.ak_keyid[:16]}…, not to this TEE's key "
                f"{ak_keyid[:16]}…: the TEE state was replaced; re-provision the device on purpose "
                "(sealfl device provision --force) after finding out why")

    def check(self, version: int, statement_digest: str) -> None:
        """The floor decision for a release of ``version`` with that statement digest.

        Raises:
            VerificationError: ``manifest.json`` fails ``rollback`` (below the floor, or at
                the floor with another statement).
        """
        if self.version is None:
            return
        if version < self.version:
            raise VerificationError(MANIFEST_FILE, "rollback",
                                    f"version {version} < the rollback floor kept in the device TEE ({self.version}); "
                                    "a missing or restored state.json cannot lower it")
        if version == self.version and statement_digest != self.statement_digest:
            raise VerificationError(MANIFEST_FILE, "rollback",
                                    f"version {version} is the TEE floor but another signed release booted at it "
                                    f"(statement {str(self.statement_digest)[:16]}…); a new release needs a higher version")

    def raised(self, version: int, statement_digest: str) -> "FloorRecord":
        """The record after booting that release: the higher of the two floors."""
        if self.version is not None and version <= self.version:
            return self
        return FloorRecord(self.ak_keyid, version, statement_digest)

    def rebound(self, ak_keyid: str) -> "FloorRecord":
        """The record for a new AK (on-purpose re-provisioning); the floor is kept."""
        return FloorRecord(ak_keyid, self.version, self.statement_digest)
