"""Code measurements extended into PCRs (what a quote proves about the running code).

What is measured is **derived from packages**, never listed by hand: a role names its root
packages (:data:`DEVICE_RUNTIME_ROOTS`, :data:`RELEASE_ENCLAVE_ROOTS`); its measured set is
every module of those packages, every sealfl module any of them imports -- at module level
or inside a function, found by scanning the source's import statements -- transitively, and the ``__init__`` of
every package on the way (Python runs those on import). An import that leaves sealfl
(numpy, onnxruntime, ...) is not followed; measured modules do not import by name at run
time (``importlib.import_module``), which ``tests/enclave/test_measured_imports.py`` checks.

A measurement is the SHA-256 over the *source bytes* of those modules, combined like a
manifest root digest::

    SHA-256( concat over module names m in ascending order of
             utf8(m) || 0x00 || SHA-256(source bytes of m) )

where a package's module name is ``pkg.__init__``. Sources are read from the installed
``sealfl`` package directory; the bytes parsed for imports are the bytes hashed.

PCR choice. On a TPM only PCRs 16 (debug) and 23 (application support) are resettable by
software at locality 0 (TCG PC Client Platform Firmware Profile, PCR usage table); PCRs
17-22 belong to DRTM and 0-15 to the firmware/OS boot chain. So:

* release enclave: :data:`RELEASE_ENCLAVE_PCR` = 16 <- :func:`measure_release_enclave`.
  Any edit to a measured module changes PCR 16, so an existing enclave can no longer
  unseal its release key or secrets (by design): re-provision and re-export trust.
* device: :data:`DEVICE_RUNTIME_PCR` = 16 <- :func:`measure_device_runtime` (the code that
  verifies and runs releases, including the ``sealfl device`` commands that start it) and
  the device configuration (:func:`sealfl.enclave.device.evidence.measure_config`), then
  :data:`DEVICE_RELEASE_PCR` = 23 <- the verified release root digest (32 bytes). A device
  quote over (16, 23) thus says "this verifier code accepted this release".
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from sealfl.enclave.errors import EnclaveError

__all__ = [
    "RELEASE_ENCLAVE_PCR",
    "DEVICE_RUNTIME_PCR",
    "DEVICE_RELEASE_PCR",
    "DEVICE_RUNTIME_ROOTS",
    "RELEASE_ENCLAVE_ROOTS",
    "measured_sources",
    "device_runtime_modules",
    "release_enclave_modules",
    "measure_modules",
    "measure_release_enclave",
    "measure_device_runtime",
]

RELEASE_ENCLAVE_PCR = 16
DEVICE_RUNTIME_PCR = 16
DEVICE_RELEASE_PCR = 23

#: The device runtime: boot, slots, serving, provisioning (:mod:`sealfl.enclave.device`), the
#: sandboxed child it runs models in, the TEE backends, and the ``sealfl device`` commands.
DEVICE_RUNTIME_ROOTS: tuple[str, ...] = ("sealfl.enclave.device", "sealfl.enclave.sandbox", "sealfl.enclave.tee",
                                         "sealfl.platform.cli.device", "sealfl.platform.cli.__main__")
#: The release enclave: its signing and key-holder code and the TEE backends (the HE code it
#: decrypts, bounds and steps with comes in through its imports).
RELEASE_ENCLAVE_ROOTS: tuple[str, ...] = ("sealfl.enclave.release", "sealfl.enclave.tee")

_SEALFL_DIR = Path(__file__).resolve().parents[1]


def _index() -> dict[str, Path]:
    """``{module name as measured: file}`` for every ``.py`` file of the installed package
    (one directory walk per measurement; ``pkg.__init__`` names packages)."""
    out: dict[str, Path] = {}
    for directory, dirs, files in os.walk(_SEALFL_DIR):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        rel = Path(directory).relative_to(_SEALFL_DIR).parts
        for file in files:
            if file.endswith(".py"):
                out[".".join(("sealfl", *rel, file[:-3]))] = Path(directory, file)
    return out


def _canonical(module: str, index: dict[str, Path]) -> str | None:
    """``module`` as it is measured (``pkg.__init__`` for a package), or None if it is not a
    sealfl module (numpy, or a name imported from a module rather than a submodule)."""
    if module in index:
        return module
    package = f"{module}.__init__"
    return package if package in index else None


#: ``import a.b as c, d`` and ``from .x import (a, b)`` at the start of a line, at any indent
#: (function bodies included); a docstring line that looks like one only widens the set.
_IMPORT = re.compile(rb"^[ \t]*(?:from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*)"
                     rb"|import[ \t]+([^\n#;]*))", re.M)
_NAME = re.compile(rb"[A-Za-z_][\w.]*")


def _imports(module: str, source: bytes, index: dict[str, Path]) -> set[str]:
    """Every sealfl module ``source`` imports, anywhere in it (function bodies included).

    A line scan, not a parse (``ast.parse`` of the device's ~11,000 lines took 0.2 s of
    every boot): it finds every ``import`` / ``from ... import`` statement that starts a
    line, and a test holds it against the ``ast`` of every measured module.
    """
    is_package = module.endswith(".__init__")
    name = module[: -len(".__init__")] if is_package else module
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for m in _IMPORT.finditer(source):
        dots, target, names, plain = m.groups()
        if plain is not None:
            for item in plain.split(b","):
                words = item.split()
                if words:
                    found.add(words[0].decode("ascii", "replace"))
            continue
        if dots:
            base = package.split(".")
            base = base[: len(base) - (len(dots) - 1)]
            target_name = ".".join(base + ([target.decode("ascii", "replace")] if target else []))
        else:
            target_name = target.decode("ascii", "replace")
        found.add(target_name)
        for item in names.strip(b"()").split(b","):
            words = _NAME.findall(item)
            if words:
                found.add(f"{target_name}.{words[0].decode('ascii', 'replace')}")  # ``from pkg import submodule``
    return {c for c in (_canonical(imported, index) for imported in found) if c is not None}


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return [".".join(parts[:k]) + ".__init__" for k in range(1, len(parts))]


def _package_modules(package: str, index: dict[str, Path]) -> list[str]:
    prefix = f"{package}."
    return sorted(m for m in index if m.startswith(prefix))


def measured_sources(roots: Iterable[str]) -> dict[str, bytes]:
    """Every module a role measures (module docstring), with the source bytes read.

    Args:
        roots: package names (``sealfl.enclave.device``) or module names.

    Returns:
        ``{module name: source bytes}``, names as measured (``pkg.__init__`` for packages).

    Raises:
        EnclaveError: a root or an imported module cannot be located or read.
    """
    index = _index()
    todo: list[str] = []
    for root in roots:
        canonical = _canonical(root, index)
        if canonical is None:
            raise EnclaveError(f"cannot locate the measured module {root!r}; reinstall sealfl")
        todo.extend(_package_modules(root, index) if canonical.endswith(".__init__") else [canonical])
    sources: dict[str, bytes] = {}
    while todo:
        module = _canonical(todo.pop(), index)
        if module is None or module in sources:
            continue
        path = index[module]
        try:
            source = path.read_bytes()
        except OSError as exc:
            raise EnclaveError(f"cannot read {path} to measure {module}: {exc}") from exc
        sources[module] = source
        todo.extend(_parents(module))
        todo.extend(_imports(module, source, index))
    return sources


def device_runtime_modules() -> tuple[str, ...]:
    """Sorted names of the modules the device runtime measures (from :data:`DEVICE_RUNTIME_ROOTS`)."""
    return tuple(sorted(measured_sources(DEVICE_RUNTIME_ROOTS)))


def release_enclave_modules() -> tuple[str, ...]:
    """Sorted names of the modules the release enclave measures (from :data:`RELEASE_ENCLAVE_ROOTS`)."""
    return tuple(sorted(measured_sources(RELEASE_ENCLAVE_ROOTS)))


def measure_modules(sources: dict[str, bytes]) -> bytes:
    """The measurement of ``{module name: source bytes}`` (module docstring); 32 bytes."""
    h = hashlib.sha256()
    for module in sorted(sources):
        h.update(module.encode("utf-8") + b"\0" + hashlib.sha256(sources[module]).digest())
    return h.digest()


def measure_release_enclave() -> bytes:
    """32-byte measurement of the release-enclave code (:data:`RELEASE_ENCLAVE_ROOTS`).

    Raises:
        EnclaveError: a measured source cannot be located or read.
    """
    return measure_modules(measured_sources(RELEASE_ENCLAVE_ROOTS))


def measure_device_runtime() -> bytes:
    """32-byte measurement of the device verifier/runtime code (:data:`DEVICE_RUNTIME_ROOTS`).

    Raises:
        EnclaveError: a measured source cannot be located or read.
    """
    return measure_modules(measured_sources(DEVICE_RUNTIME_ROOTS))
