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

from dataclasses import dataclass, field
from typing import Any

from .canonical import canonical_json, load_document
from .errors import ManifestError, StatementError
from .manifest import check_file_entries, is_sha256_hex

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


@dataclass(frozen=True)
class ReleaseStatement:
    """A parsed, validated release statement.

    Attributes:
        name: release name (subject name and predicate name agree).
        version: release version (int >= 0).
        root_digest: subject ``sha256`` digest, lowercase hex (the manifest root digest).
        files: predicate file list ``[{"path", "size", "sha256"}]`` sorted by path.
        metadata: predicate free metadata.
    """

    name: str
    version: int
    root_digest: str
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

    Args:
        payload: the verified DSSE payload bytes.

    Returns:
        a :class:`ReleaseStatement`.

    Raises:
        StatementError: not strict JSON, wrong ``_type``/``predicateType``, not exactly one
            subject with a sha256 digest, predicate name/version/files/metadata malformed,
            or subject and predicate names disagree.
    """
    obj = load_document(payload, "statement", "_type", STATEMENT_TYPE, StatementError)
    if obj.get("predicateType") != PREDICATE_TYPE:
        raise StatementError(
            f"predicateType must be {PREDICATE_TYPE!r}, got {obj.get('predicateType')!r}"
        )
    subject = obj.get("subject")
    if not isinstance(subject, list) or len(subject) != 1 or not isinstance(subject[0], dict):
        raise StatementError("statement must have exactly one subject")
    digest: Any = subject[0].get("digest")
    if not isinstance(digest, dict) or not is_sha256_hex(digest.get("sha256")):
        raise StatementError("statement subject needs a 64-hex 'sha256' digest")
    predicate = obj.get("predicate")
    if not isinstance(predicate, dict) or set(predicate) != {"name", "version", "files", "metadata"}:
        raise StatementError("predicate must have exactly name/version/files/metadata")
    name, version = predicate["name"], predicate["version"]
    if not isinstance(name, str) or not name or subject[0].get("name") != name:
        raise StatementError(
            f"subject name {subject[0].get('name')!r} and predicate name {name!r} must be equal and non-empty"
        )
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise StatementError(f"predicate version must be an integer >= 0, got {version!r}")
    if not isinstance(predicate["metadata"], dict):
        raise StatementError("predicate metadata must be an object")
    try:
        files = check_file_entries(predicate["files"])
    except ManifestError as exc:
        raise StatementError(f"predicate file list: {exc}") from exc
    return ReleaseStatement(
        name=name,
        version=version,
        root_digest=digest["sha256"],
        files=files,
        metadata=predicate["metadata"],
    )
