"""The layers of ARCHITECTURE.md hold: ``lint-imports`` (import-linter) checks the contracts
in pyproject.toml -- an upward import, a cycle between components, or a device module that
imports HE, torch, Flower or Ray fails here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "lint-imports (import-linter) is not installed: pip install -e '.[dev]'"
    out = subprocess.run([exe, "--config", str(REPO / "pyproject.toml")], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_ruff_finds_no_undefined_name_or_unused_import():
    """``ruff check`` with the rules of pyproject.toml (syntax errors, pyflakes, import order)."""
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert exe, "ruff is not installed: pip install -e '.[dev]'"
    out = subprocess.run([exe, "check", "sealfl", "tests", "bench"], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_architecture_layout_table_names_every_top_level_package():
    """docs/architecture.md "Layout" lists the packages that exist, each once, and no other."""
    import re

    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Layout"):]
    section = section[:section.index("\n## ")] if "\n## " in section else section
    listed = re.findall(r"^\| `(sealfl\.\w+)` \|", section, re.M)
    packages = sorted(f"sealfl.{p.name}" for p in (REPO / "sealfl").iterdir()
                      if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(listed) == packages and len(listed) == len(set(listed))
