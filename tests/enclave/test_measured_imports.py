"""The measurements cover the code that runs.

What a device or the release enclave measures is derived from packages and their imports
(:mod:`sealfl.enclave.measurement`, a fast line scan). These tests hold it against
independent oracles: Python's own parser over every import in every measured module
(module level and inside functions), the modules a real ``sealfl device ...`` process has
loaded when it ends, and a search for imports by name that no scan can follow.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import sealfl
from sealfl.enclave import measurement
from tests.support.releases import MODEL_FILE, default_payload

SEALFL_DIR = Path(sealfl.__file__).resolve().parent

#: the only measured module that imports by name, and why that is safe
IMPORTS_BY_NAME = {
    # the root command table: which persona module runs is the command line's choice;
    # test_device_commands_load_only_measured_code runs the device commands
    "sealfl.platform.cli.__init__",
    # the old import paths of sealfl 0.1 (one release): maps only the names of its tables
    "sealfl._moved",
}


def _all_modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SEALFL_DIR.rglob("*.py")):
        rel = path.relative_to(SEALFL_DIR).with_suffix("").parts
        out[".".join(("sealfl", *rel))] = path
    return out


def _as_measured(name: str, modules: dict[str, Path]) -> str | None:
    if name in modules:
        return name
    return f"{name}.__init__" if f"{name}.__init__" in modules else None


def _ast_imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every sealfl module ``path`` imports anywhere, by Python's parser (the oracle)."""
    package = module[: -len(".__init__")] if module.endswith(".__init__") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        for name in names:
            measured = _as_measured(name, modules)
            if measured is not None:
                found.add(measured)
    return found


ROLES = {"device": measurement.DEVICE_RUNTIME_ROOTS, "release-enclave": measurement.RELEASE_ENCLAVE_ROOTS}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_import_of_a_measured_module_is_measured(role):
    modules = _all_modules()
    measured = set(measurement.measured_sources(ROLES[role]))
    escaped = {}
    for module in sorted(measured):
        outside = _ast_imports(module, modules[module], modules) - measured
        if outside:
            escaped[module] = sorted(outside)
    assert escaped == {}, f"measured modules import code outside the {role} measurement: {escaped}"


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_measured_package_is_measured_whole(role):
    """Every module of a root package is measured, imported or not (a script the child runs
    by path is code that runs)."""
    modules = _all_modules()
    measured = set(measurement.measured_sources(ROLES[role]))
    for root in ROLES[role]:
        if f"{root}.__init__" in modules:
            files = {m for m in modules if m.startswith(f"{root}.")}
            assert files and files <= measured, sorted(files - measured)
    assert "sealfl.enclave.sandbox.llm_child" in set(measurement.measured_sources(ROLES["device"]))


def test_measured_modules_import_nothing_by_name():
    modules = _all_modules()
    measured = set(measurement.measured_sources(ROLES["device"])) | set(
        measurement.measured_sources(ROLES["release-enclave"]))
    by_name = set()
    for module in measured:
        for node in ast.walk(ast.parse(modules[module].read_bytes())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in ("import_module", "__import__"):
                    by_name.add(module)
    assert by_name == IMPORTS_BY_NAME


def test_the_fast_scan_finds_every_import_the_parser_finds():
    """The line scan the device runs at boot against Python's parser, on every sealfl module
    (not only the measured ones: a module that joins the measured set later is covered)."""
    modules = _all_modules()
    index = measurement._index()
    assert set(index) == set(modules)
    for module, path in modules.items():
        source = path.read_bytes()
        missed = _ast_imports(module, path, modules) - measurement._imports(module, source, index)
        assert not missed, f"{module}: the scan missed {sorted(missed)}"


def test_the_measurement_changes_with_any_measured_byte(tmp_path):
    sources = measurement.measured_sources(ROLES["device"])
    base = measurement.measure_modules(sources)
    assert base == measurement.measure_device_runtime()
    for module in ("sealfl.enclave.sandbox.llm_child", "sealfl.platform.cli.device", "sealfl.common.fsutil"):
        changed = dict(sources, **{module: sources[module] + b"\n"})
        assert measurement.measure_modules(changed) != base, module


_PROBE = """
import json, sys
sys.argv = ["sealfl", *json.loads(sys.argv[1])]
from sealfl.platform.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
loaded = sorted(m for m in sys.modules if m == "sealfl" or m.startswith("sealfl."))
print(json.dumps({"code": code, "loaded": loaded}), file=sys.stderr)
"""


def _run_cli(args) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([str(a) for a in args])], capture_output=True,
                         text=True, timeout=300)
    return json.loads(out.stderr.strip().splitlines()[-1])


