"""Exception hierarchy of :mod:`sealfl.attestation`.

Every error raised by this package derives from :class:`AttestationError` (itself a
:class:`sealfl.common.errors.SealflError`), so callers
(the CLI, the device boot flow) can catch one type. Messages say what failed and what
to do about it. :class:`VerificationError` is the one a release verification raises;
it names the release file and the check that failed, e.g.
``release file 'model.int8.onnx' failed check 'hash': ...``.
"""

from __future__ import annotations

from sealfl.common.errors import SealflError

__all__ = [
    "AttestationError",
    "KeyFormatError",
    "ManifestError",
    "SignatureError",
    "StatementError",
    "ProvenanceError",
    "AuditError",
    "QuoteError",
    "PolicyError",
    "FormatError",
    "TrustAnchorError",
    "DeviceStateError",
    "VerificationError",
    "CanaryError",
    "AtRestError",
    "KeyWrapFormatError",
    "CHECKS",
]


class AttestationError(SealflError):
    """Base class of every error raised by :mod:`sealfl.attestation`.

    Derives from :class:`sealfl.common.errors.SealflError` (a dependency-free module) so the
    CLI can catch every deliberate sealfl error with one ``except``.
    """


class KeyFormatError(AttestationError):
    """A key could not be parsed, is not ECDSA P-256, or is private where a public key was expected."""


class ManifestError(AttestationError):
    """A manifest is malformed (schema, types, paths, sizes, digests) or its root digest does not add up."""


class SignatureError(AttestationError):
    """A DSSE envelope is malformed or carries no signature by a trusted key."""


class StatementError(AttestationError):
    """An in-toto Statement is malformed or not a sealfl release statement."""


class ProvenanceError(AttestationError):
    """A release's provenance statement is malformed, not signed by a pinned release key, or
    bound to another release (:mod:`sealfl.attestation.provenance`)."""


class DeltaError(AttestationError):
    """A signed delta is malformed, not signed by a pinned release key, made for another base
    release, or its patches do not produce the release it promises (:mod:`sealfl.attestation.delta`)."""


class AuditError(AttestationError):
    """Public evidence given to an audit is unreadable or malformed (:mod:`sealfl.attestation.audit`)."""


class QuoteError(AttestationError):
    """A TEE quote is malformed, its signature is not by the pinned attestation key, or its nonce/digest is wrong."""


class PolicyError(AttestationError):
    """A well-formed, authentic quote does not satisfy the policy (PCR values, backend)."""


class FormatError(AttestationError, ValueError):
    """Bytes are not in the one encoding sealfl accepts for them (strict JSON, canonical
    Base64) or a document field has the wrong JSON type or range. Also a ``ValueError`` so
    callers that parse generically can catch it; the message names the file and field."""


class TrustAnchorError(AttestationError):
    """The trust directory (pinned keys + policy.json) is missing, malformed or inconsistent."""


class DeviceStateError(AttestationError):
    """The device's ``state.json`` (its rollback floor and last good release) is malformed."""


#: Short names used in :attr:`VerificationError.check`, with what to do when they fail.
CHECKS: dict[str, str] = {
    "read": "check that the release directory exists and is readable",
    "file-type": "a release directory holds only regular files; remove symlinks, subdirectories and special files",
    "size": ("the file exceeds the size cap; raise the cap in VerifyConfig only if the release is "
             "legitimately that large"),
    "missing-file": "re-download or re-copy the complete release directory",
    "extra-file": "remove files that are not listed in manifest.json; only signed files may sit in a release directory",
    "signature": "the release was not signed by a pinned release key; check you have the right trust directory and release",
    "statement": "the signed in-toto statement is malformed; rebuild the release with the release enclave",
    "manifest": "manifest.json does not match the signed statement or is malformed; re-download the release",
    "hash": "the file's bytes differ from the signed manifest (corruption or tampering); re-download the release",
    "onnx": ("the model is not a self-contained ONNX file (it is unparsable or a tensor points at external "
             "data); rebuild the release with every tensor embedded in the model file"),
    "attestation": "the release attestation does not prove that the pinned release enclave produced this release",
    "version": ("the release version is below the minimum version pinned in policy.json, or jumps further "
                "above the device's last version than policy.json's max_version_step allows"),
    "model-signature": ("model.sig (the OpenSSF model-signing signature) is not by a pinned release key or does "
                        "not sign exactly the files of this release; re-download the release"),
    "rollback": ("the release is older than, or differs at the same version from, the last release this "
                 "device ran; publish a newer version"),
}


class VerificationError(AttestationError):
    """A release failed one verification check.

    Attributes:
        file: name of the release file that failed (``str``), e.g. ``"model.int8.onnx"``,
            ``"manifest.dsse.json"``; for directory-level failures the directory path.
        check: short name of the failed check, one of :data:`CHECKS` keys
            (``"hash"``, ``"manifest"``, ``"signature"``, ``"attestation"``, ``"missing-file"``,
            ``"extra-file"``, ``"version"``, ``"rollback"``, ...).
        detail: human-readable explanation of what differed.
        files: every file that failed this check (``tuple[str, ...]``, ``file`` first), e.g.
            all unlisted files of a release directory, not only the first.

    ``str(err)`` names the file, the check, the detail and what to do.
    """

    def __init__(self, file: str, check: str, detail: str, files: tuple[str, ...] = ()) -> None:
        self.file = file
        self.check = check
        self.detail = detail
        self.files = (file,) + tuple(f for f in files if f != file)
        hint = CHECKS.get(check, "")
        msg = f"release file {file!r} failed check {check!r}: {detail}"
        if hint:
            msg += f" (what to do: {hint})"
        super().__init__(msg)

    def __reduce__(self):  # keep pickling (e.g. across processes) working with the custom __init__
        return (type(self), (self.file, self.check, self.detail, self.files))


class CanaryError(AttestationError):
    """A release's signed canary is malformed, or the model's answers on this device differ
    from the canary's expected outputs (or depend on the batch) beyond its tolerance."""


class AtRestError(AttestationError):
    """A release file encrypted at rest is malformed, or the key does not open it
    (:mod:`sealfl.attestation.encrypted_files`)."""


class KeyWrapFormatError(AttestationError):
    """A model key could not be HPKE-wrapped to, or unwrapped for, a device's per-request
    key (:mod:`sealfl.attestation.hpke_wrap`)."""
