"""``sealfl device tuf-client``: the device's TUF client behind the tuf-conformance CLI.

The TUF project's black-box conformance suite drives a client through three commands
(its ``CLIENT-CLI.md``): ``init TRUSTED_ROOT``, ``refresh`` and ``download``, with the
metadata directory, metadata URL, target names, target base URL and target directory as
options; exit 0 on success, 1 on any failure. These functions run exactly the updater
``device update`` runs (:func:`~sealfl.enclave.device.tuf_fetch.make_updater`: the same
``UpdaterConfig`` caps and the same deadline fetcher), so the suite tests the device's
client, not a second one.

Artifacts are stored under their target path inside the target directory (directories
created as needed, names that would leave it refused), and a target already there with
matching length and hashes is not downloaded again.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from sealfl.enclave.device.tuf_fetch import DEFAULT_LIMITS, UpdateLimits, make_updater
from sealfl.enclave.errors import UpdateError

__all__ = ["init", "refresh", "download"]

log = logging.getLogger(__name__)


def init(metadata_dir: str | os.PathLike, trusted_root: str | os.PathLike) -> None:
    """Install ``trusted_root`` as the client's trusted root (no network, no checks: the
    first refresh verifies it against itself, as the TUF workflow does)."""
    Path(metadata_dir).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(trusted_root, Path(metadata_dir) / "root.json")


def refresh(metadata_dir: str | os.PathLike, metadata_url: str, limits: UpdateLimits = DEFAULT_LIMITS) -> None:
    """The TUF client workflow's refresh of the top-level metadata.

    Raises:
        tuf.api.exceptions.RepositoryError / DownloadError: refused or failed.
    """
    make_updater(str(metadata_dir), "", bootstrap=None, limits=limits, metadata_url=metadata_url,
                 targets_url="unused/").refresh()


def _local_path(target_dir: Path, target: str) -> Path:
    parts = target.split("/")
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise UpdateError(f"target path {target[:200]!r} would leave the target directory", stage="index")
    return target_dir.joinpath(*parts)


def download(metadata_dir: str | os.PathLike, metadata_url: str, targets: list[str], target_base_url: str,
             target_dir: str | os.PathLike, limits: UpdateLimits = DEFAULT_LIMITS) -> list[Path]:
    """Download ``targets`` in order with one updater; return their local paths.

    Raises:
        UpdateError: a target is not in the repository or its path would leave ``target_dir``.
        tuf.api.exceptions.RepositoryError / DownloadError: refused or failed.
    """
    root = Path(target_dir)
    updater = make_updater(str(metadata_dir), "", bootstrap=None, target_dir=str(root), limits=limits,
                           metadata_url=metadata_url, targets_url=target_base_url)
    out = []
    for target in targets:
        info = updater.get_targetinfo(target)
        if info is None:
            raise UpdateError(f"{target} is not in the repository's targets", stage="index")
        local = _local_path(root, target)
        local.parent.mkdir(parents=True, exist_ok=True)
        cached = updater.find_cached_target(info, str(local))
        out.append(Path(cached) if cached else Path(updater.download_target(info, str(local))))
        log.info("%s -> %s%s", target, local, " (cached)" if cached else "")
    return out
