"""The two-node Ray cluster cases (tests/platform/ray_cluster_cases.py) in a fresh Python
process: Ray caches a process's first authentication mode and token, and other tests of this
pytest process start token-less local Ray instances first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("ray_cluster_cases.py")


def test_kind_campaigns_on_a_two_node_token_cluster_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(CASES)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " 8 passed" in f" {summary}" and "skipped" not in summary, summary
