"""Release directory layout and the pure assembly of a release's file set.

A release directory is flat and holds::

    <payload files>        e.g. model.int8.onnx, labels.json
    manifest.json          canonical-JSON manifest (see :mod:`.manifest`)
    manifest.dsse.json     DSSE envelope over the in-toto statement (see :mod:`.statement`)
    provenance.dsse.json   optional: DSSE over the provenance statement (see :mod:`.provenance`)
    model.sig              OpenSSF model-signing v1.0 signature over every other file (see :mod:`.model_sig`)
    attestation.json       {"schema": "sealfl.release-attestation/v2", "backend": str,
                            "insecure": bool, "quote": <quote, purpose "release", over the
                            SHA-256 of the signed statement>}

The release attestation is bound to the signed statement (the DSSE payload), not only to
the root digest: two versions with the same model bytes share a root digest but never a
statement, so an attestation cannot be moved from one version to another. ``model.sig`` is
made last, with the same release key, over the payload and the three documents above, so
``model_signing verify key`` checks a whole release with no file left unsigned. Version 1 of the
attestation (nonce = root digest) is refused for that reason.

:func:`assemble_release` returns ``{file name: bytes}`` for all of them; writing them to
disk is the caller's job (see :meth:`sealfl.enclave.release.enclave.ReleaseEnclave.write_release`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping

from Crypto.PublicKey import ECC

from sealfl.attestation.canonical import canonical_json, load_document
from sealfl.attestation.dsse import sign_envelope
from sealfl.attestation.errors import ManifestError, QuoteError
from sealfl.attestation.manifest import MANIFEST_FILE, build_manifest, manifest_bytes, validate_path
from sealfl.attestation.model_sig import SIGNATURE_FILE, build_model_signature
from sealfl.attestation.provenance import PROVENANCE_FILE, build_provenance
from sealfl.attestation.quote import INSECURE_BACKENDS, KNOWN_BACKENDS
from sealfl.attestation.statement import PAYLOAD_TYPE, build_statement, statement_bytes
from sealfl.common.fields import Fields

__all__ = [
    "MANIFEST_FILE",
    "ENVELOPE_FILE",
    "ATTESTATION_FILE",
    "SIGNATURE_FILE",
    "PROVENANCE_FILE",
    "REQUIRED_FILES",
    "METADATA_FILES",
    "ATTESTATION_SCHEMA",
    "validate_payload_name",
    "build_attestation",
    "parse_attestation",
    "assemble_release",
]

ENVELOPE_FILE = "manifest.dsse.json"
ATTESTATION_FILE = "attestation.json"
#: the documents every release has
REQUIRED_FILES = (MANIFEST_FILE, ENVELOPE_FILE, ATTESTATION_FILE, SIGNATURE_FILE)
#: every document name a release may hold beside its payload (provenance is optional)
METADATA_FILES = REQUIRED_FILES + (PROVENANCE_FILE,)
ATTESTATION_SCHEMA = "sealfl.release-attestation/v2"


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
        QuoteError: not strict JSON, wrong schema (v1 attestations are refused), a field of
            the wrong type (``backend`` a known backend name, ``insecure`` a boolean that
            matches it, ``quote`` an object), or ``backend`` disagrees with the signed
            quote's backend. The message names the field.
    """
    doc = load_document(data, ATTESTATION_FILE, "schema", ATTESTATION_SCHEMA, QuoteError)
    fields = Fields(ATTESTATION_FILE, QuoteError)
    backend = fields.get(doc, "backend", "choice", choices=KNOWN_BACKENDS)
    insecure = fields.get(doc, "insecure", "boolean")
    if insecure != (backend in INSECURE_BACKENDS):
        raise fields.fail("insecure", f"is {insecure} but backend {backend!r} is "
                          f"{'' if backend in INSECURE_BACKENDS else 'not '}an insecure simulation")
    quote = fields.get(doc, "quote", "object")
    if quote.get("backend") != backend:
        raise fields.fail("backend", "disagrees with the signed quote's backend")
    return quote


def assemble_release(
    payload: Mapping[str, bytes],
    name: str,
    version: int,
    metadata: dict | None,
    signing_key: ECC.EccKey,
    quote_fn: Callable[[bytes], dict],
    provenance: dict | None = None,
) -> dict[str, bytes]:
    """Build every file of a release. Pure apart from calling ``quote_fn``.

    Args:
        payload: ``{file name: bytes}`` of the payload files (flat names).
        name: release name.
        version: release version (int in ``0..2**31-1``).
        metadata: free JSON metadata for manifest and statement (e.g. ``{"model_file": ...}``).
        signing_key: ECDSA P-256 release private key (signs the DSSE envelope).
        quote_fn: returns a TEE quote with purpose ``"release"`` over its argument; called
            once with the SHA-256 of the signed statement bytes (32 bytes).
        provenance: the provenance predicate (:mod:`.provenance`), signed with ``signing_key``
            and bound to the root digest as ``provenance.dsse.json``; None = none.

    Returns:
        ``{file name: bytes}`` of payload + ``manifest.json``, ``manifest.dsse.json``,
        ``attestation.json``, ``model.sig``; payload values are the caller's objects, unchanged.

    Raises:
        ManifestError: invalid payload names, name, version or metadata.
        QuoteError: ``quote_fn`` failed to produce a quote.
        ProvenanceError: ``provenance`` is not a well-typed predicate.
    """
    for file_name in payload:
        validate_payload_name(file_name)
    manifest = build_manifest(payload, name, version, metadata)
    statement = statement_bytes(build_statement(manifest))
    envelope = sign_envelope(statement, PAYLOAD_TYPE, signing_key)
    quote = quote_fn(hashlib.sha256(statement).digest())
    if not isinstance(quote, dict):
        raise QuoteError("quote_fn must return a quote dict")
    files = dict(payload)
    files[MANIFEST_FILE] = manifest_bytes(manifest)
    files[ENVELOPE_FILE] = json.dumps(envelope, indent=2, sort_keys=True).encode("utf-8") + b"\n"
    files[ATTESTATION_FILE] = canonical_json(build_attestation(quote)) + b"\n"
    if provenance is not None:
        files[PROVENANCE_FILE] = build_provenance(name, manifest["root_digest"], provenance, signing_key)
    digests = {e["path"]: e["sha256"] for e in manifest["files"]}
    digests.update({doc: hashlib.sha256(files[doc]).hexdigest() for doc in METADATA_FILES
                    if doc in files and doc != SIGNATURE_FILE})
    files[SIGNATURE_FILE] = build_model_signature(name, digests, signing_key)
    return files
