"""Pure release verification: a metadata step and a payload step (no I/O).

Like python-tuf's ``TrustedMetadataSet`` beside its ``Updater``, the decisions live here and
the reading lives in :mod:`sealfl.attestation.reader`:

* :func:`verify_metadata` takes the bytes of the three signed documents and the *names* in
  the release directory, and returns a :class:`SignedRelease` -- what was signed, including
  every payload file's size and digest. The reader then knows how far to read each file and
  never opens a file the release does not list.
* :func:`verify_payload` takes a :class:`SignedRelease` and the payload bytes and returns a
  :class:`VerifiedRelease` holding the very ``bytes`` objects that were hashed.
* :func:`verify_release` runs both on a ``{name: bytes}`` map of a whole directory, for
  callers that already hold every byte.

Checks, in order (each failure raises :class:`VerificationError` naming file and check):

1. ``missing-file`` / ``size``  the four documents are there and within their caps (a
   directory that holds a valid ``model.sig`` but lacks sealfl's documents -- signed by
   ``model_signing sign key`` -- is refused naming what sealfl demands more).
2. ``signature``  manifest.dsse.json is a DSSE envelope (every field type-checked, strict
   Base64) signed by a pinned release key.
3. ``statement``  its payload is a sealfl in-toto Statement v1.
4. ``manifest``   manifest.json parses, and its name, version, root digest, metadata and file
   list equal the signed statement's; payload names are flat and not document names.
5. ``missing-file`` / ``extra-file``  the directory holds exactly the listed files (all
   missing and unlisted names are reported; ``file`` is the first).
6. ``size``       no signed file size exceeds ``VerifyConfig.max_file_bytes``.
7. ``attestation`` attestation.json holds a quote by the pinned AK for purpose ``release``
   over the SHA-256 of the signed statement, with the pinned PCRs, from an allowed backend.
8. ``version`` / ``rollback``  :meth:`DeviceState.check` (policy min_version and
   max_version_step, the device's rollback floor).
8b. ``model-signature``  model.sig is an OpenSSF model-signing v1.0 bundle signed by a pinned
   release key (:mod:`sealfl.attestation.model_sig`) whose resources are exactly the signed
   payload files (their signed digests) and the other documents (their SHA-256; the optional
   provenance.dsse.json too: its content is the auditor's, :mod:`sealfl.attestation.audit`).
9. ``hash``       every payload file has its signed size and SHA-256 (all mismatches reported)
   -- also a file the reader *streamed*: hashed as it was read and not kept
   (:func:`sealfl.attestation.reader.load_release` ``keep``; a device booting one variant of
   a causal-LM release does not hold the others).
10. ``onnx``      every ``.onnx`` payload and the metadata's ``model_file`` is a
    self-contained ONNX model (:mod:`sealfl.attestation.onnx_check`) -- every such file that
    is held: a streamed file is never loaded from this verification (a boot that wants it
    keeps it, and then it is checked).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from sealfl.attestation.bundle import (
    ATTESTATION_FILE,
    ENVELOPE_FILE,
    MANIFEST_FILE,
    METADATA_FILES,
    PROVENANCE_FILE,
    REQUIRED_FILES,
    SIGNATURE_FILE,
    parse_attestation,
)
from sealfl.attestation.canonical import JSONFormatError, loads_strict
from sealfl.attestation.config import DEFAULT_CONFIG, VerifyConfig
from sealfl.attestation.device_state import DeviceState
from sealfl.attestation.dsse import verify_envelope
from sealfl.attestation.errors import (
    ManifestError,
    PolicyError,
    QuoteError,
    SignatureError,
    StatementError,
    VerificationError,
)
from sealfl.attestation.manifest import parse_manifest
from sealfl.attestation.model_sig import signature_problems, verify_model_signature
from sealfl.attestation.onnx_check import check_self_contained
from sealfl.attestation.quote import RELEASE_PURPOSE, verify_quote
from sealfl.attestation.statement import PAYLOAD_TYPE, parse_statement
from sealfl.attestation.trust import TrustAnchors

__all__ = ["FileEntry", "SignedRelease", "VerifiedRelease", "verify_metadata", "verify_payload", "verify_release"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileEntry:
    """One signed payload file: ``path`` (flat name), ``size`` (bytes), ``sha256`` (hex)."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class SignedRelease:
    """A release whose signed documents passed checks 1-8; its payload is not read yet.

    Attributes:
        name: release name.
        version: release version (0..2**31-1).
        root_digest: manifest root digest, lowercase hex.
        statement_digest: SHA-256 of the signed statement bytes, lowercase hex.
        files: the signed payload files, sorted by path.
        manifest: the parsed manifest dict.
        metadata: the signed metadata dict.
        backend: TEE backend of the release attestation (``"sim"`` is insecure).
        documents: ``{name: bytes}`` of the four signed documents, as verified.
    """

    name: str
    version: int
    root_digest: str
    statement_digest: str
    files: tuple[FileEntry, ...]
    manifest: dict = field(repr=False)
    metadata: dict = field(repr=False)
    backend: str
    documents: dict[str, bytes] = field(repr=False)


