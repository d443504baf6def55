"""Mistakes of a new user's first hour with the repository and a device, each refused in one
line that says what is wrong and what to run (real CLI processes)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.tufrepo import make_repo, new_release


def _cli(*args, timeout=300):
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], capture_output=True,
                         text=True, timeout=timeout)
    return out.returncode, " ".join(out.stderr.split())


def test_repo_publish_with_its_arguments_swapped_says_which_is_which(tmp_path, enclave, trust_dir):
    repo = make_repo(tmp_path)
    release = new_release(enclave, tmp_path / "r3", 3)
    before = sorted(p.relative_to(repo.dir) for p in repo.dir.rglob("*"))
    code, msg = _cli("repo", "publish", release, repo.dir, "--trust", trust_dir)
    assert code == 1 and "the arguments are swapped" in msg, msg
    assert f"{repo.dir} is the repository" in msg and f"sealfl repo publish {repo.dir} {release}" in msg
    assert "Traceback" not in msg and "missing-file" not in msg
    assert sorted(p.relative_to(repo.dir) for p in repo.dir.rglob("*")) == before  # nothing written
    code, msg = _cli("repo", "publish", tmp_path / "r3", tmp_path / "r3", "--trust", trust_dir)
    assert code == 1 and "is not a sealfl repository (no repo.json)" in msg and "'sealfl repo init'" in msg


def test_device_status_of_a_missing_state_directory_says_so_and_what_to_run(tmp_path):
    missing = tmp_path / "no-such-state"
    code, msg = _cli("device", "status", "--state", missing)
    assert code == 1 and f"the device state directory {missing} does not exist" in msg, msg
    assert f"sealfl device provision --state {missing}" in msg and "sealfl device update" in msg
    assert not missing.exists()
    (tmp_path / "afile").write_text("x")
    code, msg = _cli("device", "status", "--state", tmp_path / "afile")
    assert code == 1 and "is not a directory" in msg
