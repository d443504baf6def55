"""Old import paths of sealfl 0.1, kept for one release (0.2) and then removed.

sealfl 0.2 moved its modules into packages that say who runs the code and what is measured
(README "Layout"). An import of an old module name gets the new module -- the same module
object, under both names -- with a :class:`DeprecationWarning` naming the new path; a name
that moved to another module is found through the old one the same way. Nothing in sealfl
imports an old path (a test checks).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "install", "moved_names_hook"]

#: old module -> new module
MOVED_MODULES: dict[str, str] = {
    "sealfl.attestation.schema": "sealfl.common.fields",
    "sealfl.clients.bench_tasks": "sealfl.clients.heart.bench",
    "sealfl.clients.corpus": "sealfl.clients.causal_lm.corpus",
    "sealfl.clients.data": "sealfl.clients.heart.data",
    "sealfl.clients.onnx_eval": "sealfl.clients.heart.onnx_eval",
    "sealfl.clients.stats": "sealfl.clients.heart.stats",
    "sealfl.clients.task": "sealfl.clients.heart.task",
    "sealfl.clients.tasks": "sealfl.clients.plugins",
    "sealfl.common.bfv": "sealfl.he.bfv",
    "sealfl.common.ckks": "sealfl.he.ckks",
    "sealfl.common.codecs": "sealfl.he.codecs",
    "sealfl.common.decrypted": "sealfl.he.decrypted",
    "sealfl.common.framed": "sealfl.he.framed",
    "sealfl.common.keywrap": "sealfl.he.kit_wrap",
    "sealfl.common.llm_decode": "sealfl.enclave.sandbox.decode",
    "sealfl.common.plain": "sealfl.he.plain",
    "sealfl.common.sandbox": "sealfl.enclave.sandbox.runtime",
    "sealfl.common.sandbox_child": "sealfl.enclave.sandbox.child",
    "sealfl.common.sandbox_pipe": "sealfl.enclave.sandbox.pipe",
    "sealfl.common.sandbox_setup": "sealfl.enclave.sandbox.setup",
    "sealfl.common.sandbox_stage": "sealfl.enclave.sandbox.stage",
    "sealfl.common.sealchunks": "sealfl.he.sealchunks",
    "sealfl.common.sealio": "sealfl.he.sealio",
    "sealfl.common.server_opt": "sealfl.he.server_opt",
    "sealfl.enclave.acceptance": "sealfl.enclave.device.acceptance",
    "sealfl.enclave.at_rest": "sealfl.enclave.device.at_rest",
    "sealfl.enclave.doctor": "sealfl.enclave.device.doctor",
    "sealfl.enclave.inputs": "sealfl.enclave.device.inputs",
    "sealfl.enclave.keyholder": "sealfl.enclave.release.keyholder",
    "sealfl.enclave.llm_boot": "sealfl.enclave.device.llm_boot",
    "sealfl.enclave.llm_child": "sealfl.enclave.sandbox.llm_child",
    "sealfl.enclave.llm_runtime": "sealfl.enclave.sandbox.llm_runtime",
    "sealfl.enclave.measure": "sealfl.enclave.measurement",
    "sealfl.enclave.measured": "sealfl.enclave.device.evidence",
    "sealfl.enclave.openai_api": "sealfl.enclave.device.serve.openai_api",
    "sealfl.enclave.provision": "sealfl.enclave.device.provision",
    "sealfl.enclave.release_enclave": "sealfl.enclave.release.enclave",
    "sealfl.enclave.sealed_blob": "sealfl.enclave.tee.sealed_blob",
    "sealfl.enclave.serve": "sealfl.enclave.device.serve.server",
    "sealfl.enclave.serve_app": "sealfl.enclave.device.serve.app",
    "sealfl.enclave.serve_metrics": "sealfl.enclave.device.serve.metrics",
    "sealfl.enclave.serve_state": "sealfl.enclave.device.serve.state",
    "sealfl.enclave.sim": "sealfl.enclave.tee.sim",
    "sealfl.enclave.slots": "sealfl.enclave.device.slots",
    "sealfl.enclave.tpm": "sealfl.enclave.tee.tpm",
    "sealfl.enclave.tpm_tools": "sealfl.enclave.tee.tpm_tools",
    "sealfl.enclave.verify_cli": "sealfl.enclave.device.verify",
    "sealfl.kbs": "sealfl.enclave.keybroker",
    "sealfl.kbs.atrest": "sealfl.attestation.encrypted_files",
    "sealfl.kbs.broker": "sealfl.enclave.keybroker.broker",
    "sealfl.kbs.client": "sealfl.enclave.device.kbs_client",
    "sealfl.kbs.errors": "sealfl.enclave.errors",
    "sealfl.kbs.server": "sealfl.enclave.keybroker.server",
    "sealfl.kbs.wrap": "sealfl.attestation.hpke_wrap",
    "sealfl.platform.cli_llm": "sealfl.platform.cli.device",
    "sealfl.platform.cli_trust": "sealfl.platform.cli.attest",
    "sealfl.platform.llm.release": "sealfl.platform.llm.build",
}

#: (module, name) -> (module, name) it moved to; the old module finds it through the
#: ``__getattr__`` that :func:`moved_names_hook` makes
MOVED_NAMES: dict[tuple[str, str], tuple[str, str]] = {
    ("sealfl.common.errors", "HEError"): ("sealfl.he.errors", "HEError"),
    ("sealfl.common.errors", "CiphertextError"): ("sealfl.he.errors", "CiphertextError"),
    ("sealfl.common.errors", "SecretKeyMissingError"): ("sealfl.he.errors", "SecretKeyMissingError"),
    ("sealfl.common.errors", "DecryptedValueError"): ("sealfl.he.errors", "DecryptedValueError"),
    ("sealfl.common.errors", "RuntimeSandboxError"): ("sealfl.enclave.errors", "RuntimeSandboxError"),
    ("sealfl.enclave.errors", "KBSError"): ("sealfl.enclave.errors", "KeyBrokerError"),
    ("sealfl.enclave.errors", "AtRestError"): ("sealfl.attestation.errors", "AtRestError"),
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        warnings.warn(f"{spec.name} moved to {self.new}; the old path goes away in sealfl 0.3",
                      DeprecationWarning, stacklevel=3)
        return module

    def exec_module(self, module) -> None:
        """Nothing to run: the new module ran when it was imported."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def moved_names_hook(module_name: str):
    """The module ``__getattr__`` that finds the names moved out of ``module_name``
    (:data:`MOVED_NAMES`); any other missing name is an AttributeError as usual."""
    names = {n: new for (m, n), new in MOVED_NAMES.items() if m == module_name}

    def __getattr__(name: str):
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        warnings.warn(f"{module_name}.{name} moved to {new[0]}.{new[1]}; the old path goes away in sealfl 0.3",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new[0]), new[1])

    return __getattr__


def install() -> None:
    """Put the finder first on :data:`sys.meta_path` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