@dataclass(frozen=True)
class VerifiedRelease:
    """A release that passed every check.

    Attributes:
        name: release name.
        version: release version (int).
        root_digest: manifest root digest, lowercase hex.
        payload: ``{file name: bytes}`` of the payload files -- the same ``bytes`` objects
            that were hashed; hand exactly these to the runtime.
        manifest: the parsed manifest dict.
        metadata: the manifest's (signed) metadata dict.
        backend: TEE backend of the release attestation (``"sim"`` is insecure).
        statement_digest: SHA-256 of the signed statement, lowercase hex (one per signed release).
        documents: ``{name: bytes}`` of manifest.dsse.json, manifest.json, attestation.json, model.sig.
        streamed: the payload files that were verified (size and SHA-256) as they streamed
            past and not kept, ``{name: FileEntry}`` (empty unless the reader was asked to
            keep only some files); their bytes are in no attribute.
    """

    name: str
    version: int
    root_digest: str
    payload: dict[str, bytes] = field(repr=False)
    manifest: dict = field(repr=False)
    metadata: dict = field(repr=False)
    backend: str = "sim"
    statement_digest: str = ""
    documents: dict[str, bytes] = field(default_factory=dict, repr=False)
    streamed: dict[str, FileEntry] = field(default_factory=dict, repr=False)

    def files(self) -> dict[str, bytes]:
        """Every file of the release directory held as verified: documents and payload
        (not the :attr:`streamed` ones)."""
        return {**self.documents, **self.payload}


def _listing_problems(listed: Collection[str], present: Collection[str]) -> None:
    missing = sorted(set(listed) - set(present))
    extra = sorted(set(present) - set(listed) - set(METADATA_FILES))
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(f"listed in the signed manifest but absent: {missing}")
    if extra:
        parts.append(f"present but not listed in the signed manifest: {extra}")
    detail = "; ".join(parts)
    if missing:
        raise VerificationError(missing[0], "missing-file", detail, tuple(missing))
    raise VerificationError(extra[0], "extra-file", detail, tuple(extra))


def _only_model_signing(documents: Mapping[str, bytes], trust: TrustAnchors, config: VerifyConfig) -> str:
    """The missing-file hint for a directory that a model_signing signer signed: '' unless its
    model.sig verifies with a pinned key."""
    data = documents.get(SIGNATURE_FILE)
    if not isinstance(data, bytes) or len(data) > config.max_signature_bytes or ENVELOPE_FILE in documents:
        return ""
    try:
        verify_model_signature(data, trust.release_public_keys)
    except SignatureError:
        return ""
    return (f"; {SIGNATURE_FILE} verifies with the pinned release key (an OpenSSF model-signing signature), but "
            f"sealfl's policy demands more than a signature: the release enclave's signed manifest "
            f"({ENVELOPE_FILE}, {MANIFEST_FILE}) and its attestation ({ATTESTATION_FILE}); build the release "
            "with `sealfl release` (the release enclave)")


