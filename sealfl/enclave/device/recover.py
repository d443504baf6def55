"""Which release is the device's last good one: ``state.json``, checked against the TEE floor,
else the slot the floor names.

The rollback floor lives in the TEE (:mod:`sealfl.attestation.tee_floor`: version and the
signed statement's digest of the newest release the device accepted); ``state.json`` only
says where that release is kept. When ``state.json`` is gone, or an older copy was restored,
the floor rightly refuses what the file names -- but the newest release's slot is normally
still on disk (slots are removed only after a newer one is recorded,
:mod:`sealfl.enclave.device.slots`). :func:`last_good_source` then looks for it:

1. ``state.json``'s last good release, if the floor allows it (no floor yet; a higher
   version than the floor; or the floor's very release, same statement digest);
2. else every slot under ``slots/`` (names sorted, hidden temporaries skipped) is verified
   from scratch (:func:`~sealfl.attestation.reader.load_release`: signature, attestation,
   manifest, every hash) and the one whose signed version and statement digest are the
   floor's is taken; the caller then rewrites ``state.json`` from it once it runs.

Identity is what was signed (the statement digest), never a directory name or an
envelope's bytes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from sealfl.attestation.config import VerifyConfig
from sealfl.attestation.device_state import SLOTS_DIR, STATE_FILE, DeviceState, LastGood
from sealfl.attestation.errors import AttestationError
from sealfl.attestation.reader import load_release
from sealfl.attestation.tee_floor import FloorRecord
from sealfl.attestation.trust import TrustAnchors
from sealfl.attestation.verify import VerifiedRelease
from sealfl.enclave.device import slots as _slots
from sealfl.enclave.errors import BootError

__all__ = ["Source", "floor_allows", "last_good_source"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """Where the last good release is.

    Attributes:
        path: its slot directory.
        expect: what ``state.json`` says it is (the release must be this one), or None.
        recovered: the slot name (``"slots/<name>"``) when it was found from the floor and
            ``state.json`` must be rewritten from it; else None.
        release: the release, already verified, when it was found by scanning; else None.
    """

    path: Path
    expect: LastGood | None
    recovered: str | None = None
    release: VerifiedRelease | None = None


def floor_allows(floor: FloorRecord, last: LastGood) -> bool:
    """True when the TEE floor lets ``last`` boot: no floor, a version above it, or the floor's
    own release (same statement digest; a v1 state without one is not). Pure."""
    if floor.version is None or last.version > floor.version:
        return True
    return last.version == floor.version and last.statement_digest == floor.statement_digest


def last_good_source(state_root: Path, state: DeviceState, floor: FloorRecord, trust: TrustAnchors,
                     config: VerifyConfig) -> Source:
    """The last good release to boot (module docstring).

    Raises:
        BootError: (reason ``"state"``) there is none: nothing recorded and no floor, or no
            slot holds the floor's release (the message says what was looked for).
    """
    last = state.last_good
    if last is not None and floor_allows(floor, last):
        return Source(_slots.slot_path(state_root, last.slot), last)
    if floor.version is None:
        raise BootError(f"no last good release recorded in {state_root / STATE_FILE}; boot a release first",
                        reason="state")
    why = (f"{STATE_FILE} is missing" if last is None else
           f"{STATE_FILE} names v{last.version}, below the TEE floor v{floor.version}")
    slots = state_root / SLOTS_DIR
    try:
        names = sorted(e.name for e in os.scandir(slots) if e.is_dir(follow_symlinks=False)
                       and not e.name.startswith("."))
    except FileNotFoundError:
        names = []
    except OSError as exc:
        raise BootError(f"{why} and {slots} cannot be listed: {exc}", reason="state") from exc
    for name in names:
        try:
            release = load_release(slots / name, trust, state=DeviceState(), config=config)
        except (AttestationError, OSError) as exc:
            log.info("slot %s is not the floor's release: %s", name, exc)
            continue
        if release.version == floor.version and release.statement_digest == floor.statement_digest:
            log.warning("%s: recovered the last good release %s v%d from %s/%s (the TEE floor's release)", why,
                        release.name, release.version, SLOTS_DIR, name)
            return Source(slots / name, None, f"{SLOTS_DIR}/{name}", release)
    raise BootError(f"{why}, and no slot in {slots} holds the release at the TEE floor (v{floor.version}, statement "
                    f"{str(floor.statement_digest)[:16]}…): nothing the floor allows is on this device; boot a release "
                    f"of version {floor.version} or higher", reason="state")
