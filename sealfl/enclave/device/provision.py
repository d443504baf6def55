"""Device TEE provisioning and opening: the only place a device gets a new attestation key.

``state_dir/tee`` holds the TEE's state (:mod:`sealfl.enclave.tee.sim` or
:mod:`sealfl.enclave.tee.tpm`); ``tee.json`` names its backend. Rules:

* :func:`provision` creates it -- on a device with TEE state or a recorded release only with
  ``force=True`` (re-provisioning on purpose: the old ``tee/`` is moved aside to
  ``tee.replaced-<time>``, never deleted). The new TEE's floor is never lower than the
  device's: on ``tpm`` the NV floor survives re-provisioning; on both backends a floor
  recorded in ``state.json`` is carried into the new record.
* :func:`open_device_tee` opens it for a boot: a device that has recorded a release but
  whose TEE state is missing, or whose TEE floor belongs to another AK, is refused
  (:class:`~sealfl.enclave.errors.TEEStateError`; ``sealfl device boot`` exits with
  :data:`EXIT_TEE_STATE`); only a completely fresh device (no ``state.json``, no slots) is
  provisioned implicitly, with a warning.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from sealfl.attestation.canonical import JSONFormatError, loads_strict
from sealfl.attestation.device_state import SLOTS_DIR, STATE_FILE
from sealfl.attestation.errors import AttestationError
from sealfl.common.fsutil import ensure_private_dir
from sealfl.enclave.device import slots as _slots
from sealfl.enclave.errors import TEEStateError
from sealfl.enclave.tee.backends import BACKENDS, create_tee, load_tee
from sealfl.enclave.tee.interface import TEE

__all__ = ["TEE_DIR", "EXIT_TEE_STATE", "DEFAULT_BACKEND", "recorded_backend", "provision", "open_device_tee"]

log = logging.getLogger(__name__)

TEE_DIR = "tee"
#: ``sealfl device boot`` exit code when the TEE state is missing or foreign (re-provision).
EXIT_TEE_STATE = 4
DEFAULT_BACKEND = "sim"


def recorded_backend(tee_dir: Path) -> str | None:
    """The backend named by ``tee_dir/tee.json``, or None if there is no TEE state.

    Raises:
        TEEStateError: ``tee.json`` is unreadable, not strict JSON, or names no known backend.
    """
    path = Path(tee_dir) / "tee.json"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TEEStateError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        backend = loads_strict(data).get("backend")
    except (JSONFormatError, AttributeError) as exc:
        raise TEEStateError(f"{path} is not a JSON object: {exc}") from exc
    if backend not in BACKENDS:
        raise TEEStateError(f"{path}: field 'backend' is {backend!r:.40}, not one of {sorted(BACKENDS)}")
    return backend


def _has_history(state_root: Path) -> bool:
    slots = state_root / SLOTS_DIR
    return (state_root / STATE_FILE).exists() or (slots.is_dir() and any(slots.iterdir()))


def provision(state_dir: str | os.PathLike, backend: str = DEFAULT_BACKEND, *, force: bool = False) -> TEE:
    """Provision the device TEE in ``state_dir/tee`` (rules in the module docstring).

    Returns:
        the new :class:`TEE` (PCRs as after a reset).

    Raises:
        TEEStateError: TEE state exists and ``force`` is False, or ``state.json`` is malformed.
        TEEError: the backend failed (e.g. no TPM at the configured TCTI).
    """
    root = ensure_private_dir(Path(state_dir))
    tee_dir = root / TEE_DIR
    has_tee = tee_dir.exists() and any(tee_dir.iterdir())
    if (has_tee or _has_history(root)) and not force:
        raise TEEStateError(f"{root} is a provisioned or used device ({TEE_DIR}/, {STATE_FILE} or {SLOTS_DIR}/ "
                            "exist); pass --force to re-provision on purpose (old TEE state is kept aside, the "
                            "rollback floor is kept)")
    if has_tee:
        aside = root / f"{TEE_DIR}.replaced-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        os.rename(tee_dir, aside)
        log.warning("re-provisioning: the previous TEE state moved to %s", aside)
    tee = create_tee(backend, tee_dir)
    try:
        last = _slots.read_state(root).last_good
    except AttestationError as exc:
        raise TEEStateError(f"cannot carry the rollback floor over: {exc}") from exc
    record = tee.read_floor()
    if last is not None and last.statement_digest is not None:
        raised = record.raised(last.version, last.statement_digest)
        if raised != record:
            tee.write_floor(raised)
    log.info("provisioned a %s TEE in %s (AK keyid %s)", backend, tee_dir, tee.ak_keyid())
    return tee


def open_device_tee(state_root: Path, backend: str | None = None) -> TEE:
    """Open the device TEE for a boot (PCRs reset), provisioning only a fresh device.

    Args:
        state_root: the device state directory.
        backend: required backend, or None for the one recorded in ``tee.json``
            (:data:`DEFAULT_BACKEND` on a fresh device).

    Raises:
        TEEStateError: TEE state missing on a device with history, of another backend than
            ``backend``, malformed, or its floor belongs to another AK.
        TEEError: the backend failed.
    """
    tee_dir = Path(state_root) / TEE_DIR
    recorded = recorded_backend(tee_dir)
    if recorded is None:
        if _has_history(Path(state_root)):
            raise TEEStateError(
                f"the device TEE state in {tee_dir} is missing but the device has booted releases "
                f"({STATE_FILE} or {SLOTS_DIR}/ exist): refusing to create a new attestation key silently; "
                "re-provision on purpose with `sealfl device provision --state DIR --force`")
        log.warning("fresh device: provisioning a %s TEE in %s", backend or DEFAULT_BACKEND, tee_dir)
        tee = provision(state_root, backend or DEFAULT_BACKEND)
        return load_tee(tee.backend, tee_dir, reset_pcrs=True)
    if backend is not None and backend != recorded:
        raise TEEStateError(f"{tee_dir} holds a {recorded!r} TEE, not {backend!r}; re-provision with --force "
                            "to change backend")
    tee = load_tee(recorded, tee_dir, reset_pcrs=True)
    try:
        tee.read_floor().check_owner(tee.ak_keyid())
    except AttestationError as exc:
        raise TEEStateError(str(exc)) from exc
    return tee