def verify_metadata(documents: Mapping[str, bytes], listing: Collection[str], trust: TrustAnchors, *,
                    state: DeviceState | None = None, config: VerifyConfig = DEFAULT_CONFIG) -> SignedRelease:
    """Checks 1-8 (module docstring) on the signed documents and the directory's names. Pure.

    Args:
        documents: ``{name: bytes}`` of manifest.dsse.json, manifest.json,
            attestation.json and model.sig (other keys are ignored).
        listing: every entry name of the release directory (nothing of them is read).
        trust: pinned keys and policy.
        state: the device's trusted state (rollback floor); None = a fresh device.
        config: size caps.

    Returns:
        a :class:`SignedRelease`.

    Raises:
        VerificationError: the first failed check, with ``.file`` and ``.check`` set.
    """
    for name in (ENVELOPE_FILE, MANIFEST_FILE, ATTESTATION_FILE, SIGNATURE_FILE):
        if name not in documents or name not in listing:
            raise VerificationError(name, "missing-file", "release metadata file is missing"
                                    + _only_model_signing(documents, trust, config))
    optional = [PROVENANCE_FILE] if PROVENANCE_FILE in listing else []
    if optional and PROVENANCE_FILE not in documents:
        raise VerificationError(PROVENANCE_FILE, "read", "the release directory lists it but it was not read")
    for name in REQUIRED_FILES + tuple(optional):
        if not isinstance(documents[name], bytes):
            raise VerificationError(name, "read", f"content must be immutable bytes, got "
                                    f"{type(documents[name]).__name__}")
        if len(documents[name]) > config.document_cap(name):
            raise VerificationError(name, "size", f"{len(documents[name])} bytes > cap {config.document_cap(name)}")
    try:
        envelope = loads_strict(documents[ENVELOPE_FILE])
        payload = verify_envelope(envelope, trust.release_public_keys, expected_payload_type=PAYLOAD_TYPE)
    except (JSONFormatError, SignatureError) as exc:
        raise VerificationError(ENVELOPE_FILE, "signature", str(exc)) from exc
    try:
        statement = parse_statement(payload)
    except StatementError as exc:
        raise VerificationError(ENVELOPE_FILE, "statement", str(exc)) from exc
    try:
        manifest = parse_manifest(documents[MANIFEST_FILE])
    except ManifestError as exc:
        raise VerificationError(MANIFEST_FILE, "manifest", str(exc)) from exc
    if not hmac.compare_digest(manifest["root_digest"], statement.root_digest):
        raise VerificationError(MANIFEST_FILE, "manifest", f"root digest {manifest['root_digest']} differs from "
                                f"the signed one {statement.root_digest}")
    for key, signed in (("name", statement.name), ("version", statement.version),
                        ("metadata", statement.metadata), ("files", statement.files)):
        if manifest[key] != signed:
            raise VerificationError(MANIFEST_FILE, "manifest", f"field {key!r} differs from the signed statement")
    entries = tuple(FileEntry(e["path"], e["size"], e["sha256"]) for e in statement.files)
    for entry in entries:
        if entry.path in METADATA_FILES or "/" in entry.path:
            raise VerificationError(MANIFEST_FILE, "manifest", f"lists {entry.path!r} as a payload file; payload "
                                    "names are plain file names (release directories are flat) other than "
                                    f"{list(METADATA_FILES)}")
    _listing_problems([e.path for e in entries], listing)
    too_big = [e.path for e in entries if e.size > config.max_file_bytes]
    if too_big:
        raise VerificationError(too_big[0], "size", f"signed size exceeds the cap of {config.max_file_bytes} bytes "
                                f"(all: {too_big})", tuple(too_big))
    try:
        quote = parse_attestation(documents[ATTESTATION_FILE])
        verify_quote(quote, trust.ak_public_key, RELEASE_PURPOSE, bytes.fromhex(statement.statement_digest),
                     trust.expected_pcrs, allowed_backends=trust.accepted_backends())
    except (QuoteError, PolicyError) as exc:
        raise VerificationError(ATTESTATION_FILE, "attestation", str(exc)) from exc
    (state or DeviceState()).check(statement.version, statement.root_digest, statement.statement_digest, trust)
    try:
        model_sig = verify_model_signature(documents[SIGNATURE_FILE], trust.release_public_keys)
    except SignatureError as exc:
        raise VerificationError(SIGNATURE_FILE, "model-signature", str(exc)) from exc
    expected = {e.path: e.sha256 for e in entries}
    expected.update({doc: hashlib.sha256(documents[doc]).hexdigest()
                     for doc in (MANIFEST_FILE, ENVELOPE_FILE, ATTESTATION_FILE, *optional)})
    problems = signature_problems(model_sig.files, expected)
    if problems:
        raise VerificationError(SIGNATURE_FILE, "model-signature", "; ".join(problems[:8])
                                + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""))
    return SignedRelease(
        name=statement.name, version=statement.version, root_digest=statement.root_digest,
        statement_digest=statement.statement_digest, files=entries, manifest=manifest,
        metadata=manifest["metadata"], backend=quote["backend"],
        documents={name: documents[name] for name in (*REQUIRED_FILES, *optional)},
    )


def _model_files(signed: SignedRelease) -> list[str]:
    names = {e.path for e in signed.files if e.path.lower().endswith(".onnx")}
    if isinstance(signed.metadata.get("model_file"), str):
        names.add(signed.metadata["model_file"])
    # files the signed metadata declares encrypted at rest are checked after decryption,
    # on the device, by sealfl.enclave.device.at_rest.open_payload
    at_rest = signed.metadata.get("at_rest")
    encrypted = at_rest.get("files") if isinstance(at_rest, dict) else None
    if isinstance(encrypted, list):
        names -= {f for f in encrypted if isinstance(f, str)}
    return sorted(names)


def _is_hex_digest(digest) -> bool:
    return isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


