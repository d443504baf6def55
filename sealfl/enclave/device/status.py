"""``sealfl device status``: what a device runs and how its last update went (read only).

:func:`device_status` reads, and never changes: ``state.json`` (the running release and the
rollback floor, :class:`~sealfl.attestation.device_state.DeviceState`), ``tee/tee.json``
(the TEE backend), ``update.json`` (the last update check, :mod:`.update`) and
``last_refused.json`` (why the last new release was refused, :mod:`.boot`) and
``repo-floor.json`` (:mod:`sealfl.attestation.repo_floor`). It does not
open the TEE (that would reset the PCRs of a running device).

The returned dict (``--json`` prints it)::

    {"state_dir": str,
     "release": null | {"name", "version", "root_digest", "statement_digest", "model_file",
                        "slot", "source": {"kind": "repository", "repo": url, "at": time}
                                          | {"kind": "directory", "path": str}},
     "tee_backend": null | "tpm" | "sim",   "insecure": bool,
     "rollback_floor": null | int,          # the version below which nothing boots
     "repository_floor": null | {"name", "version", "root_version"},   # see repo_floor
     "last_update": null | {"checked_at", "result", "message", "repo"},
     "last_refused": null | {"reason", "file", "check", "message", "time"}}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sealfl.attestation.errors import DeviceStateError
from sealfl.attestation.quote import INSECURE_BACKENDS
from sealfl.attestation.repo_floor import REPO_FLOOR_FILE, RepoFloor
from sealfl.enclave.device.boot import REFUSAL_FILE, read_device_state
from sealfl.enclave.device.provision import TEE_DIR, recorded_backend
from sealfl.enclave.device.update import read_update_record

__all__ = ["device_status", "format_status"]


def _json_or_none(path: Path) -> dict | None:
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _repo_floor(root: Path) -> dict | None:
    try:
        with open(root / REPO_FLOOR_FILE, "rb") as fh:
            f = RepoFloor.from_bytes(fh.read(4096))
    except (OSError, DeviceStateError):
        return None
    return {"name": f.name, "version": f.version, "root_version": f.root_version}


def device_status(state_dir: str | os.PathLike) -> dict:
    """The status dict of the module docstring.

    Raises:
        BootError: (reason ``"state"``) ``state.json`` exists but is malformed.
        TEEStateError: ``tee/tee.json`` is unreadable.
    """
    root = Path(state_dir)
    state = read_device_state(root)
    backend = recorded_backend(root / TEE_DIR)
    update = read_update_record(root)
    release = None
    if state.last_good is not None:
        lg = state.last_good
        installed = update.get("installed") if isinstance(update.get("installed"), dict) else None
        if installed and installed.get("root_digest") == lg.root_digest and installed.get("version") == lg.version:
            source = {"kind": "repository", "repo": installed.get("repo"), "at": installed.get("at")}
        else:
            source = {"kind": "directory", "path": lg.source_dir}
        release = {"name": lg.name, "version": lg.version, "root_digest": lg.root_digest,
                   "statement_digest": lg.statement_digest, "model_file": lg.model_file, "slot": lg.slot,
                   "source": source}
    last_update = None
    if update:
        last_update = {k: update.get(k) for k in ("checked_at", "result", "message", "repo")}
    return {"state_dir": str(root), "release": release, "tee_backend": backend,
            "insecure": backend in INSECURE_BACKENDS if backend else False,
            "rollback_floor": state.last_good.version if state.last_good is not None else None,
            "repository_floor": _repo_floor(root), "last_update": last_update, "last_refused": _json_or_none(root / REFUSAL_FILE)}


def format_status(s: dict) -> list[str]:
    """Human-readable lines of :func:`device_status`'s dict."""
    lines = []
    r = s["release"]
    if r is None:
        lines.append("release: none (the device has not booted a release)")
    else:
        src = r["source"]
        where = (f"repository {src['repo']} at {src['at']}" if src["kind"] == "repository"
                 else f"directory {src['path']}")
        lines += [f"release: {r['name']} v{r['version']}", f"root digest: {r['root_digest']}",
                  f"model file: {r['model_file']} (slot {r['slot']})", f"source: {where}"]
    tee = s["tee_backend"] or "none (not provisioned)"
    lines.append(f"TEE backend: {tee}" + (" (INSECURE simulation)" if s["insecure"] else ""))
    lines.append(f"rollback floor: {'none' if s['rollback_floor'] is None else 'v' + str(s['rollback_floor'])}")
    f = s.get("repository_floor")
    if f:
        lines.append(f"repository floor: {f['name']} v{f['version']} (TUF root v{f['root_version']})")
    u = s["last_update"]
    lines.append("last update check: never" if u is None else
                 f"last update check: {u['checked_at']} from {u['repo']}: {u['result']} ({u['message']})")
    if s["last_refused"]:
        lines.append(f"last refused release: {s['last_refused'].get('message')}")
    return lines
