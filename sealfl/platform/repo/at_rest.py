"""``sealfl repo publish --encrypt-at-rest``: publish a release with its model encrypted at rest
and register the key at the key broker.

Steps (the coordinator's side of :mod:`sealfl.enclave.device.at_rest`):

1. :func:`encrypt_release` -- the release is verified against the trust directory; its model
   file (``metadata.model_file``) is encrypted with a fresh AES-256-GCM key
   (:func:`sealfl.attestation.encrypted_files.encrypt_payload`, renamed ``<file>.enc``) and
   the release enclave signs and attests the result as the same name and version (a new
   root digest: the signed manifest covers the ciphertext). A provenance statement is
   re-signed with the same predicate for the new root digest.
2. the encrypted release is published to the repository (the caller);
3. :func:`register_key` -- the key goes into the broker's keys file
   (``{root digest hex: base64 key}``, mode 0600, written atomically; the file a running
   ``sealfl kbs serve --keys`` re-reads when it changes), and the new root digest into the
   broker policy's ``release_root`` list.

The plaintext model never reaches the repository; the key exists only in the keys file and
in the broker's memory.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path

from sealfl.attestation.canonical import JSONFormatError, canonical_json, loads_strict
from sealfl.attestation.encrypted_files import SUFFIX, encrypt_payload
from sealfl.attestation.errors import AttestationError
from sealfl.attestation.eventlog import parse_policy
from sealfl.attestation.provenance import PROVENANCE_FILE, verify_provenance
from sealfl.attestation.trust import load_trust_anchors
from sealfl.attestation.verify import VerifiedRelease
from sealfl.common.fsutil import atomic_write, check_private_file
from sealfl.platform.repo.keys import RepoError

__all__ = ["encrypt_release", "register_key"]

_MAX_FILE = 4 << 20


def encrypt_release(enclave, trust_dir: str | os.PathLike, release_dir: str | os.PathLike,
                    out_dir: str | os.PathLike) -> tuple[VerifiedRelease, bytes]:
    """Write ``release_dir`` re-signed with its model encrypted at rest into ``out_dir``.

    Args:
        enclave: the opened :class:`~sealfl.enclave.release.enclave.ReleaseEnclave` (signs).
        trust_dir: the trust directory the release and the result must verify against.

    Returns:
        ``(the verified encrypted release, its 32-byte key)``.

    Raises:
        RepoError: the release does not verify, is encrypted already, or names no model file.
    """
    from sealfl.enclave.device.verify import verify_dir

    try:
        v = verify_dir(trust_dir, release_dir)
    except AttestationError as exc:
        raise RepoError(f"{release_dir} does not verify: {exc}") from exc
    if "at_rest" in v.metadata:
        raise RepoError(f"{v.name} v{v.version} is encrypted at rest already; publish it without --encrypt-at-rest")
    model = v.metadata.get("model_file")
    if not isinstance(model, str) or model not in v.payload:
        raise RepoError(f"{v.name} v{v.version} names no model file in its signed metadata (model_file)")
    files = v.files()
    provenance = None
    if PROVENANCE_FILE in files:
        anchors = load_trust_anchors(trust_dir)
        pred = verify_provenance(files[PROVENANCE_FILE], anchors.release_public_keys, name=v.name,
                                 root_digest=v.root_digest).predicate
        provenance = {k: val for k, val in pred.items() if k not in ("version", "release_enclave")}
    plain = {k: val for k, val in v.payload.items() if k != PROVENANCE_FILE}
    payload, key, meta = encrypt_payload(plain, [model])
    try:
        enclave.write_release(out_dir, payload, v.name, v.version, {**v.metadata, **meta, "model_file": model + SUFFIX},
                              provenance=provenance)
        return verify_dir(trust_dir, out_dir), key
    except (AttestationError, OSError) as exc:
        raise RepoError(f"cannot write the encrypted {v.name} v{v.version}: {exc}") from exc


def _read_json(path: Path, what: str):
    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_FILE + 1)
    except OSError as exc:
        raise RepoError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if len(data) > _MAX_FILE:
        raise RepoError(f"the {what} {path} is larger than {_MAX_FILE} bytes")
    try:
        return loads_strict(data)
    except JSONFormatError as exc:
        raise RepoError(f"the {what} {path} is not strict JSON: {exc}") from None


def _check_keys_doc(doc, path: Path) -> dict:
    if not isinstance(doc, dict):
        raise RepoError(f"the key broker's keys file {path} must be an object {{root digest: base64 key}}")
    for root, value in doc.items():
        try:
            ok = len(bytes.fromhex(root)) == 32 and root == root.lower() and len(base64.b64decode(value, validate=True)) == 32
        except (ValueError, TypeError, binascii.Error):
            ok = False
        if not ok:
            raise RepoError(f"the key broker's keys file {path}: entry {str(root)[:70]!r} is not a root digest with a "
                            "base64 32-byte key")
    return doc


def register_key(keys_file: str | os.PathLike, root_digest: str, key: bytes,
                 policy_file: str | os.PathLike | None = None) -> None:
    """Register ``key`` for ``root_digest`` at the key broker (module docstring, step 3).

    Both files are checked before either is written: the keys file (created 0600 if absent;
    an existing one must be private and well formed) and the policy (must parse as an
    attestation policy: ``sealfl attest policy`` writes one).

    Raises:
        RepoError: a file is unreadable, malformed or not private; the root is registered
            already with another key.
    """
    keys_path = Path(keys_file)
    doc: dict = {}
    if keys_path.exists():
        if not check_private_file(keys_path):
            raise RepoError(f"the key broker's keys file {keys_path} is readable by group/others; chmod 600 it")
        doc = _check_keys_doc(_read_json(keys_path, "key broker's keys file"), keys_path)
    b64 = base64.b64encode(key).decode()
    if doc.get(root_digest, b64) != b64:
        raise RepoError(f"{keys_path} holds another key for root {root_digest}")
    policy = None
    if policy_file is not None:
        policy_path = Path(policy_file)
        policy = _read_json(policy_path, "key broker policy")
        try:
            parse_policy(policy, str(policy_path))
        except AttestationError as exc:
            raise RepoError(str(exc)) from None
    atomic_write(keys_path, canonical_json({**doc, root_digest: b64}) + b"\n", 0o600)
    if policy is not None:
        policy["release_root"] = sorted({*policy["release_root"], root_digest})
        atomic_write(policy_path, canonical_json(policy) + b"\n", 0o644)
