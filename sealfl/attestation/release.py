"""Release verification: the pure decision :func:`verify_release` and its I/O wrapper.

A device reads a release directory once (:func:`read_release_dir`) and hands the bytes to
:func:`verify_release`; the payload bytes it gets back in :class:`VerifiedRelease` are the
very objects that were hashed, so nothing is re-read between check and use.

Checks, in order (each failure raises :class:`VerificationError` naming file and check):

1. ``missing-file``  manifest.dsse.json, manifest.json, attestation.json exist.
2. ``signature``     the DSSE envelope verifies with a pinned release key (DSSE v1 PAE).
3. ``statement``     its payload is a sealfl in-toto Statement v1.
4. ``manifest``      manifest.json parses, its recomputed root digest equals its
                     ``root_digest`` and the statement subject digest; name, version,
                     metadata and file list equal the statement predicate's.
5. ``missing-file`` / ``extra-file``  every listed file is present; nothing else is.
6. ``hash``          every file's size and SHA-256 match the manifest.
7. ``attestation``   attestation.json holds a quote signed by the pinned AK, whose nonce is
                     the root digest, whose PCRs equal the pinned measurement, from an
                     allowed backend.
8. ``version`` / ``rollback``  version >= policy min_version, and >= ``last_version``.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .bundle import ATTESTATION_FILE, ENVELOPE_FILE, MANIFEST_FILE, METADATA_FILES, parse_attestation
from .canonical import JSONFormatError, loads_strict
from .dsse import verify_envelope
from .errors import (
    ManifestError,
    PolicyError,
    QuoteError,
    SignatureError,
    StatementError,
    VerificationError,
)
from .manifest import parse_manifest
from .quote import verify_quote
from .statement import PAYLOAD_TYPE, parse_statement
from .trust import TrustAnchors, load_trust_anchors, parse_trust_anchors, write_trust_anchors

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "TrustAnchors",
    "load_trust_anchors",
    "parse_trust_anchors",
    "write_trust_anchors",
    "VerifiedRelease",
    "verify_release",
    "read_release_dir",
]

log = logging.getLogger(__name__)

#: Default per-file size cap for :func:`read_release_dir` (2 GiB).
DEFAULT_MAX_FILE_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class VerifiedRelease:
    """A release that passed every check of :func:`verify_release`.

    Attributes:
        name: release name.
        version: release version (int).
        root_digest: manifest root digest, lowercase hex.
        payload: ``{file name: bytes}`` of the payload files -- the same ``bytes`` objects
            that were hashed; hand exactly these to the runtime.
        manifest: the parsed manifest dict.
        metadata: the manifest's (signed) metadata dict.
        backend: TEE backend of the release attestation (``"sim"`` is insecure).
    """

    name: str
    version: int
    root_digest: str
    payload: dict[str, bytes] = field(repr=False)
    manifest: dict = field(repr=False)
    metadata: dict = field(repr=False)
    backend: str = "sim"


def verify_release(
    files: Mapping[str, bytes], trust: TrustAnchors, *, last_version: int | None = None,
    last_root_digest: str | None = None,
) -> VerifiedRelease:
    """Verify every file of a release directory against pinned trust anchors. Pure; no I/O.

    Args:
        files: ``{file name: content}`` of *every* file of the release dir, read once; the
            values must be immutable ``bytes``.
        trust: pinned keys and policy (see :class:`TrustAnchors`).
        last_version: version of the last release this device ran, or None (no rollback
            check beyond ``trust.min_version``).
        last_root_digest: root digest of that release; with it, the same version is
            accepted only for the same root digest (a re-boot), never for other content.

    Returns:
        a :class:`VerifiedRelease`.

    Raises:
        VerificationError: the first failed check, with ``.file`` and ``.check`` set
            (checks listed in the module docstring).
    """
    for name, data in files.items():
        if not isinstance(data, bytes):
            raise VerificationError(name, "read", f"content must be immutable bytes, got {type(data).__name__}")
    for meta in (ENVELOPE_FILE, MANIFEST_FILE, ATTESTATION_FILE):
        if meta not in files:
            raise VerificationError(meta, "missing-file", "release metadata file is missing")

    # 2. DSSE signature with a pinned release key
    try:
        envelope = loads_strict(files[ENVELOPE_FILE])
        payload = verify_envelope(envelope, trust.release_public_keys, expected_payload_type=PAYLOAD_TYPE)
    except (JSONFormatError, SignatureError) as exc:
        raise VerificationError(ENVELOPE_FILE, "signature", str(exc)) from exc
    # 3. in-toto statement
    try:
        statement = parse_statement(payload)
    except StatementError as exc:
        raise VerificationError(ENVELOPE_FILE, "statement", str(exc)) from exc
    # 4. manifest consistent with the signed statement
    try:
        manifest = parse_manifest(files[MANIFEST_FILE])
    except ManifestError as exc:
        raise VerificationError(MANIFEST_FILE, "manifest", str(exc)) from exc
    if not hmac.compare_digest(manifest["root_digest"], statement.root_digest):
        raise VerificationError(
            MANIFEST_FILE, "manifest",
            f"root digest {manifest['root_digest']} differs from the signed one {statement.root_digest}",
        )
    for key, signed in (("name", statement.name), ("version", statement.version),
                        ("metadata", statement.metadata), ("files", statement.files)):
        if manifest[key] != signed:
            raise VerificationError(MANIFEST_FILE, "manifest", f"{key!r} differs from the signed statement")
    entries = manifest["files"]
    listed = [e["path"] for e in entries]
    for path in listed:
        if path in METADATA_FILES:
            raise VerificationError(MANIFEST_FILE, "manifest", f"lists metadata file {path!r} as payload")

    # 5. exactly the listed files
    for path in listed:
        if path not in files:
            raise VerificationError(path, "missing-file", "listed in the signed manifest but absent")
    extras = sorted(set(files) - set(listed) - set(METADATA_FILES))
    if extras:
        raise VerificationError(extras[0], "extra-file", f"not listed in the signed manifest (all extras: {extras})")
    # 6. sizes and hashes
    for entry in entries:
        data = files[entry["path"]]
        if len(data) != entry["size"]:
            raise VerificationError(entry["path"], "hash", f"size {len(data)} bytes != signed size {entry['size']}")
        digest = hashlib.sha256(data).hexdigest()
        if not hmac.compare_digest(digest, entry["sha256"]):
            raise VerificationError(entry["path"], "hash", f"sha256 {digest} != signed {entry['sha256']}")

    # 7. release attestation
    try:
        quote = parse_attestation(files[ATTESTATION_FILE])
        verify_quote(
            quote,
            trust.ak_public_key,
            bytes.fromhex(statement.root_digest),
            trust.expected_pcrs,
            allowed_backends=trust.accepted_backends(),
        )
    except (QuoteError, PolicyError) as exc:
        raise VerificationError(ATTESTATION_FILE, "attestation", str(exc)) from exc

    # 8. versions
    version = statement.version
    if version < trust.min_version:
        raise VerificationError(
            MANIFEST_FILE, "version", f"version {version} < pinned minimum version {trust.min_version}"
        )
    if last_version is not None and version < last_version:
        raise VerificationError(
            MANIFEST_FILE, "rollback", f"version {version} < last version run on this device ({last_version})"
        )
    if (last_version is not None and version == last_version and last_root_digest is not None
            and not hmac.compare_digest(statement.root_digest, last_root_digest)):
        raise VerificationError(
            MANIFEST_FILE, "rollback",
            f"version {version} already ran on this device with root digest {last_root_digest[:16]}…; "
            "a different release must carry a higher version")

    log.info("verified release %s v%d root %s (backend %s)", statement.name, version,
             statement.root_digest, quote["backend"])
    return VerifiedRelease(
        name=statement.name,
        version=version,
        root_digest=statement.root_digest,
        payload={path: files[path] for path in listed},
        manifest=manifest,
        metadata=manifest["metadata"],
        backend=quote["backend"],
    )


def read_release_dir(
    path: str | os.PathLike, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, max_files: int = 4096
) -> dict[str, bytes]:
    """Read every regular file of a flat release directory exactly once.

    Each entry is opened relative to a directory fd with ``O_NOFOLLOW | O_NONBLOCK`` and
    checked with ``fstat`` on the open fd (no check-then-open race).

    Args:
        path: the release directory (may itself be a symlink, e.g. an A/B "current" link).
        max_file_bytes: per-file cap in bytes (default 2 GiB).
        max_files: cap on the number of directory entries.

    Returns:
        ``{file name: bytes}``.

    Raises:
        VerificationError: ``read`` (directory missing/unreadable, too many entries, a file
            changing size while read),
            ``file-type`` (symlink, subdirectory or special file), ``size`` (file over cap).
    """
    root = str(path)
    try:
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise VerificationError(root, "read", f"cannot open release directory: {exc.strerror or exc}") from exc
    out: dict[str, bytes] = {}
    try:
        with os.scandir(dfd) as it:
            names = sorted(entry.name for entry in it)
        if len(names) > max_files:
            raise VerificationError(root, "read", f"{len(names)} entries exceed the cap of {max_files}")
        for name in names:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise VerificationError(name, "file-type", "is a symbolic link") from exc
                raise VerificationError(name, "read", f"cannot open: {exc.strerror or exc}") from exc
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    raise VerificationError(name, "file-type", "is a directory")
                if not stat.S_ISREG(st.st_mode):
                    raise VerificationError(name, "file-type", "is not a regular file")
                if st.st_size > max_file_bytes:
                    raise VerificationError(name, "size", f"{st.st_size} bytes > cap {max_file_bytes}")
            except BaseException:
                os.close(fd)
                raise
            with os.fdopen(fd, "rb", buffering=0) as fh:
                data = fh.read(st.st_size + 1)
                while len(data) < st.st_size:  # short reads are legal; loop to the stat size
                    more = fh.read(st.st_size + 1 - len(data))
                    if not more:
                        break
                    data += more
                if len(data) != st.st_size:
                    raise VerificationError(name, "read", "file changed size while being read; retry")
            out[name] = data
    finally:
        os.close(dfd)
    log.debug("read %d files from release dir %s", len(out), Path(root))
    return out
