"""The version a user sees (``sealfl --version``, ``GET /v2``) is the one pyproject.toml declares."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import sealfl

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_kind_the_package_version_is_pyprojects():
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert sealfl.__version__ == declared
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"sealfl {declared}"
