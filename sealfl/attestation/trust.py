"""Trust anchors a device pins at provisioning: release key(s), enclave AK, policy.

Trust directory layout (all public, never a private key)::

    release_key.pub.pem   one or more concatenated PEM public keys (ECDSA P-256); any may sign
    release-signing.pub   the (first) release public key alone, for ``model_signing verify key
                          --public_key`` (optional when reading; must be one of the keys above)
    enclave_ak.pub.pem    PEM public attestation key (AK) of the release enclave's TEE
    policy.json           {"schema": "sealfl.trust-policy/v1",
                           "expected_pcrs": {"16": hex, ...},   # release-enclave measurement
                           "allowed_backends": ["sim", "tpm", ...],
                           "allow_insecure_sim": bool,         # optional (false); sim quotes prove nothing
                           "min_version": int,                 # optional (0); 0..2**31-1
                           "max_version_step": int,            # optional (1000); 1..2**31-1
                           "release_keyids": [hex, ...],       # optional; must match release_key.pub.pem
                           "ak_keyid": hex}                    # optional; must match enclave_ak.pub.pem

Every field is type-checked (a wrong type names ``policy.json`` and the field). Unknown
fields are refused rather than ignored: a policy field can only ever restrict what a device
accepts, so a reader that silently skipped one written by a newer tool would accept more
than its owner meant.

``max_version_step`` bounds how far a release's version may jump above the last version the
device ran: a validly signed release numbered 2**31-1 would otherwise become the device's
rollback floor for good and lock out every later release.

:func:`parse_trust_anchors` is the pure core; :func:`load_trust_anchors` and
:func:`write_trust_anchors` are the I/O wrappers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from Crypto.PublicKey import ECC

from sealfl.attestation import keys as _keys
from sealfl.attestation.canonical import canonical_json, load_document
from sealfl.attestation.errors import KeyFormatError, TrustAnchorError
from sealfl.attestation.quote import INSECURE_BACKENDS, KNOWN_BACKENDS, parse_pcr_map
from sealfl.common.fields import MAX_VERSION, Fields
from sealfl.common.fsutil import atomic_write

__all__ = [
    "POLICY_SCHEMA",
    "DEFAULT_MAX_VERSION_STEP",
    "RELEASE_KEY_FILE",
    "MODEL_SIGNING_KEY_FILE",
    "AK_FILE",
    "POLICY_FILE",
    "TrustAnchors",
    "parse_trust_anchors",
    "trust_anchor_files",
    "load_trust_anchors",
    "write_trust_anchors",
    "check_model_signing_key",
]

log = logging.getLogger(__name__)

POLICY_SCHEMA = "sealfl.trust-policy/v1"
RELEASE_KEY_FILE = "release_key.pub.pem"
#: the release key for OpenSSF model-signing tools (one PEM key)
MODEL_SIGNING_KEY_FILE = "release-signing.pub"
AK_FILE = "enclave_ak.pub.pem"
POLICY_FILE = "policy.json"
#: Default of policy.json's ``max_version_step``: a release may be at most this many
#: versions above the last one the device ran.
DEFAULT_MAX_VERSION_STEP = 1000
_POLICY_FIELDS = ("schema", "expected_pcrs", "allowed_backends", "allow_insecure_sim", "min_version",
                  "max_version_step", "release_keyids", "ak_keyid")


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
        min_version: lowest release version accepted (int in ``0..2**31-1``).
        max_version_step: largest jump of a release's version above the last version the
            device ran (int in ``1..2**31-1``).
    """

    release_public_keys: tuple[ECC.EccKey, ...]
    ak_public_key: ECC.EccKey
    expected_pcrs: Mapping[int, str]
    allowed_backends: frozenset[str] = frozenset({"tpm"})
    allow_insecure_sim: bool = False
    min_version: int = 0
    max_version_step: int = DEFAULT_MAX_VERSION_STEP

    def accepted_backends(self) -> frozenset[str]:
        """Backends a quote may come from after applying ``allow_insecure_sim``."""
        if self.allow_insecure_sim:
            return frozenset(self.allowed_backends)
        return frozenset(self.allowed_backends) - INSECURE_BACKENDS


def _policy_error(msg: str) -> TrustAnchorError:
    return TrustAnchorError(f"{msg}; re-export the trust anchors from the release enclave")


