"""Release provenance: where a release came from, signed by the release enclave.

``provenance.dsse.json`` (in the release directory, covered by ``model.sig``) is a DSSE
envelope (payloadType ``application/vnd.in-toto+json``) signed with the release key over an
in-toto Statement v1 bound to the release's root digest::

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": <release name>, "digest": {"sha256": <manifest root digest>}}],
     "predicateType": "https://sealfl.dev/provenance/v1",
     "predicate": {
       "version": int,                              # the release version
       "consortium": {"name": str, "context_id": str, "partners": [str, ...]},
       "campaign": {"id": str, "config_sha256": hex},      # SHA-256 of its server_config.json
       "he": {"codec": str, "params": {...}, "public_params_sha256": hex},  # the aggregator's public context file
       "rounds": [{"round": int >= 1, "aggregate_sha256": hex, "partners": [str, ...]}, ...],  # ascending
       "decrypted_aggregate": {"round": int, "sha256": hex},  # the checkpoint the enclave opened
       "optimizer": {"name": str, "settings": {...}},
       "gate": {...}, "export": {...}, "quantization": {...},   # figures and settings, free JSON
       "sealfl_version": str,
       "privacy": {...},                            # only a differentially private campaign's: epsilon, delta, ...
       "release_enclave": {"backend": str, "measurement": {"16": hex}}}}   # written by the enclave itself

``rounds[i].aggregate_sha256`` is the SHA-256 of round i's encrypted aggregate frame as the
aggregator committed it (``rounds.jsonl``'s ``aggregate_sha256``); ``partners`` are the
partners whose updates were summed. Unknown predicate fields are kept (a newer writer), a
known field of the wrong type is refused. :func:`verify_provenance` is pure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from Crypto.PublicKey import ECC

from sealfl.attestation.canonical import JSONFormatError, canonical_json, loads_strict
from sealfl.attestation.dsse import sign_envelope, verify_envelope
from sealfl.attestation.errors import ProvenanceError, SignatureError
from sealfl.attestation.intoto import one_subject_statement
from sealfl.common.fields import Fields

__all__ = ["PROVENANCE_FILE", "PREDICATE_TYPE", "Provenance", "build_provenance", "verify_provenance"]

PROVENANCE_FILE = "provenance.dsse.json"
PREDICATE_TYPE = "https://sealfl.dev/provenance/v1"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
_WHAT = PROVENANCE_FILE
_FREE = ("gate", "export", "quantization")


@dataclass(frozen=True)
class Provenance:
    """A verified provenance statement.

    Attributes:
        name: subject (release) name.
        root_digest: subject digest: the release's manifest root digest.
        rounds: ``[{"round", "aggregate_sha256", "partners"}]`` ascending by round.
        decrypted_aggregate: ``{"round", "sha256"}``.
        measurement: the release enclave's ``{"16": hex}``.
        predicate: the whole predicate as signed.
    """

    name: str
    root_digest: str
    rounds: list[dict] = field(repr=False)
    decrypted_aggregate: dict = field(repr=False)
    measurement: dict = field(repr=False)
    predicate: dict = field(repr=False)


def build_provenance(name: str, root_digest: str, predicate: dict, signing_key: ECC.EccKey) -> bytes:
    """The bytes of ``provenance.dsse.json``: ``predicate`` bound to ``root_digest``, signed.

    Raises:
        ProvenanceError: ``predicate`` does not pass :func:`check_predicate` or is not JSON.
    """
    check_predicate(predicate, Fields(f"{_WHAT} predicate", ProvenanceError), "")
    statement = {"_type": STATEMENT_TYPE, "subject": [{"name": name, "digest": {"sha256": root_digest}}],
                 "predicateType": PREDICATE_TYPE, "predicate": predicate}
    try:
        payload = canonical_json(statement)
    except (TypeError, ValueError) as exc:
        raise ProvenanceError(f"provenance is not JSON-serialisable: {exc}") from exc
    return canonical_json(sign_envelope(payload, PAYLOAD_TYPE, signing_key)) + b"\n"


def check_predicate(pred: dict, fields: Fields, at: str = "predicate") -> dict:
    """Type-check a provenance predicate (module docstring); return it. Raises ``fields``' error."""
    fields.object(pred, at or "predicate")
    fields.get(pred, "version", "integer", at)
    cons = fields.get(pred, "consortium", "object", at)
    where = fields.join(at, "consortium")
    fields.get(cons, "name", "string", where)
    fields.get(cons, "context_id", "string", where)
    for i, p in enumerate(fields.get(cons, "partners", "array", where, nonempty=True, max_len=10_000)):
        fields.string(p, fields.join(fields.join(where, "partners"), i), max_len=256)
    camp = fields.get(pred, "campaign", "object", at)
    fields.get(camp, "id", "string", fields.join(at, "campaign"))
    fields.get(camp, "config_sha256", "hex64", fields.join(at, "campaign"))
    he = fields.get(pred, "he", "object", at)
    fields.get(he, "codec", "string", fields.join(at, "he"))
    fields.get(he, "public_params_sha256", "hex64", fields.join(at, "he"))
    rounds = fields.get(pred, "rounds", "array", at, nonempty=True, max_len=100_000)
    previous = 0
    for i, entry in enumerate(rounds):
        here = fields.join(fields.join(at, "rounds"), i)
        fields.object(entry, here)
        number = fields.get(entry, "round", "integer", here, lo=1)
        if number <= previous:
            raise fields.fail(fields.join(here, "round"), f"rounds must ascend (round {previous} then {number})")
        previous = number
        fields.get(entry, "aggregate_sha256", "hex64", here)
        for j, p in enumerate(fields.get(entry, "partners", "array", here, nonempty=True, max_len=10_000)):
            fields.string(p, fields.join(fields.join(here, "partners"), j), max_len=256)
    dec = fields.get(pred, "decrypted_aggregate", "object", at)
    fields.get(dec, "round", "integer", fields.join(at, "decrypted_aggregate"), lo=1)
    fields.get(dec, "sha256", "hex64", fields.join(at, "decrypted_aggregate"))
    opt = fields.get(pred, "optimizer", "object", at)
    fields.get(opt, "name", "string", fields.join(at, "optimizer"))
    fields.get(opt, "settings", "object", fields.join(at, "optimizer"))
    for key in _FREE:
        fields.get(pred, key, "object", at)
    fields.get(pred, "sealfl_version", "string", at)
    enclave = fields.get(pred, "release_enclave", "object", at)
    fields.get(enclave, "backend", "string", fields.join(at, "release_enclave"))
    measurement = fields.get(enclave, "measurement", "object", fields.join(at, "release_enclave"), nonempty=True)
    for pcr, value in measurement.items():
        fields.hex64(value, fields.join(fields.join(at, "release_enclave.measurement"), pcr))
    return pred


