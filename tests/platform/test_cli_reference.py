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


def test_kind_every_argument_has_its_help_in_help_and_in_the_reference():
    import os
    import subprocess
    import sys

    # click 8.5 reset the help typer 0.20 gives an argument: '--help' showed none of them
    rows = [ln for ln in render_reference().splitlines() if "| argument" in ln]
    assert rows and all(not ln.rstrip().endswith("|  |") for ln in rows), [ln for ln in rows if ln.endswith("|  |")]
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "partner", "keygen", "--help"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0 and "Where to write partner_key.pem" in out.stdout, out.stdout


def test_kind_a_groups_command_list_has_one_paragraph_per_command_not_the_docstrings_line_breaks():
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "partner", "--help"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "2000"})
    # at 2000 columns each command's summary fits on its own line
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("│ ")]
    assert [ln.split()[1] for ln in lines if ln.split()[1] in ("keygen", "check", "start")] == ["keygen", "check", "start"]
    assert len([ln for ln in lines if "--help" not in ln]) == 3, out.stdout
