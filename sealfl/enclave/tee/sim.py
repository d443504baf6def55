"""``SimTEE``: an INSECURE in-process TEE simulation for tests and development.

It implements :class:`sealfl.enclave.tee.interface.TEE` faithfully enough to exercise every trust
decision -- 24 SHA-256 PCRs starting at zero, TPM 2.0 Part 1 §17 extend, quotes signed
by an ECDSA P-256 attestation key, AES-256-GCM sealing bound to a PCR policy -- but every
secret sits in ordinary files (mode 0600) that anyone with the state directory can read.
A ``sim`` quote proves nothing; devices accept it only if their policy says
``allow_insecure_sim: true``.

State directory (mode 0700)::

    tee.json    {"backend": "sim", "format": 1}
    ak.pem      AK private key, PKCS#8 PEM, mode 0600
    seal.key    32-byte AES-256 sealing key, mode 0600
    pcrs.json   current PCR values {"0": hex, ..., "23": hex}, mode 0600
    floor.seal  the anti-rollback floor record (:mod:`sealfl.attestation.tee_floor`),
                sealed by this TEE (no PCR policy), mode 0600. Deleting it makes the
                device refuse to boot; restoring an older copy would lower the floor --
                the simulation protects nothing, the ``tpm`` backend keeps it in NV.

``tee.json`` and ``pcrs.json`` are parsed strictly and every field is type-checked: a
malformed one is a :class:`TEEStateError` naming the file and the field.

PCR values persist across :meth:`SimTEE.load` only with ``reset_pcrs=False``; the default
``reset_pcrs=True`` simulates a reboot (TPM2_Startup(CLEAR): all PCRs back to zero).

Sealed blob: :mod:`sealfl.enclave.tee.sealed_blob` (AES-256-GCM under ``seal.key``) with header
``{"alg": "AES-256-GCM", "bank": "sha256", "policy": {"<index>": hex}}``, authenticated, so
the policy cannot be altered without failing authentication.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from Crypto.Random import get_random_bytes

from sealfl.attestation import keys as _keys
from sealfl.attestation.canonical import JSONFormatError, canonical_json, loads_strict, parse_object
from sealfl.attestation.errors import AttestationError
from sealfl.attestation.quote import NUM_PCRS, ZERO_PCR, make_quote, parse_pcr_map
from sealfl.attestation.quote import extend as _extend
from sealfl.attestation.tee_floor import FloorRecord
from sealfl.common.fields import Fields
from sealfl.common.fsutil import atomic_write, check_private_file, ensure_private_dir
from sealfl.enclave.errors import TEEError, TEEStateError, UnsealError
from sealfl.enclave.tee.interface import TEE, check_floor_write
from sealfl.enclave.tee.interface import check_pcr_digest as _check_digest
from sealfl.enclave.tee.interface import check_pcr_index as _check_index
from sealfl.enclave.tee.sealed_blob import open_blob, seal_blob, split_blob

__all__ = ["SimTEE", "TEE_CLASS"]

log = logging.getLogger(__name__)

_MAGIC = b"SEALFL-SIMSEAL/1\n"
_STATE_FILES = ("tee.json", "ak.pem", "seal.key", "pcrs.json")
_FLOOR_FILE = "floor.seal"
_FORMAT = 1


def _parse_tee_json(data: bytes, root: Path) -> None:
    fields = Fields(str(root / "tee.json"), TEEStateError)
    meta = parse_object(data, fields)
    fields.only(meta, ("backend", "format"))
    if fields.get(meta, "backend", "string") != "sim":
        raise fields.fail("backend", f"is {meta['backend']!r:.40}, not 'sim'")
    fields.get(meta, "format", "integer", lo=_FORMAT, hi=_FORMAT)


def _parse_pcrs_json(data: bytes, root: Path) -> list[bytes]:
    fields = Fields(str(root / "pcrs.json"), TEEStateError)
    try:
        saved = loads_strict(data)
    except JSONFormatError as exc:
        raise fields.fail("", f"is not strict JSON: {exc}") from exc
    values = parse_pcr_map(saved, fields, "")
    missing = [i for i in range(NUM_PCRS) if i not in values]
    if missing:
        raise fields.fail(str(missing[0]), "is missing (every PCR 0..23 must be recorded)")
    return [bytes.fromhex(values[i]) for i in range(NUM_PCRS)]


class SimTEE(TEE):
    """INSECURE simulated TEE (see module docstring). Use :meth:`create` / :meth:`load`."""

    backend = "sim"
    insecure = True

    def __init__(self, state_dir: Path, ak_pem: bytes, seal_key: bytes, pcrs: list[bytes]) -> None:
        """Internal; use :meth:`create` or :meth:`load`."""
        self._dir = Path(state_dir)
        self._ak = _keys.load_private_key(ak_pem)
        self._seal_key = seal_key
        self._pcrs = pcrs
        log.warning(
            "SimTEE in %s is an INSECURE simulation: keys are plain files and quotes prove nothing; "
            "use the 'tpm' backend for anything but tests ('device provision --tee tpm' for a device, "
            "'consortium create --tee tpm' for a release enclave)", self._dir,
        )

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        """The state directory of this TEE."""
        return self._dir

    @classmethod
    def create(cls, state_dir: str | os.PathLike, *, role: str = "device", replace: bool = False) -> "SimTEE":
        """Provision a new simulated TEE in ``state_dir`` (created with mode 0700). ``role``
        and ``replace`` change nothing: every simulated TEE is its own (no shared hardware).

        Raises:
            TEEStateError: ``state_dir`` already holds SimTEE state.
        """
        root = Path(state_dir)
        if any((root / name).exists() for name in _STATE_FILES):
            raise TEEStateError(f"{root} already holds TEE state; use SimTEE.load or pick an empty directory")
        ensure_private_dir(root)
        ak_pem = _keys.private_key_to_pem(_keys.generate_key())
        seal_key = get_random_bytes(32)
        pcrs = [ZERO_PCR] * NUM_PCRS
        atomic_write(root / "ak.pem", ak_pem, 0o600)
        atomic_write(root / "seal.key", seal_key, 0o600)
        tee = cls(root, ak_pem, seal_key, pcrs)
        tee._save_pcrs()
        tee.write_floor(FloorRecord(tee.ak_keyid()))
        atomic_write(root / "tee.json", canonical_json({"backend": "sim", "format": _FORMAT}), 0o600)
        return tee

    @classmethod
    def load(cls, state_dir: str | os.PathLike, *, reset_pcrs: bool = True) -> "SimTEE":
        """Open the simulated TEE in ``state_dir``.

        Args:
            state_dir: directory written by :meth:`create`.
            reset_pcrs: True (default) simulates a reboot -- every PCR is zero again;
                False restores the persisted PCR values (same "boot").

        Raises:
            TEEStateError: files missing, unreadable, malformed, or group/other-accessible.
        """
        root = Path(state_dir)
        try:
            for name in _STATE_FILES:
                if not check_private_file(root / name):
                    raise TEEStateError(f"{root / name} is accessible by group/others; chmod 600 it")
            meta = (root / "tee.json").read_bytes()
            ak_pem = (root / "ak.pem").read_bytes()
            seal_key = (root / "seal.key").read_bytes()
            saved = (root / "pcrs.json").read_bytes()
        except OSError as exc:
            raise TEEStateError(f"cannot load SimTEE state from {root}: {exc}") from exc
        _parse_tee_json(meta, root)
        if len(seal_key) != 32:
            raise TEEStateError(f"{root / 'seal.key'} is not a 32-byte AES-256 key")
        pcrs = [ZERO_PCR] * NUM_PCRS if reset_pcrs else _parse_pcrs_json(saved, root)
        try:
            tee = cls(root, ak_pem, seal_key, pcrs)
        except AttestationError as exc:
            raise TEEStateError(f"{root / 'ak.pem'}: {exc}") from exc
        if reset_pcrs:
            tee._save_pcrs()
        return tee

    def _save_pcrs(self) -> None:
        atomic_write(
            self._dir / "pcrs.json",
            canonical_json({str(i): v.hex() for i, v in enumerate(self._pcrs)}),
            0o600,
        )

    # -- TEE interface ---------------------------------------------------------------

    def extend(self, pcr: int, digest: bytes) -> None:
        """See :meth:`TEE.extend`. Persists the new PCR values."""
        index = _check_index(pcr)
        self._pcrs[index] = _extend(self._pcrs[index], _check_digest(digest, "extend digest"))
        self._save_pcrs()
        log.debug("sim PCR %d extended -> %s", index, self._pcrs[index].hex())

    def read(self, pcrs: Sequence[int]) -> dict[int, bytes]:
        """See :meth:`TEE.read`."""
        return {_check_index(i): self._pcrs[i] for i in pcrs}

    def quote(self, purpose: str, data: bytes, pcrs: Sequence[int]) -> dict:
        """See :meth:`TEE.quote`; ``backend`` is ``"sim"``."""
        try:
            return make_quote("sim", self.read(pcrs), purpose, data, lambda msg: _keys.sign(self._ak, msg))
        except AttestationError as exc:
            raise TEEError(f"cannot produce quote: {exc}") from exc

    def read_floor(self) -> FloorRecord:
        """See :meth:`TEE.read_floor`; unseals ``floor.seal``."""
        path = self._dir / _FLOOR_FILE
        try:
            blob = path.read_bytes()
        except OSError as exc:
            raise TEEStateError(f"{path}: the TEE's rollback floor is missing ({exc.strerror or exc}); the TEE "
                                "state is incomplete: re-provision the device on purpose "
                                "(sealfl device provision --force)") from exc
        try:
            return FloorRecord.from_bytes(self.unseal(blob))
        except (UnsealError, AttestationError) as exc:
            raise TEEStateError(f"{path}: {exc}; the TEE state is damaged or from another device: "
                                "re-provision the device on purpose (sealfl device provision --force)") from exc

    def write_floor(self, record: FloorRecord) -> None:
        """See :meth:`TEE.write_floor`."""
        path = self._dir / _FLOOR_FILE
        check_floor_write(self.read_floor() if path.exists() else None, record)
        atomic_write(path, self.seal(record.to_bytes()), 0o600)

    def public_key(self) -> bytes:
        """See :meth:`TEE.public_key`."""
        return _keys.public_key_to_pem(self._ak)

    def seal(self, data: bytes, policy: Mapping[int, bytes] | None = None) -> bytes:
        """See :meth:`TEE.seal`; blob format in :mod:`sealfl.enclave.tee.sealed_blob`."""
        pol = {
            str(_check_index(i)): _check_digest(v, f"policy value of PCR {i}").hex()
            for i, v in sorted((policy or {}).items())
        }
        return seal_blob(_MAGIC, {"alg": "AES-256-GCM", "bank": "sha256", "policy": pol}, self._seal_key, data)

    def unseal(self, blob: bytes) -> bytes:
        """See :meth:`TEE.unseal`. Authenticates the blob first, then checks the PCR policy."""
        parts = split_blob(blob, _MAGIC, "SimTEE sealed blob")
        data = open_blob(parts, self._seal_key,
                         "sealed blob failed authentication: it was modified or sealed by another TEE")
        try:
            policy = loads_strict(parts.header)["policy"]
        except (JSONFormatError, KeyError) as exc:  # authenticated, so only our own bug
            raise UnsealError(f"sealed blob header is malformed: {exc}") from exc
        mismatched = [int(i) for i, v in policy.items() if self._pcrs[int(i)].hex() != v]
        if mismatched:
            raise UnsealError(
                f"PCR policy not satisfied: PCR(s) {sorted(mismatched)} differ from the values the "
                "data was sealed to (the measured code or boot state changed); re-provision the secret"
            )
        return data


#: Backend registry hook used by :func:`sealfl.enclave.tee.interface.backend_class`.
TEE_CLASS = SimTEE
