"""The TUF project's black-box conformance suite against ``sealfl device tuf-client``.

The suite is not on PyPI and is not copied into this repository: a snapshot lives in the
workplace's shared folder beside the repository (``../shared/vendor/tuf-conformance``; a
clean clone in CI has the same folder beside it), or wherever ``SEALFL_TUF_CONFORMANCE``
points. It needs Debian's ``faketime`` (``scripts/install-faketime.sh``).

The suite runs in a subprocess with this venv's pytest and python-tuf; its outcomes come
from its JUnit XML. Every test sealfl's client fails is then run again with python-tuf's
reference client (``clients/python-tuf/python_tuf.py`` of the suite): sealfl must fail no
test the reference passes. (On this machine sealfl's client passed all 113 in 212 s with
the box loaded by other jobs; the reference all 113 in 146 s.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


#: where the vendored suite may be: beside the repository (``../shared/vendor``, a checkout in
#: the workplace), then the workplace's own copy (a clean clone elsewhere on this machine, as CI
#: and fresh-check make); SEALFL_TUF_CONFORMANCE overrides both
CANDIDATES = (REPO.parent / "shared" / "vendor" / "tuf-conformance", Path("/work/shared/vendor/tuf-conformance"))


def _suite() -> Path:
    env = os.environ.get("SEALFL_TUF_CONFORMANCE")
    for path in ([Path(env)] if env else list(CANDIDATES)):
        if (path / "tuf_conformance" / "conftest.py").is_file():
            return path
    pytest.fail(f"the tuf-conformance suite is not at {env or ' or '.join(map(str, CANDIDATES))}: put the snapshot "
                "there (../shared/vendor/tuf-conformance beside the repository) or set SEALFL_TUF_CONFORMANCE")


def _run(suite: Path, entrypoint: str, out: Path, select: list[str] | None = None) -> dict[str, str]:
    """Run the suite (or the ``select``ed test names); return {test name: passed|failed|skipped}."""
    xml = out / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", str(suite / "tuf_conformance"), "-p", "no:cacheprovider", "-q",
           "--rootdir", str(out), "--junitxml", str(xml), "--entrypoint", entrypoint]
    if select:
        cmd += ["-k", " or ".join(select)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=1500)
    assert xml.is_file(), f"the suite did not run: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kids = {child.tag for child in case}
        outcomes[case.get("name")] = ("failed" if kids & {"failure", "error"} else
                                      "skipped" if "skipped" in kids else "passed")
    return outcomes


@pytest.mark.slow
def test_tuf_conformance_suite_sealfl_fails_nothing_the_reference_passes(tmp_path):
    assert shutil.which("faketime"), "faketime is missing: run scripts/install-faketime.sh"
    suite = _suite()
    (tmp_path / "sealfl").mkdir()
    ours = _run(suite, f"{sys.executable} -m sealfl.platform.cli device tuf-client", tmp_path / "sealfl")
    assert len(ours) >= 100, f"the suite ran only {len(ours)} tests"
    failed = sorted(name for name, outcome in ours.items() if outcome == "failed")
    if failed:
        (tmp_path / "reference").mkdir()
        reference = _run(suite, f"{sys.executable} {suite / 'clients' / 'python-tuf' / 'python_tuf.py'}",
                         tmp_path / "reference", [name.split("[")[0] for name in failed])
        worse = [name for name in failed if reference.get(name) == "passed"]
        assert not worse, f"sealfl's client fails tests python-tuf's reference client passes: {worse}"
