"""Helpers for tests of the TUF repository and the device updater: a real repository
(:class:`sealfl.platform.repo.repository.Repository`), real releases signed by a sim release
enclave, served over loopback HTTP by the real :class:`RepoServer` (or a hostile server)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from sealfl.attestation.reader import read_release_dir
from sealfl.attestation.repo_index import TUF_ROOT_FILE
from sealfl.enclave.device.verify import verify_dir
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.platform.repo.repository import Repository
from tests.support.releases import MODEL_FILE, default_payload, make_onnx_model

__all__ = ["NAME", "make_repo", "publish_verified", "publish_raw", "new_release", "provision_trust", "StallingServer"]

NAME = "heart-mlp"


def make_repo(tmp: Path) -> Repository:
    """A fresh repository in ``tmp/repo`` with root keys in ``tmp/offline``."""
    return Repository.init(tmp / "repo", tmp / "offline")


def new_release(enclave: ReleaseEnclave, out: Path, version: int, name: str = NAME, weight: float = 0.5) -> Path:
    """A release directory written (and self-verified) by ``enclave``; ``weight`` varies the model."""
    import numpy as np

    from tests.support.releases import WEIGHTS

    w = WEIGHTS.copy()
    w[0, 0] = np.float32(weight)
    payload = {**default_payload(), MODEL_FILE: make_onnx_model(w)}
    enclave.write_release(out, payload, name, version, {"model_file": MODEL_FILE})
    return out


def publish_verified(repo: Repository, trust_dir: Path, release_dir: Path):
    """Publish a release as ``sealfl repo publish`` does: verified first, its own claim."""
    v = verify_dir(trust_dir, release_dir)
    return repo.publish(v.files(), v.name, v.version, v.root_digest)


def publish_raw(repo: Repository, release_dir: Path, name: str, version: int, root_digest: str):
    """Publish every file of ``release_dir`` unverified, under the claim given (what a
    careless or compromised coordinator could do)."""
    return repo.publish(read_release_dir(release_dir), name, version, root_digest)


def provision_trust(trust_dir: Path, repo: Repository) -> Path:
    """Copy the repository's version-1 root into ``trust_dir`` as the device's TUF trust root."""
    (trust_dir / TUF_ROOT_FILE).write_bytes(repo.root_bytes(1))
    return trust_dir


class StallingServer:
    """A hostile mirror: answers every GET with a huge Content-Length, then one byte every
    ``gap_s`` seconds forever (a slow-loris), until stopped."""

    def __init__(self, gap_s: float = 0.3) -> None:
        stop = self._stop = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 30))
                self.end_headers()
                try:
                    while not stop.is_set():
                        self.wfile.write(b"{")
                        self.wfile.flush()
                        time.sleep(gap_s)
                except OSError:
                    pass

            def log_message(self, *args):
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> "StallingServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()

