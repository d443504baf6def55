"""docs/cli.md is what the CLI says about itself today (regenerate it with
``python -m sealfl.platform.cli.reference > docs/cli.md`` after changing a command)."""

from __future__ import annotations

from pathlib import Path

from sealfl.platform.cli.reference import render_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_kind_the_committed_cli_reference_matches_the_cli():
    now = render_reference()
    assert "## `sealfl device serve`" in now and "`--access-log`" in now and "## `sealfl repo publish`" in now
    assert DOC.read_text() == now, "docs/cli.md is stale: python -m sealfl.platform.cli.reference > docs/cli.md"