def parse_trust_anchors(release_key_pem: bytes, ak_pem: bytes, policy_json: bytes) -> TrustAnchors:
    """Build :class:`TrustAnchors` from the three trust files' bytes. Pure; no I/O.

    Raises:
        TrustAnchorError: a key file is unreadable, or policy.json is malformed (a field
            missing, unknown or of the wrong type or range -- the message names it), names
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
    policy = load_document(policy_json, POLICY_FILE, "schema", POLICY_SCHEMA, _policy_error)
    fields = Fields(POLICY_FILE, _policy_error)
    fields.only(policy, _POLICY_FIELDS)
    expected = parse_pcr_map(fields.get(policy, "expected_pcrs", "object"), fields, "expected_pcrs")
    backends = fields.get(policy, "allowed_backends", "array", nonempty=True, max_len=len(KNOWN_BACKENDS) * 4)
    for i, backend in enumerate(backends):
        fields.choice(backend, fields.join("allowed_backends", i), choices=KNOWN_BACKENDS)
    insecure = fields.get(policy, "allow_insecure_sim", "boolean", default=False)
    min_version = fields.get(policy, "min_version", "integer", default=0, lo=0, hi=MAX_VERSION)
    step = fields.get(policy, "max_version_step", "integer", default=DEFAULT_MAX_VERSION_STEP, lo=1, hi=MAX_VERSION)
    if "release_keyids" in policy:
        listed = fields.get(policy, "release_keyids", "array", nonempty=True, max_len=64)
        for i, kid in enumerate(listed):
            fields.hex64(kid, fields.join("release_keyids", i))
        pinned = {_keys.keyid(k) for k in release_keys}
        if set(listed) != pinned:
            raise fields.fail("release_keyids", f"{sorted(listed)} do not match the keys in {RELEASE_KEY_FILE}")
    if "ak_keyid" in policy and fields.get(policy, "ak_keyid", "hex64") != _keys.keyid(ak):
        raise fields.fail("ak_keyid", f"does not match {AK_FILE}")
    return TrustAnchors(
        release_public_keys=release_keys,
        ak_public_key=ak,
        expected_pcrs=expected,
        allowed_backends=frozenset(backends),
        allow_insecure_sim=insecure,
        min_version=min_version,
        max_version_step=step,
    )


def trust_anchor_files(
    *,
    release_public_keys: Iterable[ECC.EccKey],
    ak_public_key: ECC.EccKey,
    expected_pcrs: Mapping[int, str],
    allowed_backends: Iterable[str] = ("tpm",),
    allow_insecure_sim: bool = False,
    min_version: int = 0,
    max_version_step: int = DEFAULT_MAX_VERSION_STEP,
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
        "max_version_step": max_version_step,
        "release_keyids": sorted(_keys.keyid(k) for k in release_keys),
        "ak_keyid": _keys.keyid(ak_public_key),
    }
    try:
        policy_bytes = canonical_json(policy) + b"\n"
    except (TypeError, ValueError) as exc:
        raise TrustAnchorError(f"trust anchor values are not JSON-serialisable: {exc}") from exc
    files = {
        RELEASE_KEY_FILE: b"".join(_keys.public_key_to_pem(k) for k in release_keys),
        MODEL_SIGNING_KEY_FILE: _keys.public_key_to_pem(release_keys[0]),
        AK_FILE: _keys.public_key_to_pem(ak_public_key),
        POLICY_FILE: policy_bytes,
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
    anchors = parse_trust_anchors(blobs[RELEASE_KEY_FILE], blobs[AK_FILE], blobs[POLICY_FILE])
    signing = root / MODEL_SIGNING_KEY_FILE
    if signing.exists():
        check_model_signing_key(signing.read_bytes(), anchors)
    return anchors


def check_model_signing_key(pem: bytes, anchors: TrustAnchors) -> None:
    """``release-signing.pub`` must be one of the pinned release keys. Pure.

    Raises:
        TrustAnchorError: it is not one PEM P-256 public key among ``anchors.release_public_keys``.
    """
    try:
        key = _keys.load_public_key(pem)
    except KeyFormatError as exc:
        raise TrustAnchorError(f"trust anchor {MODEL_SIGNING_KEY_FILE}: {exc}; re-export the trust anchors") from exc
    if _keys.keyid(key) not in {_keys.keyid(k) for k in anchors.release_public_keys}:
        raise TrustAnchorError(f"trust anchor {MODEL_SIGNING_KEY_FILE} is not one of the keys in {RELEASE_KEY_FILE}; "
                               "re-export the trust anchors")


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
        atomic_write(root / name, data, 0o644)
    log.info("wrote trust anchors to %s", root)
    return root
