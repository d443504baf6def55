"""The in-toto Statement v1 envelope shared by sealfl's signed documents (provenance, delta
statements, ``model.sig``): strict JSON, ``_type``, ``predicateType`` and exactly one subject
with a SHA-256 digest. Pure. Source: in-toto attestation framework, Statement v1
(https://github.com/in-toto/attestation/blob/main/spec/v1/statement.md)."""

from __future__ import annotations

from typing import Any

from sealfl.attestation.canonical import JSONFormatError, loads_strict
from sealfl.common.fields import Fields

__all__ = ["STATEMENT_TYPE", "one_subject_statement"]

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"


def one_subject_statement(payload: bytes, predicate_type: str, fields: Fields, what: str, error: type,
                          *, name_nonempty: bool = True) -> tuple[dict[str, Any], str, str]:
    """Parse a verified DSSE payload as a Statement v1 of ``predicate_type`` with one subject.

    Args:
        payload: the signed payload bytes.
        predicate_type: the expected ``predicateType``.
        fields: the caller's field checker (its messages name the caller's file).
        what: the document, for the strict-JSON message.
        error: the caller's error class.
        name_nonempty: whether the subject's name may be empty.

    Returns:
        ``(statement, subject name, subject sha256 hex)``.

    Raises:
        ``error``: not strict JSON, another ``_type`` or ``predicateType``, not exactly one
            subject, or a subject without a name or a 64-hex-digit sha256 digest.
    """
    try:
        statement = loads_strict(payload)
    except JSONFormatError as exc:
        raise error(f"{what}: the signed statement is not strict JSON: {exc}") from exc
    fields.object(statement, "statement")
    if statement.get("_type") != STATEMENT_TYPE:
        raise fields.fail("_type", f"is {statement.get('_type')!r:.80}, expected {STATEMENT_TYPE!r}")
    if statement.get("predicateType") != predicate_type:
        raise fields.fail("predicateType", f"is {statement.get('predicateType')!r:.80}, expected {predicate_type!r}")
    subjects = fields.get(statement, "subject", "array", nonempty=True)
    if len(subjects) != 1:
        raise fields.fail("subject", f"must hold exactly one subject, got {len(subjects)}")
    subject = fields.object(subjects[0], "subject[0]")
    name = fields.get(subject, "name", "string", "subject[0]", nonempty=name_nonempty)
    digest = fields.get(fields.get(subject, "digest", "object", "subject[0]"), "sha256", "hex64", "subject[0].digest")
    return statement, name, digest
