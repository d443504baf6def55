"""``sealfl repo serve``: the repository's ``www/`` over plain HTTP (stdlib ``http.server``).

TUF makes the transport untrusted, so a static file server is all a repository needs: GET
and HEAD of files under ``REPO/www`` (``metadata/`` and ``targets/``), no directory
listings, nothing outside ``www`` (the online keys in ``REPO/keys`` are never reachable).
Binds 127.0.0.1 by default; port 0 picks a free one.
"""

from __future__ import annotations

import functools
import logging
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["RepoServer"]

log = logging.getLogger(__name__)


class _Handler(SimpleHTTPRequestHandler):
    def list_directory(self, path):  # no listings: a client asks for names TUF gave it
        self.send_error(404, "not found")
        return None

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        log.info("%s %s", self.address_string(), format % args)


class RepoServer:
    """Serve ``www`` on ``host:port`` in a background thread.

    Attributes:
        url: ``http://host:port`` (the device's ``--repo``).
    """

    def __init__(self, www: str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = functools.partial(_Handler, directory=str(Path(www).resolve()))
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self.host, self.port = self._httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread: threading.Thread | None = None

    def start(self) -> "RepoServer":
        """Start serving in a daemon thread; return self."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="repo-serve", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "RepoServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
