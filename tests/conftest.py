"""Fixtures shared by the whole suite (pytest loads this file itself).

Helper functions and classes live in :mod:`tests.support` and are imported from there;
everything secret is created under pytest's ``tmp_path``, nothing is written into the repo.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sealfl.attestation.release import read_release_dir
from sealfl.enclave.release.enclave import ReleaseEnclave
from tests.support.releases import MODEL_FILE, default_payload
from tests.support.swtpm import backend, swtpm  # noqa: F401  (fixtures: a real swtpm, each TEE backend)


@pytest.fixture
def enclave(tmp_path: Path) -> ReleaseEnclave:
    """A freshly provisioned sim release enclave in tmp_path/enclave."""
    return ReleaseEnclave.create(tmp_path / "enclave")


@pytest.fixture
def trust_dir(tmp_path: Path, enclave: ReleaseEnclave) -> Path:
    """Trust anchors exported by ``enclave`` (min_version 0)."""
    return enclave.export_trust(tmp_path / "trust")


@pytest.fixture
def release_dir(tmp_path: Path, enclave: ReleaseEnclave) -> Path:
    """A good release (version 3) written by ``enclave``."""
    out = tmp_path / "release-v3"
    enclave.write_release(out, default_payload(), "heart-mlp", 3, {"model_file": MODEL_FILE})
    return out


@pytest.fixture
def release_files(release_dir: Path) -> dict[str, bytes]:
    """All files of ``release_dir`` as {name: bytes}."""
    return read_release_dir(release_dir)


@pytest.fixture
def server_identity(monkeypatch):
    """The identity a ServerApp process has when it creates messages (run 1, SuperLink node 1)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1, raising=False)
