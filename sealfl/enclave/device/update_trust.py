"""The trust inputs of ``device update``, read before anything is fetched or decided.

* :func:`check_trust_files` -- the trust directory must load (release keys, AK, policy:
  :func:`~sealfl.attestation.trust.load_trust_anchors`) and its ``tuf-root.json``, when
  present, must be TUF root metadata signed by its own threshold -- also when the device
  already keeps a newer root of its own and would not read it: a damaged trust file is
  named and refused, never answered with "up to date".
* :func:`check_repo_floor` -- the I/O around :func:`sealfl.attestation.repo_floor.decide_floor`:
  read ``STATE/repo-floor.json`` and the root chain python-tuf accepted
  (``STATE/tuf/root_history/<v>.root.json`` from the floor's root version, then the trusted
  ``STATE/tuf/root.json``), each under a length cap; store the decided floor atomically.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tuf.api.metadata import Metadata, Root

from sealfl.attestation.errors import DeviceStateError, TrustAnchorError
from sealfl.attestation.repo_floor import REPO_FLOOR_FILE, FloorDecision, RepoFloor, decide_floor
from sealfl.attestation.repo_index import TUF_ROOT_FILE
from sealfl.attestation.trust import load_trust_anchors
from sealfl.common.fsutil import atomic_write
from sealfl.enclave.device.tuf_fetch import UpdateLimits
from sealfl.enclave.errors import UpdateError

__all__ = ["check_trust_files", "check_repo_floor"]

log = logging.getLogger(__name__)

_MAX_CHAIN = 1024


def _read_capped(path: Path, cap: int, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read(cap + 1)
    except OSError as exc:
        raise UpdateError(f"cannot read {what} {path}: {exc}", stage="trust") from exc
    if len(data) > cap:
        raise UpdateError(f"{what} {path} is larger than {cap} bytes", stage="trust")
    return data


def check_trust_files(trust_dir: Path, limits: UpdateLimits) -> None:
    """Refuse a trust directory that does not load, or whose ``tuf-root.json`` is not TUF
    root metadata signed by its own threshold (module docstring).

    Raises:
        UpdateError: stage ``trust``, naming the file.
    """
    try:
        load_trust_anchors(trust_dir)
    except TrustAnchorError as exc:
        raise UpdateError(f"the trust directory {trust_dir} is damaged: {exc}; nothing was fetched, the running "
                          "release is kept", stage="trust") from exc
    path = trust_dir / TUF_ROOT_FILE
    if not path.exists():
        return
    data = _read_capped(path, limits.root_max_bytes, "the TUF trust root")
    try:
        md = Metadata.from_bytes(data)
        if not isinstance(md.signed, Root):
            raise ValueError(f"it is {md.signed.type} metadata")
        md.signed.verify_delegate(Root.type, md.signed_bytes, md.signatures)
    except Exception as exc:  # python-tuf raises several types for bytes that are not a signed root
        raise UpdateError(f"{path} is not a TUF root signed by its own keys ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); nothing was fetched, the running release is kept (copy the "
                          "repository's REPO/www/metadata/1.root.json there again)", stage="trust") from None


def check_repo_floor(state_root: Path, metadata_dir: Path, name: str, offered: int, running: int | None,
                     limits: UpdateLimits) -> FloorDecision:
    """Decide the repository floor for ``name`` v``offered`` (``running``: the version the
    device runs, or None) over the root chain python-tuf keeps in ``metadata_dir``; store the
    new floor in ``state_root``; return the decision (``keep`` or ``rebase``).

    Raises:
        UpdateError: stage ``trust`` (no valid root chain, an unreadable or damaged file) or
            ``index`` (the offer is below the floor); nothing is stored then.
    """
    path = state_root / REPO_FLOOR_FILE
    floor = None
    if path.exists():
        try:
            floor = RepoFloor.from_bytes(_read_capped(path, 4096, "the repository floor"))
        except DeviceStateError as exc:
            raise UpdateError(f"{path}: {exc}; the running release is kept. If the file was damaged, delete it: the "
                              "floor is then set afresh under the current TUF root (the TEE floor still keeps the "
                              "running version)", stage="trust") from exc
    current = _read_capped(metadata_dir / "root.json", limits.root_max_bytes, "the trusted TUF root")
    try:
        current_version = json.loads(current)["signed"]["version"]
    except (ValueError, KeyError, TypeError):
        raise UpdateError(f"{metadata_dir / 'root.json'} is not TUF root metadata", stage="trust") from None
    if floor is not None and floor.name == name and floor.root_version != current_version:
        if not isinstance(current_version, int) or not 0 < current_version - floor.root_version <= _MAX_CHAIN:
            raise UpdateError(f"the trusted TUF root is v{current_version}, the repository floor was set under root "
                              f"v{floor.root_version}: no chain of at most {_MAX_CHAIN} rotations joins them",
                              stage="trust")
        history = metadata_dir / "root_history"
        chain = [_read_capped(history / f"{v}.root.json", limits.root_max_bytes, "the accepted TUF root")
                 for v in range(floor.root_version, current_version)] + [current]
    else:
        chain = [current]
    decision = decide_floor(floor, chain, name, offered, running)
    if decision.action == "refuse":
        raise UpdateError(f"the repository floor refused {name} v{offered}: {decision.reason}; the running release "
                          "is kept", stage="trust" if decision.check == "chain" else "index")
    if decision.floor != floor:
        atomic_write(path, decision.floor.to_bytes(), 0o600)
    log.log(logging.WARNING if decision.action == "rebase" else logging.DEBUG, "repository floor: %s (%s)",
            decision.action, decision.reason)
    return decision
