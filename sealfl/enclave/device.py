"""Device boot: measure, read once, verify, extend, sandbox, health-check, record.

:func:`boot` is the I/O shell around the pure :func:`sealfl.attestation.release.verify_release`:

1. load the pinned trust anchors from ``trust_dir``;
2. open (or provision) the device TEE in ``state_dir/tee`` -- PCRs reset, i.e. a reboot;
3. extend :func:`~sealfl.enclave.measure.measure_device_runtime` into PCR 16;
4. read the release directory once (:func:`~sealfl.attestation.release.read_release_dir`);
5. verify it, with ``last_version`` from ``state_dir/state.json`` (rollback protection);
6. extend the verified root digest into PCR 23;
7. start :class:`~sealfl.enclave.runtime.SandboxedRuntime` with the verified bytes of the
   model file (``metadata["model_file"]``, else the single ``.onnx`` payload file);
8. health check (ping + one inference on zeros when the first input is float), then the
   release's signed canary (:mod:`sealfl.enclave.acceptance`): batch and row-by-row
   answers must match the canary's expected outputs within its tolerance;
9. keep a private copy of the verified bytes in ``state_dir/slots/<envelope digest>`` and
   record ``state.json`` atomically: ``{"schema": "sealfl.device-state/v1",
   "last_good": {"name", "version", "root_digest", "release_dir" (the slot, relative to
   the state dir),
   "source_dir", "model_file"}}``; older slots are removed.

Any failure raises :class:`BootError` and leaves ``state.json`` untouched, so
:func:`boot_last_good` can bring the last good release back up.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sealfl.attestation.canonical import JSONFormatError, canonical_json, loads_strict
from sealfl.attestation.errors import TrustAnchorError, VerificationError
from sealfl.attestation.bundle import ENVELOPE_FILE
from sealfl.attestation.release import (
    DEFAULT_MAX_FILE_BYTES,
    VerifiedRelease,
    load_trust_anchors,
    read_release_dir,
    verify_release,
)

from sealfl.attestation.errors import CanaryError

from . import measure as _measure
from .acceptance import input_spec_of, run_canary
from .inputs import check_rows
from sealfl.common.fsutil import atomic_write, ensure_private_dir
from .errors import BootError, EnclaveError, InputSpecError, RuntimeSandboxError
from .runtime import SandboxedRuntime
from .tee import TEE, create_tee, load_tee

__all__ = ["STATE_FILE", "STATE_SCHEMA", "BootedDevice", "select_model_file", "read_device_state",
           "boot", "boot_last_good"]

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
STATE_SCHEMA = "sealfl.device-state/v1"

_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64,
                "tensor(int64)": np.int64, "tensor(int32)": np.int32}


class BootedDevice:
    """A device running a verified release in a sandboxed runtime.

    Attributes:
        release: the :class:`VerifiedRelease` being served.
        model_file: payload file name loaded into the runtime.
        runtime: the :class:`SandboxedRuntime`.
        tee: the device :class:`TEE` (PCR 16 = runtime code, PCR 23 = release root digest).
        release_dir: the release directory it booted from.
    """

    def __init__(self, release: VerifiedRelease, model_file: str, runtime: SandboxedRuntime,
                 tee: TEE, release_dir: Path) -> None:
        self.release = release
        self.model_file = model_file
        self.runtime = runtime
        self.tee = tee
        self.release_dir = release_dir
        self.input_spec = input_spec_of(release.metadata)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Run the model on ``x`` (float32, shape ``(n, d)``) via its first input; return output 0.

        Every row is first checked against the release's signed feature ranges
        (:func:`sealfl.enclave.inputs.check_rows`).

        Raises:
            InputRangeError (a ValueError): ``x`` is not 2-D with the model's width, or a
                cell is not finite or outside its documented range (names row and column).
            RuntimeSandboxError: inference failed in the sandbox.
        """
        arr = np.asarray(x, dtype=np.float32)
        check_rows(self.input_spec, arr)
        return self.runtime.run({self.runtime.input_names[0]: arr})[0]

    def attest(self, nonce: bytes) -> dict:
        """Quote over PCRs 16 (runtime code) and 23 (release root digest) carrying ``nonce``."""
        return self.tee.quote(nonce, [_measure.DEVICE_RUNTIME_PCR, _measure.DEVICE_RELEASE_PCR])

    def close(self) -> None:
        """Stop the sandboxed runtime."""
        self.runtime.close()

    def __enter__(self) -> "BootedDevice":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def select_model_file(release: VerifiedRelease) -> str:
    """Name of the ONNX payload to run: ``metadata["model_file"]`` or the single ``.onnx`` file.

    Raises:
        BootError: (reason ``"model"``) the named file is not in the payload, or there is not
            exactly one ``.onnx`` file and no ``model_file`` metadata.
    """
    named = release.metadata.get("model_file")
    if named is not None:
        if named not in release.payload:
            raise BootError(f"metadata model_file {named!r} is not a payload file of the release",
                            reason="model")
        return named
    onnx_files = sorted(p for p in release.payload if p.endswith(".onnx"))
    if len(onnx_files) != 1:
        raise BootError(f"release has {len(onnx_files)} .onnx files {onnx_files}; set metadata "
                        "'model_file' when publishing", reason="model")
    return onnx_files[0]


