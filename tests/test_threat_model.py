"""docs/threat-model.md: every test it names exists (a module-level ``def``/``async def`` in
that file, or a method of a class there), and every claim row names at least one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "threat-model.md"
NAMED = re.compile(r"(tests/[\w/]+\.py)::(test_\w+)")


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_kind_every_test_the_threat_model_names_exists():
    text = DOC.read_text()
    named = NAMED.findall(text)
    assert len(named) >= 30, "the threat model names fewer tests than it did when this check was written"
    missing = [f"{f}::{t}" for f, t in named if not (ROOT / f).is_file() or t not in _defined(ROOT / f)]
    assert missing == [], f"docs/threat-model.md names tests that do not exist: {missing}"


def test_kind_every_claim_row_names_a_test():
    rows = [line for line in DOC.read_text().splitlines()
            if line.startswith("| ") and not line.startswith(("| claim", "|---", "| asset"))]
    claims = [r for r in rows if r.count("|") == 3]  # the claim tables have two columns
    assert claims, "no claim rows found"
    unbacked = [r for r in claims if not NAMED.search(r)]
    assert unbacked == [], f"claims without a test: {unbacked}"