def verify_payload(signed: SignedRelease, payload: Mapping[str, bytes],
                   digests: Mapping[str, str] | None = None,
                   streamed: Mapping[str, tuple[int, str]] | None = None) -> VerifiedRelease:
    """Checks 9-10 (module docstring): sizes, hashes, self-contained ONNX. Pure.

    Args:
        signed: the result of :func:`verify_metadata`.
        payload: ``{path: bytes}`` of every signed payload file that is kept (immutable
            ``bytes``).
        digests: optional ``{path: SHA-256 hex}`` that the caller computed over exactly
            those ``bytes`` objects while reading them (:func:`sealfl.attestation.reader.load_release`
            hashes a large file chunk by chunk as it arrives); used instead of hashing
            them again. Anything but 64 lowercase hex characters is ignored (hashed here).
        streamed: ``{path: (bytes read, SHA-256 hex of them)}`` of the signed payload files
            that are not kept: the reader hashed them as it read them (to EOF, at most the
            signed size + 1 byte) and dropped the bytes. Every signed file must be in
            exactly one of ``payload`` and ``streamed``.

    Returns:
        a :class:`VerifiedRelease` whose ``payload`` values are the objects passed in and
        whose ``streamed`` names the others.

    Raises:
        VerificationError: ``missing-file``, ``extra-file`` (also a file both held and
            streamed), ``read`` (not ``bytes``), ``hash`` (every mismatching file listed;
            ``file`` is the first) or ``onnx``.
    """
    streamed = dict(streamed or {})
    both = sorted(set(payload) & set(streamed))
    if both:
        raise VerificationError(both[0], "extra-file", f"given both as bytes and as streamed: {both}", tuple(both))
    _listing_problems([e.path for e in signed.files], [*payload, *streamed])
    mismatched: list[tuple[str, str]] = []
    for entry in signed.files:
        if entry.path in streamed:
            size, digest = streamed[entry.path]
            if size != entry.size:
                mismatched.append((entry.path, f"size {size} bytes != signed size {entry.size}"))
            elif not _is_hex_digest(digest) or not hmac.compare_digest(digest, entry.sha256):
                mismatched.append((entry.path, f"sha256 {digest} != signed {entry.sha256}"))
            continue
        data = payload[entry.path]
        if not isinstance(data, bytes):
            raise VerificationError(entry.path, "read", f"content must be immutable bytes, got {type(data).__name__}")
        if len(data) != entry.size:
            mismatched.append((entry.path, f"size {len(data)} bytes != signed size {entry.size}"))
            continue
        digest = (digests or {}).get(entry.path)
        if not _is_hex_digest(digest):
            digest = hashlib.sha256(data).hexdigest()
        if not hmac.compare_digest(digest, entry.sha256):
            mismatched.append((entry.path, f"sha256 {digest} != signed {entry.sha256}"))
    if mismatched:
        others = f" (all mismatching files: {[p for p, _ in mismatched]})" if len(mismatched) > 1 else ""
        raise VerificationError(mismatched[0][0], "hash", mismatched[0][1] + others, tuple(p for p, _ in mismatched))
    for name in _model_files(signed):
        if name not in streamed:
            check_self_contained(payload[name], name)
    log.info("verified release %s v%d root %s statement %s (backend %s)%s", signed.name, signed.version,
             signed.root_digest, signed.statement_digest[:16], signed.backend,
             f"; streamed, not kept: {sorted(streamed)}" if streamed else "")
    return VerifiedRelease(
        name=signed.name, version=signed.version, root_digest=signed.root_digest,
        payload={e.path: payload[e.path] for e in signed.files if e.path not in streamed}, manifest=signed.manifest,
        metadata=signed.metadata, backend=signed.backend, statement_digest=signed.statement_digest,
        documents=dict(signed.documents), streamed={e.path: e for e in signed.files if e.path in streamed},
    )


def verify_release(files: Mapping[str, bytes], trust: TrustAnchors, *, state: DeviceState | None = None,
                   config: VerifyConfig = DEFAULT_CONFIG) -> VerifiedRelease:
    """Verify every file of a release directory against pinned trust anchors. Pure; no I/O.

    Args:
        files: ``{file name: content}`` of *every* file of the release dir; the values must
            be immutable ``bytes``.
        trust: pinned keys and policy (see :class:`TrustAnchors`).
        state: the device's trusted state (rollback floor); None = a fresh device.
        config: size caps.

    Returns:
        a :class:`VerifiedRelease`.

    Raises:
        VerificationError: the first failed check, with ``.file`` and ``.check`` set
            (checks listed in the module docstring).
    """
    for name, data in files.items():
        if not isinstance(data, bytes):
            raise VerificationError(name, "read", f"content must be immutable bytes, got {type(data).__name__}")
    signed = verify_metadata(files, files.keys(), trust, state=state, config=config)
    return verify_payload(signed, {e.path: files[e.path] for e in signed.files})