def read_device_state(state_dir: str | os.PathLike) -> dict | None:
    """Return the parsed ``state.json`` of ``state_dir``, or None if there is none.

    Raises:
        BootError: (reason ``"state"``) the file exists but is unreadable or malformed.
    """
    path = Path(state_dir) / STATE_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BootError(f"cannot read {path}: {exc}", reason="state") from exc
    try:
        state = loads_strict(data)
        last = state["last_good"]
        if state.get("schema") != STATE_SCHEMA or not isinstance(last.get("version"), int):
            raise ValueError("wrong schema or version")
    except (JSONFormatError, KeyError, AttributeError, ValueError) as exc:
        raise BootError(f"{path} is malformed ({exc}); refusing to boot without rollback state",
                        reason="state") from exc
    return state


def _open_tee(tee_dir: Path, backend: str) -> TEE:
    if tee_dir.exists() and any(tee_dir.iterdir()):
        return load_tee(backend, tee_dir, reset_pcrs=True)
    return create_tee(backend, tee_dir)


def _health_check(runtime: SandboxedRuntime) -> None:
    runtime.health_check()
    first = runtime.inputs[0] if runtime.inputs else None
    if first is None or first["type"] not in _NUMPY_TYPES:
        return
    shape = [d if isinstance(d, int) and d > 0 else 1 for d in first["shape"]]
    outputs = runtime.run({first["name"]: np.zeros(shape, dtype=_NUMPY_TYPES[first["type"]])})
    for name, out in zip(runtime.output_names, outputs):
        if np.issubdtype(out.dtype, np.floating) and not np.all(np.isfinite(out)):
            raise RuntimeSandboxError(f"output {name!r} is not finite on an all-zero input")


SLOTS_DIR = "slots"


def _store_slot(state_root: Path, files: Mapping[str, bytes]) -> str:
    """Keep a private copy of a verified release (the exact bytes that were verified) in
    ``state_root/slots/<SHA-256 of its signed DSSE envelope>`` -- unique per signed release,
    unlike the root digest, which two versions of the same model share -- written to a temp
    dir and renamed into place, so the last good release survives changes to the directory
    it was installed from. Returns the slot path relative to ``state_root``."""
    slots = ensure_private_dir(state_root / SLOTS_DIR)
    name = hashlib.sha256(files[ENVELOPE_FILE]).hexdigest()
    slot = slots / name
    tmp = Path(tempfile.mkdtemp(prefix=".slot-", dir=slots))
    try:
        for fname, data in files.items():
            atomic_write(tmp / fname, data, 0o600)
        if slot.exists():  # rewrite: the old copy may have been altered on disk
            shutil.rmtree(slot)
        os.rename(tmp, slot)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return f"{SLOTS_DIR}/{name}"


