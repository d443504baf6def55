"""Release directory layout and the pure assembly of a release's file set.

A release directory is flat and holds::

    <payload files>        e.g. model.int8.onnx, labels.json
    manifest.json          canonical-JSON manifest (see :mod:`.manifest`)
    manifest.dsse.json     DSSE envelope over the in-toto statement (see :mod:`.statement`)
    attestation.json       {"schema": "sealfl.release-attestation/v1", "backend": str,
                            "insecure": bool, "quote": <quote with nonce = root digest>}

:func:`assemble_release` returns ``{file name: bytes}`` for all of them; writing them to
disk is the caller's job (see :meth:`sealfl.enclave.release_enclave.ReleaseEnclave.write_release`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from Crypto.PublicKey import ECC

from .canonical import canonical_json, load_document
from .dsse import sign_envelope
from .errors import ManifestError, QuoteError
from .manifest import build_manifest, manifest_bytes, validate_path
from .quote import INSECURE_BACKENDS
from .statement import PAYLOAD_TYPE, build_statement, statement_bytes

__all__ = [
    "MANIFEST_FILE",
    "ENVELOPE_FILE",
    "ATTESTATION_FILE",
    "METADATA_FILES",
    "ATTESTATION_SCHEMA",
    "validate_payload_name",
    "build_attestation",
    "parse_attestation",
    "assemble_release",
]

MANIFEST_FILE = "manifest.json"
ENVELOPE_FILE = "manifest.dsse.json"
ATTESTATION_FILE = "attestation.json"
METADATA_FILES = (MANIFEST_FILE, ENVELOPE_FILE, ATTESTATION_FILE)
ATTESTATION_SCHEMA = "sealfl.release-attestation/v1"


def validate_payload_name(name: str) -> str:
    """Check a payload file name for a flat release directory and return it.

    Raises:
        ManifestError: the name contains ``/``, is a metadata file name, or is not a valid
            manifest path (see :func:`sealfl.attestation.manifest.validate_path`).
    """
    if not isinstance(name, str) or "/" in name:
        raise ManifestError(f"payload name {name!r} must be a plain file name (release dirs are flat)")
    if name in METADATA_FILES:
        raise ManifestError(f"payload name {name!r} is reserved for release metadata")
    return validate_path(name)


def build_attestation(quote: dict) -> dict:
    """Wrap a release-enclave quote into the ``attestation.json`` document."""
    backend = quote.get("backend")
    return {
        "schema": ATTESTATION_SCHEMA,
        "backend": backend,
        "insecure": backend in INSECURE_BACKENDS,
        "quote": quote,
    }


def parse_attestation(data: bytes) -> dict:
    """Parse ``attestation.json`` bytes and return the quote dict inside (not yet verified).

    Raises:
        QuoteError: not strict JSON, wrong schema, no quote object, or the informational
            ``backend`` field disagrees with the signed quote's backend.
    """
    doc = load_document(data, "attestation", "schema", ATTESTATION_SCHEMA, QuoteError)
    quote = doc.get("quote")
    if not isinstance(quote, dict):
        raise QuoteError("attestation has no 'quote' object")
    if doc.get("backend") != quote.get("backend"):
        raise QuoteError("attestation 'backend' disagrees with the signed quote's backend")
    return quote


def assemble_release(
    payload: Mapping[str, bytes],
    name: str,
    version: int,
    metadata: dict | None,
    signing_key: ECC.EccKey,
    quote_fn: Callable[[bytes], dict],
) -> dict[str, bytes]:
    """Build every file of a release. Pure apart from calling ``quote_fn``.

    Args:
        payload: ``{file name: bytes}`` of the payload files (flat names).
        name: release name.
        version: release version (int >= 0).
        metadata: free JSON metadata for manifest and statement (e.g. ``{"model_file": ...}``).
        signing_key: ECDSA P-256 release private key (signs the DSSE envelope).
        quote_fn: returns a TEE quote for a nonce; called once with
            ``bytes.fromhex(root_digest)`` (32 bytes).

    Returns:
        ``{file name: bytes}`` of payload + ``manifest.json``, ``manifest.dsse.json``,
        ``attestation.json``; payload values are the caller's objects, unchanged.

    Raises:
        ManifestError: invalid payload names, name, version or metadata.
        QuoteError: ``quote_fn`` failed to produce a quote.
    """
    for file_name in payload:
        validate_payload_name(file_name)
    manifest = build_manifest(payload, name, version, metadata)
    envelope = sign_envelope(statement_bytes(build_statement(manifest)), PAYLOAD_TYPE, signing_key)
    quote = quote_fn(bytes.fromhex(manifest["root_digest"]))
    if not isinstance(quote, dict):
        raise QuoteError("quote_fn must return a quote dict")
    files = dict(payload)
    files[MANIFEST_FILE] = manifest_bytes(manifest)
    files[ENVELOPE_FILE] = json.dumps(envelope, indent=2, sort_keys=True).encode("utf-8") + b"\n"
    files[ATTESTATION_FILE] = canonical_json(build_attestation(quote)) + b"\n"
    return files
