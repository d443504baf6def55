"""Device boot: measure, read bounded by what was signed, verify, extend, sandbox, record.

:func:`boot` is the I/O shell around the pure verification of :mod:`sealfl.attestation`:

1. load the pinned trust anchors from ``trust_dir``;
2. read the device's trusted state (``state_dir/state.json``: its rollback floor and last
   good release; :class:`~sealfl.attestation.device_state.DeviceState`);
3. open the device TEE in ``state_dir/tee`` (:func:`~sealfl.enclave.device.provision.open_device_tee`:
   provisioned implicitly only on a fresh device asked to run the ``sim`` simulation; missing
   or foreign TEE state is refused),
   PCRs reset, i.e. a reboot; read its rollback floor; start a new event log and extend
   :func:`~sealfl.enclave.measurement.measure_device_runtime` and the configuration
   (:func:`~sealfl.enclave.device.evidence.measure_config`) into PCR 16 (:mod:`sealfl.enclave.device.evidence`);
4. read and verify the release directory with
   :func:`~sealfl.attestation.reader.load_release`: the signed documents first under tight
   caps, then each listed file no further than its signed size + 1 byte; an unlisted file is
   never opened; versions are checked against the device state, the policy and the TEE
   floor (:func:`boot_last_good` finds the floor's release among the slots when
   ``state.json`` is gone or older: :mod:`sealfl.enclave.device.recover`); a causal-LM
   release's other variants are only hashed as they stream past (``llm_files_to_keep``);
5. extend the verified root digest into PCR 23 (a ``release-root`` event);
6. start :class:`~sealfl.enclave.sandbox.runtime.SandboxedRuntime` with the verified bytes of the
   model file (``metadata["model_file"]``, else the single ``.onnx`` payload file);
7. health check (ping + one inference on zeros when the first input is float), then the
   release's signed canary (:mod:`sealfl.enclave.device.acceptance`): batch and row-by-row
   answers must match the canary's expected outputs within its tolerance;
8. record the release crash-consistently (:func:`sealfl.enclave.device.slots.commit`): a private
   copy of the verified bytes (streamed files: copied and hashed again) in a new
   ``state_dir/slots/<name>``, then ``state.json``
   (:meth:`DeviceState.accept`), then removal of older slots; then the TEE floor is raised.
   A release is identified by what was signed (its statement digest): booting the last good
   release again -- whatever its envelope's bytes -- keeps its slot and ``state.json``.

Any failure raises :class:`BootError` (for a new release, also recorded in
``state_dir/last_refused.json``: reason, file, check, message, time); ``state.json`` then
still names a complete, verifiable slot (or is absent on a fresh device), so
:func:`boot_last_good` can bring the last good release back up.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sealfl.attestation.config import DEFAULT_CONFIG, VerifyConfig
from sealfl.attestation.device_state import STATE_FILE, STATE_SCHEMA, DeviceState, LastGood
from sealfl.attestation.errors import DeviceStateError, TrustAnchorError, VerificationError
from sealfl.attestation.quote import CHALLENGE_PURPOSE
from sealfl.attestation.reader import load_release
from sealfl.attestation.trust import load_trust_anchors
from sealfl.attestation.verify import VerifiedRelease
from sealfl.common.fsutil import atomic_write, ensure_private_dir
from sealfl.enclave import measurement as _measure
from sealfl.enclave.device import evidence as _measured
from sealfl.enclave.device import slots as _slots
from sealfl.enclave.device.acceptance import input_spec_of
from sealfl.enclave.device.at_rest import KeySource, open_payload
from sealfl.enclave.device.doctor import check_release_requirements
from sealfl.enclave.device.inputs import check_rows
from sealfl.enclave.device.llm_boot import boot_llm, is_llm_release, llm_files_to_keep
from sealfl.enclave.device.provision import TEE_DIR, open_device_tee, recorded_backend
from sealfl.enclave.device.recover import last_good_source
from sealfl.enclave.device.tabular_boot import Prestarted, model_file_of, start_tabular
from sealfl.enclave.errors import BootError, EnclaveError, TEEError, TEEStateError
from sealfl.enclave.tee.interface import TEE

__all__ = ["STATE_FILE", "STATE_SCHEMA", "BootedDevice", "select_model_file", "read_device_state",
           "boot", "boot_last_good"]

log = logging.getLogger(__name__)

#: Why the last new release was refused (reason, file, check, message, time), in the state dir.
REFUSAL_FILE = "last_refused.json"

class BootedDevice:
    """A device running a verified release in a sandboxed runtime.

    Attributes:
        release: the :class:`VerifiedRelease` being served.
        model_file: payload file name loaded into the runtime.
        runtime: the :class:`SandboxedRuntime`.
        tee: the device :class:`TEE` (PCR 16 = runtime code, PCR 23 = release root digest).
        release_dir: the release directory it booted from.
    """

    def __init__(self, release: VerifiedRelease, model_file: str, runtime, tee: TEE, release_dir: Path,
                 llm_spec=None, canary_stats: dict | None = None) -> None:
        self.release = release
        self.model_file = model_file
        self.runtime = runtime
        self.tee = tee
        self.release_dir = release_dir
        self.llm_spec = llm_spec
        self.canary_stats = canary_stats
        self.input_spec = None if llm_spec is not None else input_spec_of(release.metadata)

    @property
    def is_llm(self) -> bool:
        """True if the release runs the causal-LM runtime (:mod:`sealfl.enclave.device.llm_boot`)."""
        return self.llm_spec is not None

    def generate(self, prompt, params=None, on_text=None):
        """Generate text with a causal-LM release (see
        :meth:`sealfl.enclave.sandbox.llm_runtime.LLMRuntime.generate`).

        Raises:
            BootError: (reason ``"model"``) the release is not a causal LM.
        """
        if not self.is_llm:
            raise BootError(f"release {self.release.name} is not a causal LM; it cannot generate text", reason="model")
        return self.runtime.generate(prompt, params, on_text)

    def chat(self, messages, params=None, on_text=None):
        """Answer a chat (the release's chat template, then :meth:`generate`)."""
        if not self.is_llm:
            raise BootError(f"release {self.release.name} is not a causal LM; it cannot chat", reason="model")
        return self.runtime.generate(self.runtime.render_chat(messages), params, on_text)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Run the model on ``x`` (float32, shape ``(n, d)``) via its first input; return output 0.

        Every row is first checked against the release's signed feature ranges
        (:func:`sealfl.enclave.device.inputs.check_rows`).

        Raises:
            InputRangeError (a ValueError): ``x`` is not 2-D with the model's width, or a
                cell is not finite or outside its documented range (names row and column).
            RuntimeSandboxError: inference failed in the sandbox.
        """
        if self.is_llm:
            raise BootError(f"release {self.release.name} is a causal LM; use generate()", reason="model")
        arr = np.asarray(x, dtype=np.float32)
        check_rows(self.input_spec, arr)
        return self.runtime.run({self.runtime.input_names[0]: arr})[0]

    def attest(self, nonce: bytes) -> dict:
        """A challenge quote (purpose ``"challenge"``) over PCRs 16 (runtime code) and 23
        (release root digest) for a verifier's ``nonce`` (1..64 bytes). Verify it with
        ``verify_quote(quote, ak, "challenge", nonce, ...)``.

        Raises:
            TEEError: ``nonce`` is not 1..64 bytes.
        """
        return self.tee.quote(CHALLENGE_PURPOSE, nonce, [_measure.DEVICE_RUNTIME_PCR, _measure.DEVICE_RELEASE_PCR])

    def close(self) -> None:
        """Stop the sandboxed runtime."""
        self.runtime.close()

    def __enter__(self) -> "BootedDevice":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def select_model_file(release: VerifiedRelease) -> str:
    """Name of the ONNX payload to run: ``metadata["model_file"]`` (verification guarantees
    it names a payload file) or the single ``.onnx`` file.

    Raises:
        BootError: (reason ``"model"``) there is no ``model_file`` metadata and not exactly
            one ``.onnx`` payload file.
    """
    return model_file_of(release.metadata, release.payload)


def read_device_state(state_dir: str | os.PathLike) -> DeviceState:
    """Return the device's trusted state from ``state_dir/state.json`` (a fresh
    :class:`DeviceState` -- ``last_good`` None -- if there is none).

    Raises:
        BootError: (reason ``"state"``) the file exists but is unreadable or malformed; the
            message names the file and the field.
    """
    try:
        return _slots.read_state(Path(state_dir))
    except DeviceStateError as exc:
        raise BootError(str(exc), reason="state") from exc


def _record(state_root: Path, state: DeviceState, release: VerifiedRelease, source: Path,
            model_file: str) -> DeviceState:
    """Step 8 of the module docstring (crash-consistent; see :mod:`sealfl.enclave.device.slots`)."""
    def transition(slot: str) -> DeviceState:
        return state.accept(name=release.name, version=release.version, root_digest=release.root_digest,
                            statement_digest=release.statement_digest, slot=slot, source_dir=str(source),
                            model_file=model_file)

    label = f"v{release.version}-{release.statement_digest[:16]}"
    return _slots.commit(state_root, release.files(), label, transition, release.streamed, source)


def _boot(trust_dir, release_dir, state_dir, **kw) -> BootedDevice:
    """Serialise boots of one device: two concurrent boots could otherwise both pass the
    rollback check and the older one could record its version last. An ``OSError`` of the
    state directory anywhere in the boot is a :class:`BootError` (reason ``"state"``)."""
    try:
        state_root = ensure_private_dir(Path(state_dir).resolve())
        with open(state_root / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                wanted = kw.get("variant") is None and not kw.get("require_llm")
                with Prestarted(kw.get("runtime_options"), wanted) as pre:
                    try:
                        return _boot_locked(trust_dir, release_dir, state_root, prestarted=pre, **kw)
                    except OSError as exc:
                        raise BootError(f"device boot failed on a file operation: {exc}; check the state "
                                        f"directory {state_root} (space, permissions, a file where a directory "
                                        "belongs)", reason="state") from exc
            except BootError as exc:
                if release_dir is not None:
                    _record_refusal(state_root, release_dir, exc)
                raise
    except OSError as exc:
        raise BootError(f"cannot use the device state directory {state_dir}: {exc}", reason="state") from exc


def _record_refusal(state_root: Path, release_dir, exc: BootError) -> None:
    """Write why a new release was refused to ``state_dir/last_refused.json`` (never raises)."""
    doc = {"release_dir": str(release_dir), "reason": exc.reason, "file": exc.file, "check": exc.check,
           "message": str(exc)[:4000], "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        atomic_write(state_root / REFUSAL_FILE, json.dumps(doc, indent=1).encode() + b"\n", 0o600)
    except OSError as err:
        log.warning("cannot record the refusal in %s: %s", state_root / REFUSAL_FILE, err)


def _same_release(release: VerifiedRelease, last: LastGood) -> bool:
    if last.statement_digest is not None:
        return release.statement_digest == last.statement_digest
    return release.root_digest == last.root_digest


def _boot_locked(trust_dir, release_dir, state_root: Path, *, backend: str | None,
                 runtime_options: Mapping[str, Any] | None, config: VerifyConfig,
                 variant: str | None = None, key_source: KeySource | None = None,
                 prestarted: Prestarted | None = None, require_llm: bool = False) -> BootedDevice:
    """Boot ``release_dir`` and record it; ``release_dir=None`` boots the last good release
    from its slot (:mod:`sealfl.enclave.device.recover`), recording nothing unless
    ``state.json`` had to be rebuilt from the TEE floor."""
    try:
        trust = load_trust_anchors(trust_dir)
    except TrustAnchorError as exc:
        raise BootError(f"cannot load trust anchors: {exc}", reason="trust") from exc
    state = read_device_state(state_root)
    record = release_dir is not None
    if release_dir is None and state.last_good is None and recorded_backend(state_root / TEE_DIR) is None:
        raise BootError(f"no last good release recorded in {state_root / STATE_FILE}; boot a release first",
                        reason="state")
    try:
        tee = open_device_tee(state_root, backend)
        floor = tee.read_floor()
    except TEEStateError as exc:
        raise BootError(f"device TEE state refused: {exc}", reason="tee-state") from exc
    except TEEError as exc:
        raise BootError(f"cannot open the device TEE: {exc}", reason="tee") from exc
    try:
        _measured.begin(state_root)
        _measured.record(tee, state_root, "runtime-code", _measure.measure_device_runtime(), "sealfl runtime")
        _measured.record(tee, state_root, "config", _measured.measure_config(trust_dir), str(trust_dir))
    except (EnclaveError, OSError) as exc:
        raise BootError(f"cannot open the device TEE or measure the runtime: {exc}", reason="tee") from exc
    source = None
    if release_dir is None:
        source = last_good_source(state_root, state, floor, trust, config)
        release_dir = source.path
    release_path = Path(release_dir).resolve()
    try:
        release = source.release if source is not None and source.release is not None else load_release(
            release_path, trust, state=state, config=config,
            on_payload=prestarted.stage if prestarted is not None else None,
            keep=lambda signed: llm_files_to_keep(signed.metadata, [e.path for e in signed.files], variant))
        floor.check(release.version, release.statement_digest)
    except VerificationError as exc:
        raise BootError(f"release in {release_path} refused: {exc}", reason="verification",
                        file=exc.file, check=exc.check) from exc
    expect = source.expect if source is not None else None
    if expect is not None and not _same_release(release, expect):
        raise BootError(f"release in {release_path} (root digest {release.root_digest}) is not the recorded "
                        f"last good release (root digest {expect.root_digest}); the directory was replaced",
                        reason="verification", file=str(release_path), check="root-digest")
    if require_llm and not is_llm_release(release.metadata):
        raise BootError(f"release {release.name} v{release.version} in {release_path} is not a causal language "
                        "model; this command serves language models (boot it with 'sealfl device boot')",
                        reason="model")
    if record and state.last_good is not None and _same_release(release, state.last_good) \
            and _slots.slot_path(state_root, state.last_good.slot).is_dir():
        record = False  # the same signed release again: its slot and state.json stay as they are
        log.info("%s v%d is the last good release (same signed statement); its slot is kept", release.name,
                 release.version)
        _slots.prune_slots(state_root, keep=state.last_good.slot)  # leftovers of an interrupted update
    try:
        _measured.record(tee, state_root, "release-root", bytes.fromhex(release.root_digest),
                         f"{release.name} v{release.version}")
    except (EnclaveError, OSError) as exc:
        raise BootError(f"cannot measure the release root digest: {exc}", reason="tee") from exc
    check_release_requirements(release.metadata, state_root)
    payload = open_payload(release, tee, state_root, key_source)
    llm, stats = None, None
    if is_llm_release(release.metadata):
        runtime, llm, stats = boot_llm(payload, release.metadata, variant, runtime_options)
        model_file = llm.model_file
    else:
        model_file = select_model_file(release)
        runtime = start_tabular(release, model_file, runtime_options, payload,
                                 prestarted.take() if prestarted is not None else None)
    try:
        if record:
            _record(state_root, state, release, release_path, model_file)
        elif source is not None and source.recovered is not None:
            _slots.write_state(state_root, DeviceState().accept(
                name=release.name, version=release.version, root_digest=release.root_digest,
                statement_digest=release.statement_digest, slot=source.recovered, source_dir=str(release_path),
                model_file=model_file))
    except (OSError, DeviceStateError, VerificationError) as exc:  # the last: a streamed file changed since
        runtime.close()
        if isinstance(exc, VerificationError):
            raise BootError(f"release in {release_path} refused while recording it: {exc}", reason="verification",
                            file=exc.file, check=exc.check) from exc
        raise BootError(f"cannot record {STATE_FILE}: {exc}", reason="state") from exc
    try:  # after state.json: a crash in between leaves the TEE floor lower, never above the slot;
        # booting the last good release raises it too, so such a gap closes on the next boot
        raised = floor.raised(release.version, release.statement_digest)
        if raised != floor:
            tee.write_floor(raised)
    except EnclaveError as exc:
        runtime.close()
        raise BootError(f"cannot raise the TEE rollback floor: {exc}", reason="tee") from exc
    log.info("device booted %s v%d (%s) from %s", release.name, release.version, release.root_digest,
             release_path)
    return BootedDevice(release, model_file, runtime, tee, release_path, llm, stats)


def boot(trust_dir: str | os.PathLike, release_dir: str | os.PathLike, state_dir: str | os.PathLike, *,
         backend: str | None = None, runtime_options: Mapping[str, Any] | None = None,
         config: VerifyConfig = DEFAULT_CONFIG, variant: str | None = None,
         key_source: KeySource | None = None, require_llm: bool = False) -> BootedDevice:
    """Boot the release in ``release_dir`` (steps in the module docstring).

    Args:
        trust_dir: pinned trust directory (see :mod:`sealfl.attestation.trust`).
        release_dir: release directory to verify and run.
        state_dir: device state (``tee/``, ``state.json``, ``slots/``); created with mode 0700.
        backend: device TEE backend (``"sim"``, ``"tpm"``), or None (default) for the one
            provisioned in ``state_dir/tee``. A fresh device is provisioned implicitly only
            with ``backend="sim"`` (tests, demos); otherwise it needs
            :func:`~sealfl.enclave.device.provision.provision` first.
        runtime_options: keyword arguments for :class:`SandboxedRuntime` (e.g. ``timeout_s``).
        config: read caps (:class:`~sealfl.attestation.config.VerifyConfig`).
        variant: model variant of a causal-LM release (default: the release's
            ``default_variant``; see :mod:`sealfl.enclave.device.llm_boot`).
        key_source: for a release encrypted at rest, ``(tee, state_root) -> (root, key)``
            (:func:`sealfl.enclave.device.kbs_client.broker_key_source`; :mod:`sealfl.enclave.device.at_rest`).
        require_llm: refuse (reason ``"model"``), right after verification and before any
            runtime starts, a release that is not a causal language model.

    Returns:
        a :class:`BootedDevice` (close it when done).

    Raises:
        BootError: ``reason`` is ``"trust"``, ``"state"`` (also for a failed file operation
            in the state directory), ``"tee-state"`` (no TEE state: a fresh device not
            provisioned, or a device with history; or bound to another AK: (re-)provision on
            purpose), ``"tee"`` (the TEE cannot be opened or measured: the message says what
            the TPM reported and what to do),
            ``"verification"`` (also for a version below the TEE-held floor, check ``rollback``),
            ``"requirements"`` (the release's signed hardware requirements are not met:
            :mod:`sealfl.enclave.device.doctor`), ``"key"`` (an at-rest release got no key)
            (with ``.file``/``.check`` of the failed check), ``"model"``, ``"runtime"``,
            ``"health-check"`` or ``"canary"``; ``state.json`` still names a complete,
            verifiable slot.
    """
    return _boot(trust_dir, release_dir, state_dir, backend=backend, runtime_options=runtime_options,
                 config=config, variant=variant, key_source=key_source, require_llm=require_llm)


def boot_last_good(trust_dir: str | os.PathLike, state_dir: str | os.PathLike, *, backend: str | None = None,
                   runtime_options: Mapping[str, Any] | None = None,
                   config: VerifyConfig = DEFAULT_CONFIG, variant: str | None = None,
                   key_source: KeySource | None = None, require_llm: bool = False) -> BootedDevice:
    """Re-verify and boot the release recorded as last good in ``state_dir/state.json``
    (from the device's own slot copy).

    The release is verified from scratch and must be the recorded release (same signed
    statement). When ``state.json`` is missing or names a release below the TEE floor, the
    slot holding the floor's release is booted and ``state.json`` rewritten from it
    (:mod:`sealfl.enclave.device.recover`).

    Raises:
        BootError: no last good release (reason ``"state"``: nothing recorded and no floor,
            or no slot holds the floor's release), or any :func:`boot` failure (e.g. the
            slot was altered).
    """
    return _boot(trust_dir, None, state_dir, backend=backend, runtime_options=runtime_options, config=config,
                 variant=variant, key_source=key_source, require_llm=require_llm)
