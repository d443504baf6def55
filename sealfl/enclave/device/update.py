"""``sealfl device update``: fetch the newest release from a TUF repository, then install it
with the device's one verification, canary and slot switch.

Order (each step refuses with :class:`~sealfl.enclave.errors.UpdateError` and changes
nothing on the device; ``state_dir/update.json`` records the check and its result):

0. the trust directory loads and its ``tuf-root.json``, when present, is a TUF root signed
   by its own keys (:func:`~sealfl.enclave.device.update_trust.check_trust_files`), even
   when the device no longer reads it -- a damaged trust file is named, never "up to date";
1. the trusted TUF root: the device's own ``state_dir/tuf/root.json`` (kept by python-tuf
   across updates and root rotations), or on first use ``TRUST/tuf-root.json`` given at
   provisioning (:data:`~sealfl.attestation.repo_index.TUF_ROOT_FILE`);
2. ``Updater.refresh()`` (:mod:`.tuf_fetch`: length caps, a deadline per download): the TUF
   client workflow decides whether the repository's metadata is trusted;
3. the release index target (:mod:`sealfl.attestation.repo_index`), length- and
   hash-checked by TUF, parsed strictly; :func:`~sealfl.attestation.repo_index.choose_update`
   picks the newest release of the device's release name -- an older one than the running
   release is refused (the device never goes back), the same one means up to date;
   then the repository floor (:func:`~sealfl.attestation.repo_floor.decide_floor` over the
   root chain python-tuf accepted, ``state_dir/tuf/root_history``) is kept, re-based after a
   rotation of the keys that set it, or refuses the offer; the new floor is stored before
   anything is downloaded;
4. a signed delta first, when the repository publishes one from the running release's root
   digest (:func:`~sealfl.attestation.repo_index.delta_target_path`; ``prefer_delta``):
   its statement verified against the pinned release keys and naming exactly the chosen
   release, its patches through ``download_target``, applied onto the running slot by
   :func:`~sealfl.enclave.device.delta.apply_delta` (exact base, signed sizes, result
   verified in full). Any refusal there is logged and recorded and the device falls back to
5. every file of that release through ``download_target`` (TUF length and SHA-256), each
   target's custom claim checked against the index, the total held to
   :attr:`UpdateLimits.max_release_bytes`, into a private staging directory beside the
   state directory (never inside it: :func:`~sealfl.enclave.device.policy.check_state_apart`);
6. the release is verified by the device's verifier
   (:func:`~sealfl.enclave.device.verify.verify_dir`, the same ``load_release`` boot runs)
   and must be what the index promised (name, version, root digest:
   :func:`~sealfl.attestation.repo_index.check_claims`) -- a validly signed release of
   another model is refused here, before anything is recorded;
7. :func:`~sealfl.enclave.device.policy.boot_or_last_good` on the staging directory:
   measurement, verification again on the bytes it loads, version rules and TEE floor,
   sandbox, canary, slot switch -- or the last good release is kept.

The staging directory is removed afterwards (boot copied the verified bytes into a slot).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tuf.api import exceptions as tuf_exc

from sealfl.attestation.delta import DELTA_FILE, PATCH_DIR, verify_delta_statement
from sealfl.attestation.errors import (
    AttestationError,
    DeltaError,
    TrustAnchorError,
    VerificationError,
)
from sealfl.attestation.repo_floor import FloorDecision
from sealfl.attestation.repo_index import (
    INDEX_TARGET,
    MAX_INDEX_BYTES,
    TUF_ROOT_FILE,
    RepoIndexError,
    check_claims,
    check_target_custom,
    choose_update,
    delta_target_path,
    parse_index,
)
from sealfl.attestation.trust import load_trust_anchors
from sealfl.common.fsutil import atomic_write, ensure_private_dir
from sealfl.enclave.device.boot import read_device_state
from sealfl.enclave.device.delta import apply_delta
from sealfl.enclave.device.policy import (
    EXIT_BOOTED,
    EXIT_KEPT_LAST_GOOD,
    BootOutcome,
    boot_or_last_good,
    check_state_apart,
)
from sealfl.enclave.device.slots import slot_path
from sealfl.enclave.device.tuf_fetch import DEFAULT_LIMITS, MirrorUnreachable, UpdateLimits, make_updater
from sealfl.enclave.device.update_trust import check_repo_floor, check_trust_files
from sealfl.enclave.device.verify import verify_dir
from sealfl.enclave.errors import UpdateError

__all__ = ["UPDATE_FILE", "TUF_DIR", "UpdateResult", "read_update_record", "update"]

log = logging.getLogger(__name__)

#: the last update check and its result, in the state directory
UPDATE_FILE = "update.json"
#: python-tuf's trusted metadata, in the state directory
TUF_DIR = "tuf"
_MAX_ROOT_BYTES = 512 << 10


@dataclass
class UpdateResult:
    """What :func:`update` did.

    Attributes:
        action: ``"installed"`` (the new release runs), ``"current"`` (nothing newer),
            ``"kept"`` (the new release was refused on the device; the last good one runs).
        name, version, root_digest: the release the repository offered.
        outcome: the :class:`~sealfl.enclave.device.policy.BootOutcome` for ``installed``
            and ``kept`` (its device is closed, except an installed one with ``keep_device``), else
            None.
        via: how the release's bytes came: ``"delta"`` (a signed delta onto the running
            release), ``"full"`` (every file), or None (nothing downloaded).
        delta_refused: why a published delta was not used (then ``via`` is ``"full"``), else None.
        floor: the repository floor decision (keep or rebase), or None.
    """

    action: str
    name: str
    version: int
    root_digest: str
    outcome: BootOutcome | None = None
    via: str | None = None
    delta_refused: str | None = None
    floor: FloorDecision | None = None

    @property
    def exit_code(self) -> int:
        """0 installed or up to date, 3 kept the last good release."""
        return EXIT_KEPT_LAST_GOOD if self.action == "kept" else EXIT_BOOTED


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _record(state_root: Path, repo_url: str, result: str, message: str, release: dict | None) -> None:
    doc = {"schema": "sealfl.device-update/v1", "repo": repo_url, "checked_at": _now(), "result": result,
           "message": message[:4000], "release": release}
    previous = read_update_record(state_root)
    if result == "installed":
        doc["installed"] = {**(release or {}), "repo": repo_url, "at": doc["checked_at"]}
    elif previous.get("installed"):
        doc["installed"] = previous["installed"]
    try:
        atomic_write(state_root / UPDATE_FILE, json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n", 0o600)
    except OSError as exc:
        log.warning("cannot record the update check in %s: %s", state_root / UPDATE_FILE, exc)


def read_update_record(state_root: str | os.PathLike) -> dict:
    """``state_dir/update.json`` as written by :func:`update` ({} when absent or unreadable:
    it is informational, never a trust input)."""
    try:
        with open(Path(state_root) / UPDATE_FILE, "rb") as fh:
            doc = json.loads(fh.read(1 << 20))
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _bootstrap(trust_dir: Path, metadata_dir: Path) -> bytes | None:
    if (metadata_dir / "root.json").is_file():
        return None
    path = Path(trust_dir) / TUF_ROOT_FILE
    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_ROOT_BYTES + 1)
    except FileNotFoundError:
        raise UpdateError(f"{path} missing: the device has no TUF trust root; provision it with the repository's "
                          "root (copy REPO/www/metadata/1.root.json there, or 'sealfl repo init --trust')",
                          stage="trust") from None
    except OSError as exc:
        raise UpdateError(f"cannot read the TUF trust root {path}: {exc}", stage="trust") from exc
    if len(data) > _MAX_ROOT_BYTES:
        raise UpdateError(f"{path}: larger than {_MAX_ROOT_BYTES} bytes, not a TUF root", stage="trust")
    return data


def _tuf_error(exc: Exception, what: str, stage: str | None = None) -> UpdateError:
    stage = stage or ("download" if isinstance(exc, tuf_exc.DownloadError) else "metadata")
    if isinstance(exc, MirrorUnreachable):
        return UpdateError(f"the repository could not be reached while {what}: {exc}; check --repo and that "
                           "'sealfl repo serve' runs there; the running release is kept", stage=stage)
    return UpdateError(f"the repository was refused while {what}: {type(exc).__name__}: {str(exc)[:600]}; the "
                       "running release is kept", stage=stage)


def _download(updater, target: str, dest: Path, limits: UpdateLimits, budget: list[int],
              check=None, read: bool = False) -> bytes | None:
    """Download ``target`` to ``dest`` through python-tuf (length and hashes checked against
    its signed metadata, within the device's caps); its bytes when ``read`` (a small document
    the caller parses), else None: a model file is never held in memory here."""
    try:
        info = updater.get_targetinfo(target)
    except (tuf_exc.RepositoryError, tuf_exc.DownloadError) as exc:
        raise _tuf_error(exc, f"looking up {target}") from exc
    if info is None:
        raise UpdateError(f"the repository's signed targets do not list {target}", stage="index")
    if check is not None:
        check(info)
    if info.length > limits.max_file_bytes or info.length > budget[0]:
        raise UpdateError(f"{target} is {info.length} bytes by its signed metadata, over the device's cap "
                          f"({min(limits.max_file_bytes, budget[0])} bytes left for this release)", stage="download")
    budget[0] -= info.length
    try:
        updater.download_target(info, str(dest))
    except (tuf_exc.RepositoryError, tuf_exc.DownloadError) as exc:
        raise _tuf_error(exc, f"downloading {target}", "download") from exc
    if not read:
        return None
    with open(dest, "rb") as fh:
        return fh.read(info.length + 1)


_NO_DELTA = "no delta"


def _try_delta(updater, trust_dir: Path, state_root: Path, running, rel, staging: Path,
               limits: UpdateLimits) -> str | None:
    """Build ``staging/release`` from a signed delta onto the running release; None when it
    worked, else why not (:data:`_NO_DELTA` when the repository has none for this base)."""
    target = delta_target_path(rel.name, rel.version, running.root_digest, DELTA_FILE)
    try:
        if updater.get_targetinfo(target) is None:
            return _NO_DELTA
    except (tuf_exc.RepositoryError, tuf_exc.DownloadError) as exc:
        return f"looking up {target}: {exc}"
    delta_dir = staging / "delta"
    try:
        (delta_dir / PATCH_DIR).mkdir(mode=0o700, parents=True)
        budget = [limits.max_release_bytes]
        data = _download(updater, target, delta_dir / DELTA_FILE, limits, budget, read=True)
        st = verify_delta_statement(data, load_trust_anchors(trust_dir).release_public_keys)
        if (st.name, st.version, st.root_digest) != (rel.name, rel.version, rel.root_digest):
            raise DeltaError(f"the delta produces {st.name} v{st.version} ({st.root_digest}), not the indexed "
                             f"{rel.name} v{rel.version} ({rel.root_digest})")
        for f in st.files:
            if f.patch is not None:
                _download(updater, delta_target_path(rel.name, rel.version, running.root_digest, f.patch),
                          delta_dir / PATCH_DIR / f.patch, limits, budget)
        release_dir = staging / "release"
        shutil.rmtree(release_dir, ignore_errors=True)  # apply_delta creates it afresh
        apply_delta(trust_dir, slot_path(state_root, running.slot), delta_dir, release_dir,
                    base_root_digest=running.root_digest, statement=st)
    except (UpdateError, AttestationError, OSError) as exc:
        log.warning("the delta to %s v%d was refused, installing the full release: %s", rel.name, rel.version, exc)
        return f"{type(exc).__name__}: {str(exc)[:600]}"
    finally:
        shutil.rmtree(delta_dir, ignore_errors=True)
    log.info("update: %s v%d built from a signed delta onto v%d", rel.name, rel.version, running.version)
    return None


def update(trust_dir: str | os.PathLike, repo_url: str, state_dir: str | os.PathLike, *,
           name: str | None = None, backend: str | None = None, limits: UpdateLimits = DEFAULT_LIMITS,
           runtime_options=None, on_refused=None, key_source=None, variant: str | None = None,
           require_llm: bool = False, keep_device: bool = False, prefer_delta: bool = True) -> UpdateResult:
    """Update the device from the repository at ``repo_url`` (module docstring).

    Args:
        trust_dir: the device's trust directory (release keys, policy, ``tuf-root.json``).
        repo_url: the repository (``sealfl repo serve``'s URL).
        state_dir: the device state directory.
        name: the release name to follow (default: the running release's name).
        backend: TEE backend as for ``device boot`` (``--tee``).
        limits: :class:`~sealfl.enclave.device.tuf_fetch.UpdateLimits`.
        runtime_options, on_refused, key_source, variant, require_llm: passed to
            :func:`~sealfl.enclave.device.policy.boot_or_last_good`.
        keep_device: leave the newly installed release running (``result.outcome.device``,
            the caller closes it; ``device serve --repo`` switches to it); otherwise, and
            always when the last good release was kept, the booted device is closed.
        prefer_delta: try a published signed delta from the running release first (step 4).

    Raises:
        UpdateError: the repository, a download, the index or the release was refused
            (``stage``); nothing on the device changed.
        BootError: from :func:`~sealfl.enclave.device.policy.boot_or_last_good`
            (:class:`~sealfl.enclave.device.policy.NothingRuns` when the release was
            refused and no last good release exists).
    """
    check_state_apart(state_dir, trust_anchors=trust_dir)
    state_root = ensure_private_dir(Path(state_dir).resolve())
    with open(state_root / ".update-lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            result = _update_locked(Path(trust_dir), repo_url, state_root, name, limits,
                                    {"backend": backend, "runtime_options": runtime_options, "on_refused": on_refused,
                                     "key_source": key_source, "variant": variant, "require_llm": require_llm},
                                    keep_device, prefer_delta)
        except UpdateError as exc:
            _record(state_root, repo_url, "refused", str(exc), None)
            raise
        except Exception as exc:
            _record(state_root, repo_url, "failed", f"{type(exc).__name__}: {exc}", None)
            raise
    release = {"name": result.name, "version": result.version, "root_digest": result.root_digest}
    if result.via:
        release["via"] = result.via
    if result.delta_refused:
        release["delta_refused"] = result.delta_refused[:1000]
    if result.floor is not None:
        release["floor"] = {"action": result.floor.action, "reason": result.floor.reason[:1000]}
    message = {"installed": "installed", "current": "up to date",
               "kept": f"refused on the device: {result.outcome.refused if result.outcome else ''}"}[result.action]
    _record(state_root, repo_url, result.action, message, release)
    return result


def _update_locked(trust_dir: Path, repo_url: str, state_root: Path, name: str | None, limits: UpdateLimits,
                   boot_options: dict, keep_device: bool, prefer_delta: bool = True) -> UpdateResult:
    check_trust_files(trust_dir, limits)
    state = read_device_state(state_root)
    running = state.last_good
    follow = name or (running.name if running is not None else None)
    if follow is None:
        raise UpdateError("the device runs no release yet: give the release name to follow (--name)", stage="index")
    metadata_dir = ensure_private_dir(state_root / TUF_DIR)
    updater = make_updater(str(metadata_dir), repo_url, bootstrap=_bootstrap(trust_dir, metadata_dir), limits=limits)
    try:
        updater.refresh()
    except (tuf_exc.RepositoryError, tuf_exc.DownloadError) as exc:
        raise _tuf_error(exc, "refreshing its metadata") from exc
    except ValueError as exc:  # a malformed bootstrap root
        raise UpdateError(f"the TUF trust root is not valid TUF metadata: {str(exc)[:300]}", stage="trust") from exc
    staging = Path(tempfile.mkdtemp(prefix=f".{state_root.name}.update-", dir=state_root.parent))
    try:
        budget = [min(MAX_INDEX_BYTES, limits.max_release_bytes)]
        index_data = _download(updater, INDEX_TARGET, staging / ".index.json", limits, budget, read=True)
        try:
            choice = choose_update(parse_index(index_data), follow, running.version if running else None,
                                   running.root_digest if running else None)
        except RepoIndexError as exc:
            raise UpdateError(str(exc), stage="index") from exc
        if choice.action == "none":
            raise UpdateError(f"the repository lists no release named {follow}", stage="index")
        rel = choice.release
        floor = check_repo_floor(state_root, metadata_dir, rel.name, rel.version, running.version if running else None,
                            limits)
        if choice.action == "current":
            log.info("%s v%d is the newest release: up to date", rel.name, rel.version)
            return UpdateResult("current", rel.name, rel.version, rel.root_digest, floor=floor)
        (staging / ".index.json").unlink()
        release_dir = staging / "release"
        try:
            release_dir.mkdir(mode=0o700)  # never through a name someone planted in the staging directory
        except FileExistsError:
            raise UpdateError(f"the staging directory {staging} was tampered with ({release_dir.name} exists); "
                              "nothing was downloaded", stage="download") from None
        via, delta_refused = "full", None
        if prefer_delta and running is not None and running.name == rel.name:
            delta_refused = _try_delta(updater, trust_dir, state_root, running, rel, staging, limits)
            if delta_refused is None:
                via = "delta"
            elif delta_refused == _NO_DELTA:
                delta_refused = None
        if via == "full":
            shutil.rmtree(release_dir, ignore_errors=True)
            release_dir.mkdir(mode=0o700)
            budget = [limits.max_release_bytes]
            for file in rel.files:
                def claim(info, file=file):
                    try:
                        check_target_custom(rel, file, info.custom)
                    except RepoIndexError as exc:
                        raise UpdateError(str(exc), stage="index") from exc
                _download(updater, rel.target(file), release_dir / file, limits, budget, claim)
        try:
            verified = verify_dir(trust_dir, release_dir)
            check_claims(rel, verified.name, verified.version, verified.root_digest)
        except TrustAnchorError as exc:
            raise UpdateError(f"cannot load trust anchors: {exc}", stage="trust") from exc
        except (VerificationError, RepoIndexError) as exc:
            raise UpdateError(f"the downloaded {rel.name} v{rel.version} was refused: {exc}", stage="release") from exc
        outcome = boot_or_last_good(trust_dir, release_dir, state_root, **boot_options)
        if outcome.kept_last_good or not keep_device:
            outcome.device.close()
        action = "kept" if outcome.kept_last_good else "installed"
        log.info("update: %s %s v%d", action, rel.name, rel.version)
        return UpdateResult(action, rel.name, rel.version, rel.root_digest, outcome, via, delta_refused, floor)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