def _prune_slots(state_root: Path, keep: str) -> None:
    """Remove every slot but ``keep`` (relative path of the new last good release)."""
    for p in (state_root / SLOTS_DIR).iterdir():
        if p != state_root / keep and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _boot(trust_dir, release_dir, state_dir, **kw) -> BootedDevice:
    """Serialise boots of one device: two concurrent boots could otherwise both pass the
    rollback check and the older one could record its version last."""
    state_root = ensure_private_dir(Path(state_dir).resolve())
    with open(state_root / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _boot_locked(trust_dir, release_dir, state_root, **kw)


def _boot_locked(trust_dir, release_dir, state_root: Path, *, backend: str, record: bool, expect_root: str | None,
                 runtime_options: Mapping[str, Any] | None, max_file_bytes: int) -> BootedDevice:
    try:
        trust = load_trust_anchors(trust_dir)
    except TrustAnchorError as exc:
        raise BootError(f"cannot load trust anchors: {exc}", reason="trust") from exc
    state = read_device_state(state_root)
    last_version = state["last_good"]["version"] if state else None
    last_root = state["last_good"].get("root_digest") if state else None
    try:
        tee = _open_tee(state_root / "tee", backend)
        tee.extend(_measure.DEVICE_RUNTIME_PCR, _measure.measure_device_runtime())
    except EnclaveError as exc:
        raise BootError(f"cannot open the device TEE or measure the runtime: {exc}", reason="tee") from exc
    release_path = Path(release_dir).resolve()
    try:
        files = read_release_dir(release_path, max_file_bytes=max_file_bytes)
        release = verify_release(files, trust, last_version=last_version, last_root_digest=last_root)
    except VerificationError as exc:
        raise BootError(f"release in {release_path} refused: {exc}", reason="verification",
                        file=exc.file, check=exc.check) from exc
    if expect_root is not None and release.root_digest != expect_root:
        raise BootError(f"release in {release_path} has root digest {release.root_digest}, but the recorded "
                        f"last good release has {expect_root}; the directory was replaced",
                        reason="verification", file=str(release_path), check="root-digest")
    tee.extend(_measure.DEVICE_RELEASE_PCR, bytes.fromhex(release.root_digest))
    model_file = select_model_file(release)
    try:
        runtime = SandboxedRuntime(release.payload[model_file], **dict(runtime_options or {}))
    except RuntimeSandboxError as exc:
        raise BootError(f"cannot start the runtime for {model_file}: {exc}", reason="runtime") from exc
    try:
        _health_check(runtime)
        input_spec_of(release.metadata)
        run_canary(runtime, release.metadata)
    except (RuntimeSandboxError, InputSpecError) as exc:
        runtime.close()
        raise BootError(f"health check of {release.name} v{release.version} failed: {exc}",
                        reason="health-check") from exc
    except CanaryError as exc:
        runtime.close()
        raise BootError(f"release {release.name} v{release.version} fails its signed canary on this device: {exc}",
                        reason="canary") from exc
    if record:
        try:
            slot = _store_slot(state_root, files)
            new_state = {"schema": STATE_SCHEMA, "last_good": {
                "name": release.name, "version": release.version, "root_digest": release.root_digest,
                "release_dir": slot, "source_dir": str(release_path), "model_file": model_file}}
            atomic_write(state_root / STATE_FILE, canonical_json(new_state) + b"\n", 0o600)
            _prune_slots(state_root, keep=slot)
        except OSError as exc:
            runtime.close()
            raise BootError(f"cannot record {STATE_FILE}: {exc}", reason="state") from exc
    log.info("device booted %s v%d (%s) from %s", release.name, release.version, release.root_digest,
             release_path)
    return BootedDevice(release, model_file, runtime, tee, release_path)


def boot(trust_dir: str | os.PathLike, release_dir: str | os.PathLike, state_dir: str | os.PathLike, *,
         backend: str = "sim", runtime_options: Mapping[str, Any] | None = None,
         max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> BootedDevice:
    """Boot the release in ``release_dir`` (steps in the module docstring).

    Args:
        trust_dir: pinned trust directory (see :mod:`sealfl.attestation.trust`).
        release_dir: release directory to verify and run.
        state_dir: device state (``tee/``, ``state.json``); created with mode 0700.
        backend: device TEE backend (``"sim"``).
        runtime_options: keyword arguments for :class:`SandboxedRuntime` (e.g. ``timeout_s``).
        max_file_bytes: per-file read cap in bytes.

    Returns:
        a :class:`BootedDevice` (close it when done).

    Raises:
        BootError: ``reason`` is ``"trust"``, ``"state"``, ``"tee"``, ``"verification"``
            (with ``.file``/``.check`` of the failed check), ``"model"``, ``"runtime"`` or
            ``"health-check"``; ``state.json`` is unchanged in every case.
    """
    return _boot(trust_dir, release_dir, state_dir, backend=backend, record=True, expect_root=None,
                 runtime_options=runtime_options, max_file_bytes=max_file_bytes)


def boot_last_good(trust_dir: str | os.PathLike, state_dir: str | os.PathLike, *, backend: str = "sim",
                   runtime_options: Mapping[str, Any] | None = None,
                   max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> BootedDevice:
    """Re-verify and boot the release recorded as last good in ``state_dir/state.json``
    (from the device's own slot copy).

    The release is verified from scratch and must have the recorded root digest.

    Raises:
        BootError: no last good release recorded (reason ``"state"``), or any :func:`boot`
            failure (e.g. the recorded directory was altered).
    """
    state = read_device_state(state_dir)
    if state is None:
        raise BootError(f"no last good release recorded in {Path(state_dir) / STATE_FILE}; boot a release first",
                        reason="state")
    last = state["last_good"]
    slot = Path(last["release_dir"])
    if not slot.is_absolute():
        slot = Path(state_dir).resolve() / slot
    return _boot(trust_dir, slot, state_dir, backend=backend, record=False,
                 expect_root=last["root_digest"], runtime_options=runtime_options,
                 max_file_bytes=max_file_bytes)
