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



def test_kind_shell_completion_completes_commands():
    import os

    sealfl_bin = str(Path(sys.executable).parent / "sealfl")  # the console script: completion keys on its name
    # the script '--show-completion bash' prints, asked for as Click does: '--show-completion' itself
    # looks for the shell among its parent processes and finds none under a detached job
    script = subprocess.run([sealfl_bin], env={**os.environ, "_SEALFL_COMPLETE": "source_bash"}, capture_output=True,
                            text=True, timeout=120)
    assert script.returncode == 0 and "COMPREPLY" in script.stdout and "_SEALFL_COMPLETE" in script.stdout
    env = {**os.environ, "_SEALFL_COMPLETE": "complete_bash", "COMP_WORDS": "sealfl dev", "COMP_CWORD": "1"}
    words = subprocess.run([sealfl_bin], env=env, capture_output=True, text=True, timeout=120).stdout.split()
    assert words == ["device"]
