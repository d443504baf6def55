"""``sealfl release delta OLD NEW -o DIR``: binary patches from one release to the next,
signed by the release enclave (format: :mod:`sealfl.attestation.delta`).

Both releases are verified against the consortium's trust directory first; each file of
NEW identical to OLD's file of the same name is listed as unchanged, every other one gets
an HDiffPatch patch (zstd-compressed) from OLD's file of that name, or from empty when OLD
has none or when that is smaller (small signed documents change throughout). Files of OLD that NEW lacks are simply not in the result.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import hdiffpatch

from sealfl.attestation.delta import ALGORITHM, DELTA_FILE, PATCH_DIR
from sealfl.common.errors import SealflError
from sealfl.common.fsutil import atomic_write

__all__ = ["DeltaBuildError", "DeltaSummary", "make_delta", "delta_for_consortium"]


class DeltaBuildError(SealflError):
    """A delta cannot be made (a release does not verify, other release names, an output
    directory that is not empty)."""


@dataclass(frozen=True)
class DeltaSummary:
    """What :func:`make_delta` wrote: ``patch_bytes`` (all patches plus the statement),
    ``full_bytes`` (NEW's files together), the base and result versions and root digests."""

    dir: Path
    name: str
    base_version: int
    version: int
    base_root_digest: str
    root_digest: str
    patch_bytes: int
    full_bytes: int
    patched: tuple[str, ...]


def make_delta(enclave, trust_dir: str | os.PathLike, old_dir: str | os.PathLike, new_dir: str | os.PathLike,
               out_dir: str | os.PathLike) -> DeltaSummary:
    """Write the signed delta from release ``old_dir`` to ``new_dir`` into ``out_dir``.

    Args:
        enclave: the opened :class:`~sealfl.enclave.release.enclave.ReleaseEnclave` (signs).
        trust_dir: the trust directory both releases must verify against.

    Raises:
        DeltaBuildError: a release does not verify, the names differ, NEW is not newer,
            ``out_dir`` is not empty.
    """
    from sealfl.attestation.errors import AttestationError
    from sealfl.enclave.device.verify import verify_dir

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DeltaBuildError(f"{out} exists and is not an empty directory; choose a new output directory")
    try:
        old, new = verify_dir(trust_dir, old_dir), verify_dir(trust_dir, new_dir)
    except AttestationError as exc:
        raise DeltaBuildError(f"a release of the delta does not verify: {exc}") from exc
    if old.name != new.name or new.version <= old.version:
        raise DeltaBuildError(f"a delta goes from an older to a newer release of one model; got {old.name} "
                              f"v{old.version} -> {new.name} v{new.version}")
    old_files, new_files = old.files(), new.files()
    patches, entries = {}, []
    for name, data in new_files.items():
        entry = {"name": name, "length": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if old_files.get(name) == data:
            entries.append({**entry, "from": name, "patch": None, "patch_length": 0, "patch_sha256": None})
            continue
        source = name if name in old_files else None
        patch = hdiffpatch.diff(old_files.get(name, b""), data, hdiffpatch.COMPRESSION_ZSTD)
        if source is not None:  # a small file that changed throughout (a signature): compressed whole instead
            whole = hdiffpatch.diff(b"", data, hdiffpatch.COMPRESSION_ZSTD)
            if len(whole) < len(patch):
                source, patch = None, whole
        patches[f"{name}.hdiff"] = patch
        entries.append({**entry, "from": source, "patch": f"{name}.hdiff",
                        "patch_length": len(patch), "patch_sha256": hashlib.sha256(patch).hexdigest()})
    predicate = {"algorithm": ALGORITHM,
                 "base": {"name": old.name, "version": old.version, "root_digest": old.root_digest},
                 "result": {"name": new.name, "version": new.version, "root_digest": new.root_digest},
                 "files": entries}
    statement = enclave.sign_delta(predicate)
    (out / PATCH_DIR).mkdir(parents=True, exist_ok=True)
    for name, patch in patches.items():
        atomic_write(out / PATCH_DIR / name, patch, 0o644)
    atomic_write(out / DELTA_FILE, statement, 0o644)
    return DeltaSummary(out, new.name, old.version, new.version, old.root_digest, new.root_digest,
                        sum(map(len, patches.values())) + len(statement), sum(map(len, new_files.values())),
                        tuple(e["name"] for e in entries if e["patch"]))


def delta_for_consortium(consortium_dir: str | os.PathLike, old_dir: str | os.PathLike, new_dir: str | os.PathLike,
                         out_dir: str | os.PathLike) -> DeltaSummary:
    """:func:`make_delta` with the consortium's release enclave (signs) and trust directory."""
    from sealfl.enclave.release.enclave import ReleaseEnclave
    from sealfl.platform.consortium import Consortium
    from sealfl.platform.release import enclave_dir, trust_dir

    cons = Consortium.load(consortium_dir)
    return make_delta(ReleaseEnclave.open(enclave_dir(cons)), trust_dir(cons), old_dir, new_dir, out_dir)
