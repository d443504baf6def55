"""The old import paths of sealfl 0.1 still work for one release (sealfl._moved), and
nothing of sealfl, its tests or its benchmarks uses them any more."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from sealfl._moved import MOVED_MODULES, MOVED_NAMES

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_is_the_new_module(old):
    code = (f"import warnings\nwith warnings.catch_warnings(record=True) as seen:\n"
            f"    warnings.simplefilter('always')\n    import {old}\n"
            f"print([str(w.message) for w in seen if w.category is DeprecationWarning])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    assert f"{old} moved to {MOVED_MODULES[old]}" in out.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert importlib.import_module(old) is importlib.import_module(MOVED_MODULES[old])


@pytest.mark.parametrize("old", sorted(MOVED_NAMES))
def test_an_old_name_is_found_through_its_old_module(old):
    module, name = old
    new_module, new_name = MOVED_NAMES[old]
    with pytest.warns(DeprecationWarning, match=new_module):
        got = getattr(importlib.import_module(module), name)
    assert got is getattr(importlib.import_module(new_module), new_name)
    with pytest.raises(AttributeError):
        getattr(importlib.import_module(module), "NoSuchName")


def test_nothing_of_sealfl_imports_an_old_path():
    old = set(MOVED_MODULES)
    users = []
    for path in sorted([*REPO.joinpath("sealfl").rglob("*.py"), *REPO.joinpath("tests").rglob("*.py"),
                        *REPO.joinpath("bench").rglob("*.py")]):
        if path.name == "_moved.py" or path == Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_bytes())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            users += [f"{path.relative_to(REPO)}: {n}" for n in names if n in old]
    assert users == []
