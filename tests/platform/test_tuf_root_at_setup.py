"""The TUF root keys are made at ``consortium create`` (kept in the coordinator's authority
directory) and ``repo init --consortium`` signs the first root with them (real CLI processes)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tuf.api.metadata import Metadata

from sealfl.platform.repo.keys import ROOT_THRESHOLD, make_authority_root_keys, read_root_keys
from sealfl.platform.repo.repository import Repository


def _cli(*args, timeout=300):
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], capture_output=True,
                         text=True, timeout=timeout)
    return out.returncode, out.stdout, " ".join(out.stderr.split())


@pytest.mark.slow
def test_consortium_create_makes_the_tuf_root_keys_and_repo_init_uses_them(tmp_path):
    cons = tmp_path / "cons"
    code, out, err = _cli("consortium", "create", cons, "-p", "Cleveland", "-p", "Hungary")
    assert code == 0, err
    keydir = cons / "authority" / "tuf-root"
    assert keydir.stat().st_mode & 0o777 == 0o700
    keys = read_root_keys(keydir)  # also refuses a key readable by others
    assert len(keys) == 3 and str(keydir) in " ".join(out.split())
    code, out, err = _cli("repo", "init", tmp_path / "repo", "-c", cons, "--trust", tmp_path / "device-trust")
    assert code == 0, err
    root = Metadata.from_bytes(Repository(tmp_path / "repo").root_bytes(1)).signed
    assert set(root.roles["root"].keyids) == set(keys) and root.roles["root"].threshold == ROOT_THRESHOLD
    assert sorted(p.name for p in keydir.iterdir()) == sorted(f"root-{k[:16]}.pem" for k in keys)  # none added
    # the same keys rotate the root later
    code, _, err = _cli("repo", "rotate", "root", "--repo", tmp_path / "repo", "--offline-keys", keydir,
                        "--new-offline-keys", tmp_path / "tuf-root-2")
    assert code == 0, err


def test_repo_init_takes_one_source_of_root_keys(tmp_path):
    code, _, err = _cli("repo", "init", tmp_path / "r1")
    assert code == 1 and "give --offline-keys DIR" in err and "--consortium DIR" in err
    code, _, err = _cli("repo", "init", tmp_path / "r1", "-c", tmp_path / "cons", "--offline-keys", tmp_path / "o")
    assert code == 1 and "not both" in err
    (tmp_path / "cons").mkdir()
    code, _, err = _cli("repo", "init", tmp_path / "r1", "-c", tmp_path / "cons")
    assert code == 1 and "holds no TUF root keys" in err and "give --offline-keys" in err
    assert not (tmp_path / "r1").exists() and not (tmp_path / "o").exists()
    make_authority_root_keys(tmp_path / "cons")
    with pytest.raises(Exception, match="already holds root keys"):
        make_authority_root_keys(tmp_path / "cons")  # never overwritten
    next((tmp_path / "cons" / "authority" / "tuf-root").glob("root-*.pem")).unlink()
    code, _, err = _cli("repo", "init", tmp_path / "r1", "-c", tmp_path / "cons")
    assert code == 1 and "holds 2 root keys, not 3" in err
    assert not (tmp_path / "r1" / "www").exists()
