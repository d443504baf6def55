"""The device applies a signed delta (:mod:`sealfl.attestation.delta`) onto the release it
runs, and hands back a release directory that the device's full verifier accepted.

Order (each step refuses with :class:`~sealfl.attestation.errors.DeltaError`; nothing is
written outside ``out_dir``, which the caller discards on a refusal):

1. ``delta.dsse.json`` is verified against the trust directory's pinned release keys;
2. the base must be exactly the device's running release: its name, version and root
   digest equal the statement's ``base`` (the caller passes the last good release's
   root digest), and the base directory verifies in full (:func:`~.verify.verify_dir`);
3. each patch is read with a cap of its signed ``patch_length`` and must hash to its
   signed ``patch_sha256``; its header must declare exactly the signed output length and
   the base file's length (:func:`~sealfl.attestation.delta.check_patch_header`), so the
   patch library never allocates more than the signed size; the output must then have the
   signed length and SHA-256. Memory is bounded by base file + patch + signed output, time
   by the patch library's linear apply over those sizes;
4. the assembled directory is verified in full by :func:`~.verify.verify_dir` and must be
   the release the statement promises (name, version, root digest).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from sealfl.attestation.delta import DELTA_FILE, MAX_STATEMENT_BYTES, PATCH_DIR, DeltaStatement, check_patch_header
from sealfl.attestation.delta import verify_delta_statement as _verify_statement
from sealfl.attestation.errors import DeltaError, TrustAnchorError, VerificationError
from sealfl.attestation.trust import load_trust_anchors
from sealfl.common.fsutil import read_capped
from sealfl.enclave.device.verify import verify_dir

__all__ = ["read_delta_statement", "delta_files", "apply_delta"]

log = logging.getLogger(__name__)


def _read_capped(path: Path, cap: int, what: str) -> bytes:
    try:
        data = read_capped(path, cap)
    except OSError as exc:
        raise DeltaError(f"cannot read {what} {path}: {exc}") from exc
    if len(data) > cap:
        raise DeltaError(f"{what} {path} is longer than its signed {cap} bytes")
    return data


def read_delta_statement(trust_dir: str | os.PathLike, delta_dir: str | os.PathLike) -> DeltaStatement:
    """Verify ``delta_dir/delta.dsse.json`` against ``trust_dir``'s release keys.

    Raises:
        DeltaError: unreadable, unsigned, wrongly signed or malformed.
        TrustAnchorError: the trust directory is invalid.
    """
    data = _read_capped(Path(delta_dir) / DELTA_FILE, MAX_STATEMENT_BYTES, "the delta statement")
    return _verify_statement(data, load_trust_anchors(trust_dir).release_public_keys)


def delta_files(delta_dir: str | os.PathLike, statement: DeltaStatement) -> dict[str, bytes]:
    """``{"delta.dsse.json": bytes, "<patch>": bytes}`` of a delta directory, each patch
    capped at its signed length (what ``sealfl repo publish --delta`` publishes).

    Raises:
        DeltaError: a file is missing or longer than signed.
    """
    root = Path(delta_dir)
    out = {DELTA_FILE: _read_capped(root / DELTA_FILE, MAX_STATEMENT_BYTES, "the delta statement")}
    for f in statement.files:
        if f.patch is not None:
            out[f.patch] = _read_capped(root / PATCH_DIR / f.patch, f.patch_length, "patch")
    return out


def apply_delta(trust_dir: str | os.PathLike, base_dir: str | os.PathLike, delta_dir: str | os.PathLike,
                out_dir: str | os.PathLike, *, base_root_digest: str, statement: DeltaStatement | None = None):
    """Build the release a delta promises into ``out_dir`` (new, private) from ``base_dir``.

    Args:
        trust_dir: the device's trust directory.
        base_dir: the device's running (last good) release.
        delta_dir: ``delta.dsse.json`` and ``patches/``.
        out_dir: where the result is written (must not exist).
        base_root_digest: the root digest of the release the device runs (its state).
        statement: an already verified statement (else read from ``delta_dir``).

    Returns:
        The :class:`~sealfl.attestation.verify.VerifiedRelease` of ``out_dir``.

    Raises:
        DeltaError: any check of the module docstring fails (the message says which).
        TrustAnchorError: the trust directory is invalid.
    """
    st = statement or read_delta_statement(trust_dir, delta_dir)
    if st.base_root_digest != base_root_digest:
        raise DeltaError(f"the delta is for base {st.name} v{st.base_version} (root digest {st.base_root_digest}), "
                         f"but the device runs root digest {base_root_digest}: a delta onto the wrong base is refused "
                         "(install the full release)")
    try:
        base = verify_dir(trust_dir, base_dir)
    except VerificationError as exc:
        raise DeltaError(f"the base release {base_dir} does not verify: {exc}") from exc
    if (base.name, base.version, base.root_digest) != (st.name, st.base_version, st.base_root_digest):
        raise DeltaError(f"the base release is {base.name} v{base.version} ({base.root_digest}), the delta's base is "
                         f"{st.name} v{st.base_version} ({st.base_root_digest})")
    import hdiffpatch  # a 38 MB extension: loaded only when a delta is applied

    out = Path(out_dir)
    out.mkdir(mode=0o700)
    base_files, patch_dir = base.files(), Path(delta_dir) / PATCH_DIR
    for f in st.files:
        if f.source is not None:
            if f.source not in base_files:
                raise DeltaError(f"the base release has no file {f.source} to patch into {f.name}")
            old = base_files[f.source]  # the verified bytes, not a second read of the directory
        else:
            old = b""
        if f.patch is None:
            data = old
        else:
            patch = _read_capped(patch_dir / f.patch, f.patch_length, "patch")
            if hashlib.sha256(patch).hexdigest() != f.patch_sha256:
                raise DeltaError(f"patch {f.patch}: its SHA-256 is not the signed one (a tampered patch)")
            try:
                check_patch_header(patch, new_length=f.length, old_length=len(old))
            except DeltaError as exc:
                raise DeltaError(f"patch {f.patch}: {exc}") from exc
            try:
                data = hdiffpatch.apply(old, patch)
            except (hdiffpatch.HDiffPatchError, MemoryError, ValueError) as exc:
                raise DeltaError(f"patch {f.patch} does not apply onto {f.source}: {exc}") from exc
        if len(data) != f.length or hashlib.sha256(data).hexdigest() != f.sha256:
            raise DeltaError(f"{f.name}: the patched file is not the signed result ({len(data)} bytes, SHA-256 "
                             f"{hashlib.sha256(data).hexdigest()[:16]}…)")
        fd = os.open(out / f.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    try:
        result = verify_dir(trust_dir, out)
    except TrustAnchorError:
        raise
    except VerificationError as exc:
        raise DeltaError(f"the release built from the delta does not verify: {exc}") from exc
    if (result.name, result.version, result.root_digest) != (st.name, st.version, st.root_digest):
        raise DeltaError(f"the release built from the delta is {result.name} v{result.version} ({result.root_digest}), "
                         f"not the signed result {st.name} v{st.version} ({st.root_digest})")
    log.info("delta applied: %s v%d -> v%d", st.name, st.base_version, st.version)
    return result
