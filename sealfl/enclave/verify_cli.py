"""Plain-function backend of ``sealfl verify`` (the typer command lives in sealfl.platform)."""

from __future__ import annotations

import os

from sealfl.attestation.release import (
    DEFAULT_MAX_FILE_BYTES,
    VerifiedRelease,
    load_trust_anchors,
    read_release_dir,
    verify_release,
)

__all__ = ["verify_dir", "describe"]


def verify_dir(trust_dir: str | os.PathLike, release_dir: str | os.PathLike, *,
               last_version: int | None = None,
               max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> VerifiedRelease:
    """Verify ``release_dir`` against the trust anchors in ``trust_dir``.

    Exit-code convention for the CLI: return -> exit 0; an exception -> non-zero with
    ``str(exc)`` as the message (a :class:`VerificationError` names the failing file and check).

    Args:
        trust_dir: directory with ``release_key.pub.pem``, ``enclave_ak.pub.pem``, ``policy.json``.
        release_dir: the release directory.
        last_version: optional last version run (rollback check).
        max_file_bytes: per-file read cap in bytes.

    Raises:
        TrustAnchorError: the trust directory is missing or invalid.
        VerificationError: the release failed a check (``.file``, ``.check``).
    """
    trust = load_trust_anchors(trust_dir)
    files = read_release_dir(release_dir, max_file_bytes=max_file_bytes)
    return verify_release(files, trust, last_version=last_version)


def describe(release: VerifiedRelease) -> str:
    """One-line human summary of a verified release (for the CLI's success message)."""
    insecure = " (INSECURE sim attestation)" if release.backend == "sim" else ""
    return (f"OK {release.name} v{release.version} root {release.root_digest} "
            f"files {sorted(release.payload)} attested by {release.backend}{insecure}")
