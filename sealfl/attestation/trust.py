"""Trust anchors a device pins at provisioning: release key(s), enclave AK, policy.

Trust directory layout (all public, never a private key)::

    release_key.pub.pem   one or more concatenated PEM public keys (ECDSA P-256); any may sign
    enclave_ak.pub.pem    PEM public attestation key (AK) of the release enclave's TEE
    policy.json           {"schema": "sealfl.trust-policy/v1",
                           "expected_pcrs": {"16": hex, ...},   # release-enclave measurement
                           "allowed_backends": ["sim", "tpm", ...],
                           "allow_insecure_sim": bool,         # sim quotes prove nothing
                           "min_version": int,
                           "release_keyids": [hex, ...],       # must match release_key.pub.pem
                           "ak_keyid": hex}                    # must match enclave_ak.pub.pem

:func:`parse_trust_anchors` is the pure core; :func:`load_trust_anchors` and
:func:`write_trust_anchors` are the I/O wrappers.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from Crypto.PublicKey import ECC

from . import keys as _keys
from .canonical import canonical_json, load_document
from .errors import KeyFormatError, TrustAnchorError
from .manifest import is_sha256_hex
from .quote import INSECURE_BACKENDS, KNOWN_BACKENDS, NUM_PCRS

__all__ = [
    "POLICY_SCHEMA",
    "RELEASE_KEY_FILE",
    "AK_FILE",
    "POLICY_FILE",
    "TrustAnchors",
    "parse_trust_anchors",
    "trust_anchor_files",
    "load_trust_anchors",
    "write_trust_anchors",
]

log = logging.getLogger(__name__)

POLICY_SCHEMA = "sealfl.trust-policy/v1"
RELEASE_KEY_FILE = "release_key.pub.pem"
AK_FILE = "enclave_ak.pub.pem"
POLICY_FILE = "policy.json"


@dataclass(frozen=True)
class TrustAnchors:
    """What a device trusts.

    Attributes:
        release_public_keys: pinned ECDSA P-256 release public keys (tuple; any one may sign).
        ak_public_key: pinned attestation-key public key of the release enclave's TEE.
        expected_pcrs: ``{pcr index: lowercase hex}`` the release attestation must show
            (the release-enclave measurement, e.g. ``{16: "ab.."}``).
        allowed_backends: TEE backends whose quotes are accepted (``frozenset`` of str).
        allow_insecure_sim: accept quotes from the INSECURE ``sim`` backend; a ``sim``
            quote is refused unless this is True *and* ``"sim"`` is in allowed_backends.
        min_version: lowest release version accepted (int >= 0).
    """

    release_public_keys: tuple[ECC.EccKey, ...]
    ak_public_key: ECC.EccKey
    expected_pcrs: Mapping[int, str]
    allowed_backends: frozenset[str] = frozenset({"tpm"})
    allow_insecure_sim: bool = False
    min_version: int = 0

    def accepted_backends(self) -> frozenset[str]:
        """Backends a quote may come from after applying ``allow_insecure_sim``."""
        if self.allow_insecure_sim:
            return frozenset(self.allowed_backends)
        return frozenset(self.allowed_backends) - INSECURE_BACKENDS


def _policy_error(msg: str) -> TrustAnchorError:
    return TrustAnchorError(f"{POLICY_FILE}: {msg}; re-export the trust anchors from the release enclave")


def parse_trust_anchors(release_key_pem: bytes, ak_pem: bytes, policy_json: bytes) -> TrustAnchors:
    """Build :class:`TrustAnchors` from the three trust files' bytes. Pure; no I/O.

    Raises:
        TrustAnchorError: a key file is unreadable, or policy.json is malformed, names
            unknown backends or invalid PCRs, or its keyids disagree with the key files.
    """
    try:
        release_keys = tuple(_keys.load_public_keys(release_key_pem))
    except KeyFormatError as exc:
        raise TrustAnchorError(f"trust anchor {RELEASE_KEY_FILE}: {exc}; re-export the trust anchors") from exc
    try:
        ak = _keys.load_public_key(ak_pem)
    except KeyFormatError as exc:
        raise TrustAnchorError(f"trust anchor {AK_FILE}: {exc}; re-export the trust anchors") from exc
    policy = load_document(policy_json, "policy", "schema", POLICY_SCHEMA, _policy_error)
    raw_pcrs = policy.get("expected_pcrs")
    if not isinstance(raw_pcrs, dict) or not raw_pcrs:
        raise _policy_error("'expected_pcrs' must be a non-empty object")
    expected: dict[int, str] = {}
    for key, value in raw_pcrs.items():
        if not (isinstance(key, str) and key.isdigit() and 0 <= int(key) < NUM_PCRS):
            raise _policy_error(f"PCR index {key!r} is not 0..{NUM_PCRS - 1}")
        if not is_sha256_hex(value):
            raise _policy_error(f"PCR {key} value is not 64 lowercase hex digits")
        expected[int(key)] = value
    backends = policy.get("allowed_backends")
    if not isinstance(backends, list) or not backends or not set(backends) <= KNOWN_BACKENDS:
        raise _policy_error(f"'allowed_backends' must be a non-empty subset of {sorted(KNOWN_BACKENDS)}")
    insecure = policy.get("allow_insecure_sim", False)
    min_version = policy.get("min_version", 0)
    if not isinstance(insecure, bool):
        raise _policy_error("'allow_insecure_sim' must be true or false")
    if not isinstance(min_version, int) or isinstance(min_version, bool) or min_version < 0:
        raise _policy_error("'min_version' must be an integer >= 0")
    if "release_keyids" in policy:
        pinned = {_keys.keyid(k) for k in release_keys}
        if set(policy["release_keyids"]) != pinned:
            raise _policy_error(f"release_keyids {policy['release_keyids']} do not match {RELEASE_KEY_FILE}")
    if "ak_keyid" in policy and policy["ak_keyid"] != _keys.keyid(ak):
        raise _policy_error(f"ak_keyid does not match {AK_FILE}")
    return TrustAnchors(
        release_public_keys=release_keys,
        ak_public_key=ak,
        expected_pcrs=expected,
        allowed_backends=frozenset(backends),
        allow_insecure_sim=insecure,
        min_version=min_version,
    )


def trust_anchor_files(
    *,
    release_public_keys: Iterable[ECC.EccKey],
    ak_public_key: ECC.EccKey,
    expected_pcrs: Mapping[int, str],
    allowed_backends: Iterable[str] = ("tpm",),
    allow_insecure_sim: bool = False,
    min_version: int = 0,
) -> dict[str, bytes]:
    """Serialise trust anchors to ``{file name: bytes}`` (pure). Output round-trips through
    :func:`parse_trust_anchors` (which is called here as a self-check).

    Raises:
        TrustAnchorError: the values do not form valid trust anchors.
    """
    release_keys = list(release_public_keys)
    if not release_keys:
        raise TrustAnchorError("at least one release public key is required")
    policy = {
        "schema": POLICY_SCHEMA,
        "expected_pcrs": {str(int(i)): str(v).lower() for i, v in sorted(expected_pcrs.items())},
        "allowed_backends": sorted(set(allowed_backends)),
        "allow_insecure_sim": bool(allow_insecure_sim),
        "min_version": min_version,
        "release_keyids": sorted(_keys.keyid(k) for k in release_keys),
        "ak_keyid": _keys.keyid(ak_public_key),
    }
    files = {
        RELEASE_KEY_FILE: b"".join(_keys.public_key_to_pem(k) for k in release_keys),
        AK_FILE: _keys.public_key_to_pem(ak_public_key),
        POLICY_FILE: canonical_json(policy) + b"\n",
    }
    parse_trust_anchors(files[RELEASE_KEY_FILE], files[AK_FILE], files[POLICY_FILE])
    return files


def load_trust_anchors(trust_dir: str | os.PathLike) -> TrustAnchors:
    """Read ``release_key.pub.pem``, ``enclave_ak.pub.pem``, ``policy.json`` from ``trust_dir``.

    Raises:
        TrustAnchorError: a file is missing/unreadable or its content is invalid.
    """
    root = Path(trust_dir)
    blobs = {}
    for name in (RELEASE_KEY_FILE, AK_FILE, POLICY_FILE):
        try:
            blobs[name] = (root / name).read_bytes()
        except OSError as exc:
            raise TrustAnchorError(
                f"cannot read trust file {root / name} ({exc.strerror or exc}); provision the device "
                "with the trust directory exported by the release enclave"
            ) from exc
    return parse_trust_anchors(blobs[RELEASE_KEY_FILE], blobs[AK_FILE], blobs[POLICY_FILE])


def write_trust_anchors(trust_dir: str | os.PathLike, files: Mapping[str, bytes], *,
                        overwrite: bool = False) -> Path:
    """Write the trust directory ``files`` (from :func:`trust_anchor_files`), mode 0644,
    each replaced atomically. Returns its path.

    Raises:
        TrustAnchorError: ``files`` are not valid trust anchors, or a trust file exists and
            ``overwrite`` is False.
        OSError: the directory cannot be created or written.
    """
    parse_trust_anchors(files[RELEASE_KEY_FILE], files[AK_FILE], files[POLICY_FILE])
    root = Path(trust_dir)
    root.mkdir(parents=True, exist_ok=True)
    if not overwrite:
        existing = [n for n in files if (root / n).exists()]
        if existing:
            raise TrustAnchorError(
                f"trust directory {root} already holds {existing}; pass overwrite=True to replace them"
            )
    for name, data in files.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=root)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, root / name)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    log.info("wrote trust anchors to %s", root)
    return root
