"""Plain-function backend of ``sealfl verify`` (the typer command lives in sealfl.platform)."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection

from sealfl.attestation.config import DEFAULT_CONFIG, VerifyConfig
from sealfl.attestation.reader import load_release
from sealfl.attestation.trust import load_trust_anchors
from sealfl.attestation.verify import SignedRelease, VerifiedRelease

__all__ = ["verify_dir"]


def verify_dir(trust_dir: str | os.PathLike, release_dir: str | os.PathLike, *,
               config: VerifyConfig = DEFAULT_CONFIG,
               keep: Callable[[SignedRelease], Collection[str] | None] | None = None) -> VerifiedRelease:
    """Verify ``release_dir`` against the trust anchors in ``trust_dir``, reading only what the
    release signed (see :func:`sealfl.attestation.reader.load_release`).

    Exit-code convention for the CLI: return -> exit 0; an exception -> exit 1 with
    ``str(exc)`` as the message (a :class:`VerificationError` names the failing file and check).

    Args:
        trust_dir: directory with ``release_key.pub.pem``, ``enclave_ak.pub.pem``, ``policy.json``.
        release_dir: the release directory.
        config: read caps.
        keep: which payload files to keep (the others are verified as they stream past;
            :func:`~sealfl.attestation.reader.load_release`); default all.

    Raises:
        TrustAnchorError: the trust directory is missing or invalid.
        VerificationError: the release failed a check (``.file``, ``.check``).
    """
    return load_release(release_dir, load_trust_anchors(trust_dir), config=config, keep=keep)