def verify_provenance(data: bytes, trusted: Sequence[ECC.EccKey], *, name: str, root_digest: str) -> Provenance:
    """Verify ``provenance.dsse.json`` bytes: a DSSE signature of a pinned release key, an
    in-toto Statement v1 of predicate type ``https://sealfl.dev/provenance/v1`` whose one
    subject is ``name`` with sha256 ``root_digest``, and a well-typed predicate. Pure.

    Raises:
        ProvenanceError: any check fails; the message names the file and the field.
    """
    try:
        payload = verify_envelope(loads_strict(data), trusted, expected_payload_type=PAYLOAD_TYPE)
    except (JSONFormatError, SignatureError) as exc:
        raise ProvenanceError(f"{_WHAT}: {exc}") from exc
    fields = Fields(_WHAT, ProvenanceError)
    statement, signed_name, digest = one_subject_statement(payload, PREDICATE_TYPE, fields, _WHAT, ProvenanceError)
    if signed_name != name:
        raise fields.fail("subject[0].name", f"is {signed_name!r}, but the release is {name!r}")
    if digest != root_digest:
        raise fields.fail("subject[0].digest.sha256", f"is {digest}, but the release's root digest is {root_digest}: "
                          "this provenance is another release's")
    pred = check_predicate(statement.get("predicate"), fields)
    return Provenance(name=name, root_digest=digest, rounds=pred["rounds"], decrypted_aggregate=pred["decrypted_aggregate"],
                      measurement=pred["release_enclave"]["measurement"], predicate=pred)


def aggregate_digest(frame: bytes) -> str:
    """SHA-256 hex of an encrypted aggregate frame (what ``rounds.jsonl`` and the provenance record)."""
    return hashlib.sha256(bytes(frame)).hexdigest()
