"""Starting a tabular (ONNX) release on a device: the runtime child started ahead of
verification (:class:`Prestarted`), then the acceptance of the verified model -- health
check, input spec, signed canary (:func:`start_tabular`). Used by
:mod:`sealfl.enclave.device.boot` (the causal-LM counterpart is :mod:`sealfl.enclave.device.llm_boot`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from sealfl.attestation.errors import CanaryError
from sealfl.attestation.verify import VerifiedRelease
from sealfl.enclave.device.acceptance import input_spec_of, run_canary
from sealfl.enclave.device.llm_boot import is_llm_release
from sealfl.enclave.errors import BootError, InputSpecError, RuntimeSandboxError
from sealfl.enclave.sandbox.runtime import SandboxedRuntime

__all__ = ["Prestarted", "model_file_of", "start_tabular"]

log = logging.getLogger(__name__)

_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64,
                "tensor(int64)": np.int64, "tensor(int32)": np.int32}


def model_file_of(metadata: Mapping, names) -> str:
    """``metadata["model_file"]`` if it names one of ``names``, else the single ``.onnx`` name.

    Raises:
        BootError: (reason ``"model"``) neither.
    """
    named = metadata.get("model_file")
    if isinstance(named, str) and named in names:
        return named
    onnx_files = sorted(p for p in names if p.endswith(".onnx"))
    if len(onnx_files) != 1:
        raise BootError(f"release has {len(onnx_files)} .onnx files {onnx_files}; set metadata "
                        "'model_file' when publishing", reason="model")
    return onnx_files[0]


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


class Prestarted:
    """A tabular runtime child started before verification (:meth:`SandboxedRuntime.prestart`):
    its sandbox set-up and onnxruntime import (~0.3 s) overlap reading and verifying the
    release; it gets the model only once the release is verified (:meth:`take`), and is
    stopped on leaving the ``with`` block if nobody took it (a refused or LLM release).
    A child that cannot be prestarted is not an error here: the runtime is then started
    after verification as before, and reports its own failure."""

    def __init__(self, runtime_options, wanted: bool = True):
        self._rt = None
        if wanted:
            try:
                self._rt = SandboxedRuntime.prestart(**dict(runtime_options or {}))
            except RuntimeSandboxError as exc:
                log.debug("could not prestart the runtime child (%s); starting it after verification", exc)

    def stage(self, signed, payload) -> None:
        """``load_release``'s ``on_payload``: stage the model file the *signed* metadata names
        for the child while its hash and ONNX checks still run
        (:meth:`SandboxedRuntime.stage`; nothing is parsed before it is verified). Skipped
        for LLM releases and releases encrypted at rest (their model bytes exist only
        later). Never raises."""
        if self._rt is None or is_llm_release(signed.metadata) or signed.metadata.get("at_rest"):
            return
        try:
            self._rt.stage(payload[model_file_of(signed.metadata, payload)])
        except Exception as exc:  # noqa: BLE001 -- staging only saves time; boot goes on without it
            log.debug("not staging the model ahead of verification: %s", exc)

    def take(self):
        """The prestarted runtime (once), or None."""
        rt, self._rt = self._rt, None
        return rt

    def __enter__(self) -> "Prestarted":
        return self

    def __exit__(self, *exc_info) -> None:
        rt = self.take()
        if rt is not None:
            rt.close()


def start_tabular(release: VerifiedRelease, model_file: str, runtime_options, payload,
                   prestarted: SandboxedRuntime | None = None) -> SandboxedRuntime:
    """Start the tabular runtime on ``payload[model_file]`` (decrypted if the release is
    encrypted at rest) -- in ``prestarted`` if given -- and accept it: health check, input
    spec, signed canary."""
    try:
        if prestarted is not None:
            runtime = prestarted.load(payload[model_file])
        else:
            runtime = SandboxedRuntime(payload[model_file], **dict(runtime_options or {}))
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
    return runtime
