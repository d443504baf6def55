"""The TEE abstraction every backend implements (``sim`` now, ``tpm`` on swtpm later).

The interface mirrors the TPM 2.0 operations sealfl needs (TPM 2.0 Library Part 1):
PCR extend (§17), PCR read, quote (§18.5), and seal/unseal to a PCR policy
(PolicyPCR, Part 1 §19.7). PCRs are the SHA-256 bank, 24 registers, indices 0..23.

Backends live in a module ``sealfl.enclave.tee.<backend>`` that defines ``TEE_CLASS``;
:mod:`sealfl.enclave.tee.backends` picks one by name.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from Crypto.PublicKey import ECC

from sealfl.attestation.keys import keyid, load_public_key
from sealfl.attestation.quote import DIGEST_SIZE, NUM_PCRS
from sealfl.attestation.tee_floor import FloorRecord
from sealfl.enclave.errors import TEEError

__all__ = ["TEE", "check_floor_write", "check_pcr_index", "check_pcr_digest"]

class TEE(ABC):
    """A trusted execution environment: PCRs, an attestation key (AK), sealing.

    Attributes:
        backend: backend name as written into quotes (``"sim"``, ``"tpm"``).
        insecure: True for backends that protect nothing (the ``sim`` simulation).
    """

    backend: str = ""
    insecure: bool = False

    @classmethod
    @abstractmethod
    def create(cls, state_dir: str | os.PathLike, *, role: str = "device", replace: bool = False) -> "TEE":
        """Provision a fresh TEE whose persistent state lives in ``state_dir``.

        Args:
            state_dir: the TEE's state directory (must not hold TEE state yet).
            role: ``"device"`` or ``"release-enclave"``: which handles, NV index and PCRs a
                hardware backend uses (:mod:`sealfl.enclave.tee.tpm_alloc`).
            replace: a hardware backend may replace the key another state of the same role
                left in the hardware (re-provisioning on purpose); without it, it refuses.

        Raises:
            TEEStateError: ``state_dir`` already holds TEE state, or the hardware serves
                another role or another state (without ``replace``).
        """

    @classmethod
    @abstractmethod
    def load(cls, state_dir: str | os.PathLike, *, reset_pcrs: bool = True) -> "TEE":
        """Open an existing TEE; ``reset_pcrs=True`` simulates a reboot (PCRs back to zero).

        Raises:
            TEEStateError: state missing, incomplete or with unsafe permissions.
        """

    @abstractmethod
    def extend(self, pcr: int, digest: bytes) -> None:
        """Extend PCR ``pcr`` (0..23) with a 32-byte ``digest``: ``new = SHA-256(old || digest)``.

        Raises:
            TEEError: bad index or digest size.
        """

    @abstractmethod
    def read(self, pcrs: Sequence[int]) -> dict[int, bytes]:
        """Return ``{index: 32-byte value}`` of the requested PCRs.

        Raises:
            TEEError: bad index.
        """

    @abstractmethod
    def quote(self, purpose: str, data: bytes, pcrs: Sequence[int]) -> dict:
        """Return a quote over ``pcrs`` for ``purpose`` (``"release"`` or ``"challenge"``),
        signed by the AK. The quote's qualifying data is ``SHA-256(label(purpose) || 0x00 ||
        data)``, never ``data`` itself, so a quote made for one purpose cannot pass as another.

        Format: :mod:`sealfl.attestation.quote`.

        Raises:
            TEEError: unknown purpose, ``data`` not 1..64 bytes, or bad indices.
        """

    @abstractmethod
    def seal(self, data: bytes, policy: Mapping[int, bytes] | None = None) -> bytes:
        """Encrypt ``data`` so only this TEE can unseal it, and only while every PCR in
        ``policy`` (``{index: required 32-byte value}``) holds that value. Returns an opaque blob.

        Raises:
            TEEError: bad policy.
        """

    @abstractmethod
    def unseal(self, blob: bytes) -> bytes:
        """Return the data sealed in ``blob``.

        Raises:
            UnsealError: blob modified or from another TEE, or current PCRs differ from its policy.
        """

    @abstractmethod
    def public_key(self) -> bytes:
        """The AK public key as SubjectPublicKeyInfo PEM bytes."""

    @abstractmethod
    def read_floor(self) -> FloorRecord:
        """The anti-rollback floor kept by the TEE (:mod:`sealfl.attestation.tee_floor`).

        Raises:
            TEEStateError: the TEE holds no floor record or a malformed one (re-provision).
        """

    @abstractmethod
    def write_floor(self, record: FloorRecord) -> None:
        """Store ``record`` as the TEE's floor. A backend refuses to lower the floor.

        Raises:
            TEEError: the record would lower the floor, or the TEE write failed.
        """

    def ak_public_key(self) -> ECC.EccKey:
        """The AK public key parsed as an ECC key (convenience over :meth:`public_key`)."""
        return load_public_key(self.public_key())

    def ak_keyid(self) -> str:
        """SHA-256 (hex) of the AK's DER SubjectPublicKeyInfo (:func:`sealfl.attestation.keys.keyid`)."""
        return keyid(self.ak_public_key())


def check_pcr_index(pcr: int) -> int:
    """``pcr`` if it is an int PCR index 0..23 (not a bool); else TEEError."""
    if not isinstance(pcr, int) or isinstance(pcr, bool) or not 0 <= pcr < NUM_PCRS:
        raise TEEError(f"PCR index must be an integer in 0..{NUM_PCRS - 1}, got {pcr!r}")
    return pcr


def check_pcr_digest(value: bytes, what: str) -> bytes:
    """``value`` as bytes if it is a SHA-256 digest (32 bytes); else TEEError naming ``what``."""
    if not isinstance(value, (bytes, bytearray)) or len(value) != DIGEST_SIZE:
        raise TEEError(f"{what} must be {DIGEST_SIZE} bytes (SHA-256), got {value!r:.80}")
    return bytes(value)


def check_floor_write(old: FloorRecord | None, new: FloorRecord) -> None:
    """Refuse a floor write that would lower the floor (shared by every backend).

    Raises:
        TEEError: ``new.version`` is below ``old.version``.
    """
    if old is not None and old.version is not None and (new.version is None or new.version < old.version):
        raise TEEError(f"refusing to lower the TEE rollback floor from {old.version} to {new.version}")
