"""in-toto Statement v1 for sealfl releases (in-toto/attestation spec, v1/statement.md).

A release statement::

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": <release name>, "digest": {"sha256": <root digest>}}],
     "predicateType": "https://sealfl.dev/release/v1",
     "predicate": {"name": str, "version": int, "files": [{"path","size","sha256"}...],
                   "metadata": {...}}}

It travels as the payload of a DSSE envelope with payloadType
``application/vnd.in-toto+json`` (in-toto attestation spec, v1/envelope.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from sealfl.attestation.canonical import canonical_json, load_document
from sealfl.attestation.errors import StatementError
from sealfl.attestation.manifest import check_file_entries, check_metadata, check_name_version, root_digest
from sealfl.common.fields import Fields

__all__ = [
    "STATEMENT_TYPE",
    "PREDICATE_TYPE",
    "PAYLOAD_TYPE",
    "ReleaseStatement",
    "build_statement",
    "statement_bytes",
    "parse_statement",
]

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://sealfl.dev/release/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
_WHAT = "in-toto statement"


@dataclass(frozen=True)
class ReleaseStatement:
    """A parsed, validated release statement.

    Attributes:
        name: release name (subject name and predicate name agree).
        version: release version (int in ``0..2**31-1``).
        root_digest: subject ``sha256`` digest, lowercase hex (the manifest root digest).
        statement_digest: SHA-256 of the exact statement bytes (the DSSE payload), lowercase
            hex: one value per signed release, even when two versions share their files.
        files: predicate file list ``[{"path", "size", "sha256"}]`` sorted by path.
        metadata: predicate free metadata.
    """

    name: str
    version: int
    root_digest: str
    statement_digest: str
    files: list[dict] = field(repr=False)
    metadata: dict = field(repr=False)


def build_statement(manifest: dict) -> dict:
    """Build the in-toto Statement v1 dict for a manifest built by :func:`build_manifest`."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": manifest["name"], "digest": {"sha256": manifest["root_digest"]}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "name": manifest["name"],
            "version": manifest["version"],
            "files": [dict(e) for e in manifest["files"]],
            "metadata": dict(manifest["metadata"]),
        },
    }


def statement_bytes(statement: dict) -> bytes:
    """Serialise a statement to the canonical JSON bytes that get DSSE-signed."""
    return canonical_json(statement)


def parse_statement(payload: bytes) -> ReleaseStatement:
    """Parse and validate a DSSE payload as a sealfl release statement.

    Every field is type-checked before use (see :mod:`sealfl.common.fields`); unknown
    top-level fields are ignored, as in-toto Statement v1 asks of consumers.

    Args:
        payload: the verified DSSE payload bytes.

    Returns:
        a :class:`ReleaseStatement`.

    Raises:
        StatementError: not strict JSON, wrong ``_type``/``predicateType``, not exactly one
            subject with a sha256 digest, a predicate field (name, version in
            ``0..2**31-1``, files, metadata) missing or of the wrong type, subject and
            predicate names disagree, or the subject digest is not the root digest of the
            predicate's files. The message names the field.
    """
    obj = load_document(payload, _WHAT, "_type", STATEMENT_TYPE, StatementError)
    fields = Fields(_WHAT, StatementError)
    if obj.get("predicateType") != PREDICATE_TYPE:
        raise fields.fail("predicateType", f"must be {PREDICATE_TYPE!r}, got {obj.get('predicateType')!r:.80}")
    subjects = fields.get(obj, "subject", "array", nonempty=True)
    if len(subjects) != 1:
        raise fields.fail("subject", f"must hold exactly one subject, got {len(subjects)}")
    subject = fields.object(subjects[0], "subject[0]")
    subject_name = fields.get(subject, "name", "string", "subject[0]")
    digest = fields.get(subject, "digest", "object", "subject[0]", nonempty=True)
    for algorithm, value in digest.items():  # in-toto ResourceDescriptor: algorithm -> hex string
        fields.string(value, fields.join("subject[0].digest", algorithm))
    root = fields.get(digest, "sha256", "hex64", "subject[0].digest")
    predicate = fields.get(obj, "predicate", "object")
    for key in ("name", "version", "files", "metadata"):
        if key not in predicate:
            raise fields.fail(fields.join("predicate", key), "is missing")
    fields.only(predicate, ("name", "version", "files", "metadata"), "predicate")
    check_name_version(predicate["name"], predicate["version"], fields, "predicate")
    if subject_name != predicate["name"]:
        raise fields.fail("predicate.name", f"{predicate['name']!r} differs from the subject name {subject_name!r}")
    files = check_file_entries(predicate["files"], fields, "predicate.files")
    metadata = check_metadata(predicate["metadata"], {e["path"] for e in files}, fields, "predicate.metadata")
    recomputed = root_digest({e["path"]: e["sha256"] for e in files})
    if root != recomputed:
        raise fields.fail("subject[0].digest.sha256", f"is {root}, but the predicate's files give {recomputed}")
    return ReleaseStatement(
        name=predicate["name"],
        version=predicate["version"],
        root_digest=root,
        statement_digest=hashlib.sha256(bytes(payload)).hexdigest(),
        files=files,
        metadata=metadata,
    )
