"""Measured boot I/O: the device's event log file, the configuration measurement, evidence.

The pure formats and checks are in :mod:`sealfl.attestation.eventlog`; this module writes
``state_dir/eventlog.json`` and extends the TEE. Each extend is first appended to the log
(atomic rewrite, mode 0600), then performed: a crash in between leaves an event the PCRs
lack, so the evidence fails verification (fail closed) until the next boot.

Configuration measurement (:func:`measure_config`): SHA-256 over, for each trust file in
the order ``release_key.pub.pem``, ``enclave_ak.pub.pem``, ``policy.json``:
``utf8(name) || 0x00 || SHA-256(file bytes)`` (a missing file contributes
``utf8(name) || 0x00 || 32 zero bytes``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

from sealfl.attestation.canonical import JSONFormatError, canonical_json, loads_strict
from sealfl.attestation.errors import AttestationError
from sealfl.attestation.eventlog import EVENT_PCR, EVIDENCE_SCHEMA, Event, eventlog_doc, parse_eventlog
from sealfl.attestation.quote import CHALLENGE_PURPOSE
from sealfl.attestation.trust import AK_FILE, POLICY_FILE, RELEASE_KEY_FILE
from sealfl.common.fsutil import atomic_write
from sealfl.enclave import measurement as _measure
from sealfl.enclave.errors import TEEStateError
from sealfl.enclave.tee.backends import load_tee
from sealfl.enclave.tee.interface import TEE

__all__ = ["EVENTLOG_FILE", "QUOTED_PCRS", "measure_config", "read_events", "begin", "record", "evidence",
           "attest_device", "device_public_key"]

log = logging.getLogger(__name__)

EVENTLOG_FILE = "eventlog.json"
#: PCRs a device quote covers (allocation table in :mod:`sealfl.enclave.tee.tpm`).
QUOTED_PCRS = (16, 23)


def measure_config(trust_dir: str | os.PathLike) -> bytes:
    """32-byte measurement of the device configuration (definition in the module docstring).

    Raises:
        OSError: a trust file exists but cannot be read.
    """
    h = hashlib.sha256()
    for name in (RELEASE_KEY_FILE, AK_FILE, POLICY_FILE):
        try:
            digest = hashlib.sha256((Path(trust_dir) / name).read_bytes()).digest()
        except FileNotFoundError:
            digest = b"\0" * 32
        h.update(name.encode() + b"\0" + digest)
    return h.digest()


def read_events(state_root: Path) -> list[Event]:
    """The events of ``state_root/eventlog.json``.

    Raises:
        TEEStateError: the file is missing or malformed (boot the device first).
    """
    path = Path(state_root) / EVENTLOG_FILE
    try:
        return parse_eventlog(loads_strict(path.read_bytes()), str(path))
    except FileNotFoundError as exc:
        raise TEEStateError(f"{path} is missing: the device has not booted a release since its TEE was reset; "
                            "run `sealfl device boot` first") from exc
    except (OSError, JSONFormatError, AttestationError) as exc:
        raise TEEStateError(f"cannot read the event log {path}: {exc}") from exc


def _write(state_root: Path, events: list[Event]) -> None:
    atomic_write(Path(state_root) / EVENTLOG_FILE, canonical_json(eventlog_doc(events)) + b"\n", 0o600)


def begin(state_root: Path) -> None:
    """Start the event log of a new boot (call right after the TEE's PCRs were reset)."""
    _write(state_root, [])


def record(tee: TEE, state_root: Path, kind: str, digest: bytes, detail: str = "") -> None:
    """Append an event of type ``kind`` to the log, then extend its PCR with ``digest`` (32 bytes).

    Raises:
        TEEStateError: the log is unreadable. TEEError: the extend failed.
    """
    events = read_events(state_root)
    events.append(Event(EVENT_PCR[kind], kind, digest.hex(), detail))
    _write(state_root, events)
    tee.extend(EVENT_PCR[kind], digest)


def evidence(tee: TEE, state_root: Path, nonce: bytes, purpose: str = CHALLENGE_PURPOSE) -> dict:
    """Re-measure the runtime (a ``runtime-recheck`` event), then quote the verifier's
    ``nonce`` (the quote's data; for ``purpose="key-request"`` the broker's nonce and key
    binding) over :data:`QUOTED_PCRS`; return the evidence document
    (:mod:`sealfl.attestation.eventlog`). ``tee`` must be opened without a PCR reset.

    Raises:
        TEEStateError: no event log. TEEError: quote failed or ``nonce`` not 1..64 bytes.
    """
    record(tee, state_root, "runtime-recheck", _measure.measure_device_runtime(), "sealfl runtime at attestation")
    return {"schema": EVIDENCE_SCHEMA, "quote": tee.quote(purpose, nonce, list(QUOTED_PCRS)),
            "eventlog": json.loads(canonical_json(eventlog_doc(read_events(state_root))))}


def attest_device(state_dir: str | os.PathLike, nonce: bytes, purpose: str = CHALLENGE_PURPOSE) -> dict:
    """``sealfl device attest``: the evidence of the device in ``state_dir`` for ``nonce``.

    Opens the provisioned TEE without a PCR reset (same boot), under the device lock, and
    returns :func:`evidence`.

    Raises:
        TEEStateError: no provisioned TEE, no event log, or the TEE floor of another AK.
        TEEError: the quote failed or ``nonce`` is not 1..64 bytes.
    """
    from sealfl.enclave.device.provision import TEE_DIR, recorded_backend  # provision imports this module's users

    root = Path(state_dir).resolve()
    backend = recorded_backend(root / TEE_DIR)
    if backend is None:
        raise TEEStateError(f"{root / TEE_DIR} holds no TEE: provision and boot the device first")
    with open(root / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tee = load_tee(backend, root / TEE_DIR, reset_pcrs=False)
        try:
            tee.read_floor().check_owner(tee.ak_keyid())
        except AttestationError as exc:
            raise TEEStateError(str(exc)) from exc
        return evidence(tee, root, nonce, purpose)


def device_public_key(state_dir: str | os.PathLike) -> bytes:
    """The provisioned device's AK public key (SubjectPublicKeyInfo PEM).

    Raises:
        TEEStateError: no provisioned TEE.
    """
    from sealfl.enclave.device.provision import TEE_DIR, recorded_backend

    root = Path(state_dir).resolve()
    backend = recorded_backend(root / TEE_DIR)
    if backend is None:
        raise TEEStateError(f"{root / TEE_DIR} holds no TEE: provision the device first")
    return load_tee(backend, root / TEE_DIR, reset_pcrs=False).public_key()
