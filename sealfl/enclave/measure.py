"""Code measurements extended into PCRs (what a quote proves about the running code).

A measurement is the SHA-256 over the *source bytes* of the modules that make up a
component, combined like a manifest root digest::

    SHA-256( concat over module names m in ascending order of
             utf8(m) || 0x00 || SHA-256(source bytes of m) )

Module sources are located with :func:`importlib.util.find_spec` (the file the import
system would load) and read from disk.

PCR choice. On a TPM only PCRs 16 (debug) and 23 (application support) are resettable by
software at locality 0 (TCG PC Client Platform Firmware Profile, PCR usage table); PCRs
17-22 belong to DRTM and 0-15 to the firmware/OS boot chain. So:

* release enclave: :data:`RELEASE_ENCLAVE_PCR` = 16 <- :func:`measure_release_enclave`.
  Any edit to a measured module changes PCR 16, so an existing enclave can no longer
  unseal its release key or secrets (by design): re-provision and re-export trust.
* device: :data:`DEVICE_RUNTIME_PCR` = 16 <- :func:`measure_device_runtime` (the code that
  verifies and runs releases) and the device configuration
  (:func:`sealfl.enclave.measured.measure_config`), then :data:`DEVICE_RELEASE_PCR` = 23 <- the verified
  release root digest (32 bytes). A device quote over (16, 23) thus says "this verifier
  code accepted this release".
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterable

from .errors import EnclaveError

__all__ = [
    "RELEASE_ENCLAVE_PCR",
    "DEVICE_RUNTIME_PCR",
    "DEVICE_RELEASE_PCR",
    "ATTESTATION_MODULES",
    "RELEASE_ENCLAVE_MODULES",
    "DEVICE_RUNTIME_MODULES",
    "measure_modules",
    "measure_release_enclave",
    "measure_device_runtime",
]

RELEASE_ENCLAVE_PCR = 16
DEVICE_RUNTIME_PCR = 16
DEVICE_RELEASE_PCR = 23

ATTESTATION_MODULES: tuple[str, ...] = ("sealfl.__init__", "sealfl.common.__init__", "sealfl.common.errors",
                                        "sealfl.common.fsutil") + tuple(
    f"sealfl.attestation.{m}"
    for m in ("__init__", "bigread", "bundle", "canary", "canonical", "config", "device_state", "dsse", "errors",
              "keys", "llm_canary", "manifest", "onnx_check", "quote", "reader", "release", "schema", "statement",
              "trust", "verify", "eventlog", "requirements", "tee_floor", "tpm_attest")
)
#: The release enclave = attestation code + TEE + release enclave + the HE key holder
#: (``keyholder`` reads the sealed HE secret, so it is part of what the seal protects) and
#: the code it decrypts, bounds, rounds and steps with (codecs, ``decrypted``, ``server_opt``).
RELEASE_ENCLAVE_MODULES: tuple[str, ...] = ATTESTATION_MODULES + tuple(
    f"sealfl.enclave.{m}"
    for m in ("__init__", "errors", "keyholder", "measure", "release_enclave", "sealed_blob", "sim", "tee")
) + tuple(f"sealfl.common.{m}" for m in ("bfv", "ckks", "codecs", "decrypted", "framed", "plain", "sealchunks", "sealio",
                                         "server_opt"))
DEVICE_RUNTIME_MODULES: tuple[str, ...] = ATTESTATION_MODULES + tuple(
    f"sealfl.enclave.{m}"
    for m in ("__init__", "acceptance", "at_rest", "device", "errors", "inputs", "llm_boot", "llm_child", "llm_runtime",
              "doctor", "measure", "measured", "provision", "sealed_blob", "sim", "slots", "tee", "tpm", "tpm_tools",
              "openai_api", "serve", "serve_app", "serve_metrics", "serve_state")
) + tuple(f"sealfl.common.{m}" for m in ("sandbox", "sandbox_child", "sandbox_pipe", "sandbox_setup", "sandbox_stage", "llm_decode",
                                     "testpoints", "procs", "seconds")) + tuple(
    f"sealfl.kbs.{m}" for m in ("__init__", "atrest", "client", "errors", "wrap"))


def _source_path(module: str) -> str:
    name = module[: -len(".__init__")] if module.endswith(".__init__") else module
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise EnclaveError(f"cannot locate the source of module {name!r} to measure it; reinstall sealfl")
    return spec.origin


def measure_modules(modules: Iterable[str]) -> bytes:
    """Measure the given modules (see module docstring); returns 32 bytes.

    Raises:
        EnclaveError: a module's source file cannot be located or read.
    """
    h = hashlib.sha256()
    for module in sorted(set(modules)):
        path = _source_path(module)
        try:
            with open(path, "rb") as fh:
                source = fh.read()
        except OSError as exc:
            raise EnclaveError(f"cannot read {path} to measure {module}: {exc}") from exc
        h.update(module.encode("utf-8") + b"\0" + hashlib.sha256(source).digest())
    return h.digest()


def measure_release_enclave() -> bytes:
    """32-byte measurement of the release-enclave code (:data:`RELEASE_ENCLAVE_MODULES`)."""
    return measure_modules(RELEASE_ENCLAVE_MODULES)


def measure_device_runtime() -> bytes:
    """32-byte measurement of the device verifier/runtime code (:data:`DEVICE_RUNTIME_MODULES`)."""
    return measure_modules(DEVICE_RUNTIME_MODULES)