def test_device_commands_load_only_measured_code(tmp_path, enclave):
    """Real ``sealfl device`` runs (boot, a refused release, generate of a release it cannot
    serve, serve with nothing to serve, attest, verify): every sealfl module loaded is measured."""
    trust = enclave.export_trust(tmp_path / "trust")
    release = tmp_path / "release"
    enclave.write_release(release, default_payload(), "heart-mlp", 1, {"model_file": MODEL_FILE})
    state = tmp_path / "state"
    runs = {
        "boot": (["device", "boot", "--trust", trust, "--release", release, "--state", state, "--tee", "sim"], 0),
        "generate": (["device", "generate", "--trust", trust, "--release", release, "--state", state, "--prompt",
                      "hi"], 2),
        "serve": (["device", "serve", "--trust", trust, "--release", tmp_path / "nowhere", "--state",
                   tmp_path / "fresh", "--tee", "sim", "--port", "0"], 2),
        "attest": (["device", "attest", "--state", state, "--nonce", "00ff"], 0),
        "verify": (["verify", "--trust", trust, release], 0),
        "boot-refused": (["device", "boot", "--trust", trust, "--release", tmp_path / "nowhere", "--state", state],
                         3),
    }
    measured = set(measurement.measured_sources(ROLES["device"]))
    for name, (args, code) in runs.items():
        result = _run_cli(args)
        assert result["code"] == code, (name, result)
        loaded = {_as_measured(m, _all_modules()) for m in result["loaded"]}
        assert "sealfl.platform.cli.device" in loaded  # the probe did run the device commands
        assert loaded - measured == set(), f"device {name} ran unmeasured code: {sorted(loaded - measured)}"


#: the packages whose code a role may run at all (a policy, not the measured list: the list
#: is derived; this says where it may lead)
MAY_RUN = {
    "device": ("sealfl.__init__", "sealfl._moved", "sealfl.common.", "sealfl.attestation.", "sealfl.enclave.__init__",
               "sealfl.enclave.errors", "sealfl.enclave.measurement", "sealfl.enclave.device.",
               "sealfl.enclave.sandbox.", "sealfl.enclave.tee.", "sealfl.platform.__init__",
               "sealfl.platform.cli.__init__", "sealfl.platform.cli.__main__", "sealfl.platform.cli.device",
               "sealfl.platform.cli.options", "sealfl.platform.cli.output"),
    "release-enclave": ("sealfl.__init__", "sealfl._moved", "sealfl.common.", "sealfl.attestation.", "sealfl.he.",
                        "sealfl.enclave.__init__", "sealfl.enclave.errors", "sealfl.enclave.measurement",
                        "sealfl.enclave.release.", "sealfl.enclave.tee."),
}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_role_measures_only_code_it_may_run(role):
    """An import that drags coordinator, aggregator, partner or HE code into the device (or
    device code into the release enclave) grows the derived measurement: refuse it here."""
    measured = measurement.measured_sources(ROLES[role])
    stray = sorted(m for m in measured if not m.startswith(MAY_RUN[role]))
    assert stray == [], f"the {role} measurement reaches {stray}"
