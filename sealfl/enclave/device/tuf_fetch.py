"""The device's TUF client: ``tuf.ngclient.Updater`` with length caps and time limits.

python-tuf makes every trust decision (the client workflow of the TUF specification,
section 5: root rotation, timestamp, snapshot, targets, each for signature threshold,
version, expiry and length/hashes). This module only configures it:

* :class:`UpdateLimits` -- one object for every cap: the metadata lengths of
  ``UpdaterConfig``, the largest release file and release, the socket (gap) timeout and a
  **deadline per download**. urllib3's read timeout is a gap timeout: a mirror that sends
  one byte just before each gap expires (a slow-loris) would hold a plain client forever;
  :class:`DeadlineFetcher` reads with ``read1`` (returns what has arrived) and gives up,
  raising ``SlowRetrievalError``, once a download has taken longer than its deadline, so
  a fetch ends within ``deadline + gap timeout``.
* :func:`make_updater` -- the ``Updater`` over a metadata directory, bootstrapped from the
  trusted root bytes the first time (``bootstrap`` is required by python-tuf 7; later runs
  start from the local ``root.json`` the updater keeps).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import urllib3
from tuf.api import exceptions as tuf_exc
from tuf.ngclient import Updater, UpdaterConfig
from tuf.ngclient.urllib3_fetcher import Urllib3Fetcher

__all__ = ["UpdateLimits", "DEFAULT_LIMITS", "MirrorUnreachable", "DeadlineFetcher", "make_updater"]

_READ = 64 << 10


@dataclass(frozen=True)
class UpdateLimits:
    """Caps for a device update (bytes, seconds).

    Attributes:
        root_max_bytes, timestamp_max_bytes, snapshot_max_bytes, targets_max_bytes: the
            largest metadata file of each role (``UpdaterConfig``).
        max_root_rotations: root versions walked in one refresh at most.
        max_file_bytes: the largest release file (targets metadata may say less, never more).
        max_release_bytes: all files of one release together.
        socket_timeout_s: connect and gap (between bytes) timeout.
        download_deadline_s: the longest one file's download may take.
    """

    root_max_bytes: int = 512 << 10
    timestamp_max_bytes: int = 16 << 10
    snapshot_max_bytes: int = 2 << 20
    targets_max_bytes: int = 5 << 20
    max_root_rotations: int = 32
    max_file_bytes: int = 2 << 30
    max_release_bytes: int = 4 << 30
    socket_timeout_s: float = 10.0
    download_deadline_s: float = 300.0

    def updater_config(self) -> UpdaterConfig:
        """The matching ``tuf.ngclient.UpdaterConfig``."""
        return UpdaterConfig(max_root_rotations=self.max_root_rotations, root_max_length=self.root_max_bytes,
                             timestamp_max_length=self.timestamp_max_bytes,
                             snapshot_max_length=self.snapshot_max_bytes, targets_max_length=self.targets_max_bytes,
                             app_user_agent="sealfl-device")


DEFAULT_LIMITS = UpdateLimits()


class MirrorUnreachable(tuf_exc.DownloadError):
    """No connection to the mirror: refused, no route, or its name does not resolve (not a
    stall: nothing was ever answered)."""


class DeadlineFetcher(Urllib3Fetcher):
    """python-tuf's urllib3 fetcher with a deadline per download (module docstring)."""

    def __init__(self, limits: UpdateLimits = DEFAULT_LIMITS) -> None:
        super().__init__(socket_timeout=limits.socket_timeout_s, app_user_agent="sealfl-device")
        self._deadline_s = limits.download_deadline_s

    def _fetch(self, url: str) -> Iterator[bytes]:
        deadline = time.monotonic() + self._deadline_s
        try:
            response = self._proxy_env.request("GET", url, preload_content=False, redirect=False,
                                               timeout=urllib3.Timeout(connect=self.socket_timeout,
                                                                       read=self.socket_timeout),
                                               retries=urllib3.Retry(total=0, redirect=0))
        except urllib3.exceptions.MaxRetryError as exc:
            # urllib3's NewConnectionError derives from ConnectTimeoutError: test it first
            if isinstance(exc.reason, urllib3.exceptions.NewConnectionError):
                raise MirrorUnreachable(f"{url}: the mirror refused the connection or is unreachable "
                                        f"({str(exc.reason)[:200]})") from exc
            if isinstance(exc.reason, urllib3.exceptions.TimeoutError):
                raise tuf_exc.SlowRetrievalError(f"{url}: no answer within {self.socket_timeout} s") from exc
            raise tuf_exc.DownloadError(f"{url}: {exc.reason}") from exc
        if response.status != 200:
            response.close()
            raise tuf_exc.DownloadHTTPError(f"{url}: HTTP {response.status}", response.status)
        return self._bounded(url, response, deadline)

    def _bounded(self, url: str, response, deadline: float) -> Iterator[bytes]:
        try:
            while True:
                if time.monotonic() > deadline:
                    raise tuf_exc.SlowRetrievalError(f"{url}: not complete after the {self._deadline_s} s download "
                                                     "deadline (a stalling mirror)")
                data = response.read1(_READ)
                if not data:
                    return
                yield data
        except urllib3.exceptions.TimeoutError as exc:
            raise tuf_exc.SlowRetrievalError(f"{url}: nothing received for {self.socket_timeout} s") from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise tuf_exc.DownloadError(f"{url}: {exc}") from exc
        finally:
            response.release_conn()


def make_updater(metadata_dir: str, repo_url: str, *, bootstrap: bytes | None, target_dir: str | None = None,
                 limits: UpdateLimits = DEFAULT_LIMITS, metadata_url: str | None = None,
                 targets_url: str | None = None) -> Updater:
    """An ``Updater`` for the repository at ``repo_url`` (``metadata/`` and ``targets/``
    below it, as ``sealfl repo serve`` lays them out; or the explicit URLs).

    Args:
        metadata_dir: the device's trusted metadata (created by the caller, private).
        repo_url: ``http(s)://host:port[/path]`` of the repository.
        bootstrap: trusted root bytes when the metadata dir holds no ``root.json`` yet,
            else None (python-tuf then starts from the local ``root.json``).
        target_dir: where ``download_target`` writes by default.
        limits: :class:`UpdateLimits`.
    """
    base = repo_url.rstrip("/")
    return Updater(metadata_dir, metadata_url or f"{base}/metadata/", target_dir, targets_url or f"{base}/targets/",
                   fetcher=DeadlineFetcher(limits), config=limits.updater_config(), bootstrap=bootstrap)
