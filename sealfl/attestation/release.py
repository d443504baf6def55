"""Release verification: the public entry points in one place.

* :func:`load_release` (I/O, :mod:`.reader`): read a release directory bounded by what was
  signed and verify it -- what ``sealfl verify`` and ``device boot`` use.
* :func:`verify_release` (pure, :mod:`.verify`): verify a ``{name: bytes}`` map of a whole
  release directory; :func:`verify_metadata` / :func:`verify_payload` are its two steps.
* :class:`VerifyConfig`: the size caps; :class:`DeviceState`: the device's rollback floor.
* :func:`load_trust_anchors` & co. (:mod:`.trust`): the pinned keys and policy.

The order of checks and what each refuses is in :mod:`sealfl.attestation.verify`.
"""

from __future__ import annotations

from sealfl.attestation.config import DEFAULT_CONFIG, DEFAULT_MAX_FILE_BYTES, VerifyConfig
from sealfl.attestation.device_state import DeviceState, LastGood
from sealfl.attestation.reader import load_release, read_release_dir
from sealfl.attestation.trust import TrustAnchors, load_trust_anchors, parse_trust_anchors, write_trust_anchors
from sealfl.attestation.verify import (
    FileEntry,
    SignedRelease,
    VerifiedRelease,
    verify_metadata,
    verify_payload,
    verify_release,
)

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_MAX_FILE_BYTES",
    "VerifyConfig",
    "DeviceState",
    "LastGood",
    "TrustAnchors",
    "load_trust_anchors",
    "parse_trust_anchors",
    "write_trust_anchors",
    "FileEntry",
    "SignedRelease",
    "VerifiedRelease",
    "verify_metadata",
    "verify_payload",
    "verify_release",
    "load_release",
    "read_release_dir",
]
