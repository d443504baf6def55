"""Device TEE provisioning and opening: the only place a device gets a new attestation key.

``state_dir/tee`` holds the TEE's state (:mod:`sealfl.enclave.tee.sim` or
:mod:`sealfl.enclave.tee.tpm`); ``tee.json`` names its backend. Rules:

* :func:`provision` creates it -- on a device with TEE state or a recorded release only with
  ``force=True`` (re-provisioning on purpose: the old ``tee/`` is moved aside to
  ``tee.replaced-<time>``, never deleted, and moved back if the new TEE cannot be made). On
  ``tpm`` the TPM itself must not serve another role or hold another state's AK (the
  second refusal is lifted by ``force`` too: :mod:`sealfl.enclave.tee.tpm_alloc`). The new
  TEE's floor is never lower than the device's: on ``tpm`` the NV floor survives
  re-provisioning; on both backends a floor recorded in ``state.json`` is carried into the
  new record. A provisioning that fails leaves no ``tee/`` behind.
* :func:`open_device_tee` opens it for a boot: a device that has recorded a release but
  whose TEE state is missing, or whose TEE floor belongs to another AK, is refused
  (:class:`~sealfl.enclave.errors.TEEStateError`; ``sealfl device boot`` exits with
  :data:`EXIT_TEE_STATE`). A fresh device (no ``tee/``) is provisioned implicitly **only**
  when the caller named the ``sim`` backend (``--tee sim``: tests and demos, with a
  warning); otherwise it is refused until ``sealfl device provision`` -- a device never
  falls back to the insecure simulation by itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from sealfl.attestation.canonical import JSONFormatError, loads_strict
from sealfl.attestation.device_state import SLOTS_DIR, STATE_FILE
from sealfl.attestation.errors import AttestationError
from sealfl.common.fsutil import ensure_private_dir
from sealfl.enclave.device import slots as _slots
from sealfl.enclave.errors import TEEError, TEEStateError
from sealfl.enclave.tee.backends import BACKENDS, create_tee, load_tee
from sealfl.enclave.tee.interface import TEE

__all__ = ["TEE_DIR", "EXIT_TEE_STATE", "IMPLICIT_BACKEND", "recorded_backend", "provision", "open_device_tee",
           "describe_tee"]

log = logging.getLogger(__name__)

TEE_DIR = "tee"
#: ``sealfl device boot`` exit code when the TEE state is missing or foreign (re-provision).
EXIT_TEE_STATE = 4
#: The only backend a fresh device is provisioned with implicitly, and only when asked for by
#: name (``--tee sim``); a ``tpm`` device is provisioned with ``sealfl device provision``.
IMPLICIT_BACKEND = "sim"


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


def provision(state_dir: str | os.PathLike, backend: str, *, force: bool = False) -> TEE:
    """Provision the device TEE in ``state_dir/tee`` (rules in the module docstring).

    Args:
        state_dir: the device state directory (created with mode 0700).
        backend: ``"tpm"`` or ``"sim"`` (insecure; tests and demos) -- always named.
        force: re-provision a used device, and (``tpm``) replace another state's AK.

    Returns:
        the new :class:`TEE` (PCRs as after a reset).

    Raises:
        TEEStateError: TEE state exists and ``force`` is False, ``state.json`` is malformed,
            or the TPM serves another role / another state (:mod:`sealfl.enclave.tee.tpm_alloc`).
        TPMError: the TPM does not answer or a command failed (what it means, what to do).
        TEEError: unknown backend, or the TPM lacks the SHA-256 bank the device measures into.
    """
    root = Path(state_dir)
    tee_dir = root / TEE_DIR
    has_tee = tee_dir.exists() and any(tee_dir.iterdir())
    if (has_tee or _has_history(root)) and not force:
        raise TEEStateError(f"{root} is a provisioned or used device ({TEE_DIR}/, {STATE_FILE} or {SLOTS_DIR}/ "
                            "exist); pass --force to re-provision on purpose (old TEE state is kept aside, the "
                            "rollback floor is kept)")
    try:
        last = _slots.read_state(root).last_good
    except AttestationError as exc:
        raise TEEStateError(f"cannot carry the rollback floor over: {exc}") from exc
    made_root = not root.exists()
    ensure_private_dir(root)
    aside = None
    if has_tee:
        aside = root / f"{TEE_DIR}.replaced-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        os.rename(tee_dir, aside)
    elif tee_dir.is_dir():
        tee_dir.rmdir()  # an empty tee/ (e.g. left by an older sealfl's failed provisioning)
    try:
        tee = create_tee(backend, tee_dir, role="device", replace=force)
        record = tee.read_floor()
        if last is not None and last.statement_digest is not None:
            raised = record.raised(last.version, last.statement_digest)
            if raised != record:
                tee.write_floor(raised)
    except BaseException:
        if tee_dir.exists() and aside is None:
            shutil.rmtree(tee_dir, ignore_errors=True)
        if aside is not None:
            shutil.rmtree(tee_dir, ignore_errors=True)
            os.rename(aside, tee_dir)
            log.warning("re-provisioning failed: the previous TEE state is back in %s", tee_dir)
        if made_root:
            shutil.rmtree(root, ignore_errors=True)
        raise
    if aside is not None:
        log.warning("re-provisioning: the previous TEE state moved to %s", aside)
    log.info("provisioned a %s TEE in %s (AK keyid %s)", backend, tee_dir, tee.ak_keyid())
    return tee


def open_device_tee(state_root: Path, backend: str | None = None) -> TEE:
    """Open the device TEE for a boot (PCRs reset); provision a fresh device only on ``sim``
    named explicitly (module docstring).

    Args:
        state_root: the device state directory.
        backend: required backend, or None for the one recorded in ``tee.json``.

    Raises:
        TEEStateError: no TEE state (a fresh device not asked to use ``sim``, or a device
            with history), a TEE of another backend than ``backend``, malformed, or its
            floor belongs to another AK.
        TEEError: the backend failed (TPMError: what the TPM said and what to do).
    """
    tee_dir = Path(state_root) / TEE_DIR
    recorded = recorded_backend(tee_dir)
    if recorded is None:
        if _has_history(Path(state_root)):
            raise TEEStateError(
                f"the device TEE state in {tee_dir} is missing but the device has booted releases "
                f"({STATE_FILE} or {SLOTS_DIR}/ exist): refusing to create a new attestation key silently; "
                "re-provision on purpose with `sealfl device provision --state DIR --force`")
        if backend != IMPLICIT_BACKEND:
            raise TEEStateError(
                f"{state_root} is not provisioned (no {TEE_DIR}/): provision it first with `sealfl device provision "
                f"--state {state_root} --tee tpm`; a device never falls back to the insecure simulation by itself "
                "(tests and demos pass --tee sim)")
        log.warning("fresh device: provisioning the INSECURE sim TEE in %s as asked (--tee sim)", tee_dir)
        tee = provision(state_root, IMPLICIT_BACKEND)
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


def describe_tee(state_dir: str | os.PathLike) -> dict:
    """What TEE the device in ``state_dir`` runs on, for ``doctor`` and ``/health`` (reads
    ``tee/tee.json`` and ``tee/ak.pem`` only; never touches the TEE).

    Returns:
        ``{"backend": "tpm" | "sim" | None, "insecure": bool, "ak_keyid": hex | None,
        "tcti": str | None, "error": str}`` (``backend`` None: not provisioned).
    """
    from sealfl.attestation.keys import keyid, load_public_key

    tee_dir = Path(state_dir) / TEE_DIR
    out = {"backend": None, "insecure": False, "ak_keyid": None, "tcti": None, "error": ""}
    try:
        backend = recorded_backend(tee_dir)
    except TEEStateError as exc:
        out["error"] = str(exc)
        return out
    if backend is None:
        return out
    out["backend"], out["insecure"] = backend, backend == "sim"
    try:
        meta = loads_strict((tee_dir / "tee.json").read_bytes())
        if backend == "tpm":
            from sealfl.enclave.tee.tpm_tools import tcti_of

            out["tcti"] = tcti_of(meta.get("tcti") if isinstance(meta.get("tcti"), str) else None)
            out["ak_keyid"] = keyid(load_public_key((tee_dir / "ak.pem").read_bytes()))
        else:  # the simulation keeps its AK's private key in ak.pem
            from sealfl.attestation.keys import load_private_key

            out["ak_keyid"] = keyid(load_private_key((tee_dir / "ak.pem").read_bytes()).public_key())
    except (OSError, JSONFormatError, AttestationError, TEEError) as exc:
        out["error"] = str(exc)
    return out
