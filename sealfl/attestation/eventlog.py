"""Measured-boot event log, attestation evidence and its verification. Pure; no I/O.

A device's boot extends PCRs (allocation: :mod:`sealfl.enclave.tee.tpm`) and writes one event
per extend, in order, to its event log::

    {"schema": "sealfl.eventlog/v1", "bank": "sha256",
     "events": [{"pcr": 16, "type": "runtime-code", "digest": hex64, "detail": str}, ...]}

Event types (:data:`EVENT_TYPES`): ``runtime-code`` (PCR 16, the sealfl runtime's
measurement at boot), ``config`` (PCR 16, the device configuration: trust anchors and
policy), ``release-root`` (PCR 23, the verified release root digest) and
``runtime-recheck`` (PCR 16, the runtime measured again when the device attests, so a
file changed after boot shows). Replaying the events from zero
(:func:`replay`, TPM 2.0 Part 1 §17) must give the quoted PCR values.

Evidence (what ``sealfl device attest --nonce HEX`` prints)::

    {"schema": "sealfl.attestation-evidence/v1", "quote": {...}, "eventlog": {...}}

Policy (the verifier's allowed values, a JSON file)::

    {"schema": "sealfl.attestation-policy/v1",
     "backends": ["tpm"],                         # allowed TEE backends
     "runtime_code": [hex64, ...],                # allowed runtime measurements (code and recheck)
     "config": [hex64, ...],                      # allowed configuration digests
     "release_root": [hex64, ...]}                # allowed release root digests

:func:`verify_evidence` checks, in order: the evidence's and event log's types; the
quote (:func:`sealfl.attestation.quote.verify_quote`: AK signature, nonce = the verifier's
fresh challenge, PCR digest) with the expected PCRs = the event-log replay, every quoted PCR
accounted for by the log; then the policy: the backend, and every event's digest in the
allowed list of its type, with at least one ``runtime-code``, ``config`` and
``release-root`` event and every ``runtime-recheck`` equal to the boot's ``runtime-code``.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from Crypto.PublicKey import ECC

from sealfl.attestation.errors import PolicyError, QuoteError
from sealfl.attestation.quote import CHALLENGE_PURPOSE, NUM_PCRS, PCR_BANK, pcr_after, verify_quote
from sealfl.common.fields import Fields

__all__ = ["EVENTLOG_SCHEMA", "EVIDENCE_SCHEMA", "POLICY_SCHEMA", "EVENT_TYPES", "EVENT_PCR", "Event",
           "parse_eventlog", "eventlog_doc", "replay", "AttestationPolicy", "parse_policy", "Attested",
           "verify_evidence"]

EVENTLOG_SCHEMA = "sealfl.eventlog/v1"
EVIDENCE_SCHEMA = "sealfl.attestation-evidence/v1"
POLICY_SCHEMA = "sealfl.attestation-policy/v1"
#: event type -> the PCR it extends.
EVENT_PCR: dict[str, int] = {"runtime-code": 16, "config": 16, "release-root": 23, "runtime-recheck": 16}
EVENT_TYPES = tuple(EVENT_PCR)
#: Most events a log may hold (a boot writes 3, each attestation 1 more).
MAX_EVENTS = 4096
_POLICY_KEY = {"runtime-code": "runtime_code", "runtime-recheck": "runtime_code", "config": "config",
               "release-root": "release_root"}


@dataclass(frozen=True)
class Event:
    """One extend: ``pcr`` (int), ``type`` (:data:`EVENT_TYPES`), ``digest`` (hex64), ``detail`` (str)."""

    pcr: int
    type: str
    digest: str
    detail: str = ""


def eventlog_doc(events: Collection[Event]) -> dict:
    """The JSON document of an event log."""
    return {"schema": EVENTLOG_SCHEMA, "bank": PCR_BANK,
            "events": [{"pcr": e.pcr, "type": e.type, "digest": e.digest, "detail": e.detail} for e in events]}


def parse_eventlog(doc: Any, what: str = "eventlog") -> list[Event]:
    """Check an event-log document (format in the module docstring) and return its events.

    Raises:
        QuoteError: a field missing, unknown or of the wrong type, a type extending another
            PCR than its own, or more than :data:`MAX_EVENTS` events; names the field.
    """
    fields = Fields(what, QuoteError)
    fields.object(doc, "")
    fields.only(doc, ("schema", "bank", "events"))
    fields.get(doc, "schema", "choice", choices=(EVENTLOG_SCHEMA,))
    fields.get(doc, "bank", "choice", choices=(PCR_BANK,))
    raw = fields.get(doc, "events", "array", max_len=MAX_EVENTS)
    events = []
    for i, item in enumerate(raw):
        at = fields.join("events", i)
        fields.object(item, at)
        fields.only(item, ("pcr", "type", "digest", "detail"), at)
        kind = fields.get(item, "type", "choice", at, choices=EVENT_TYPES)
        pcr = fields.get(item, "pcr", "integer", at, lo=0, hi=NUM_PCRS - 1)
        if pcr != EVENT_PCR[kind]:
            raise fields.fail(fields.join(at, "pcr"), f"is {pcr}, but {kind!r} events extend PCR {EVENT_PCR[kind]}")
        digest = fields.get(item, "digest", "hex64", at)
        detail = fields.get(item, "detail", "string", at, nonempty=False, max_len=1024)
        events.append(Event(pcr, kind, digest, detail))
    return events


def replay(events: Collection[Event]) -> dict[int, str]:
    """PCR values (hex) after reset and the events' extends in order, for each PCR that
    appears in ``events`` (TPM 2.0 Part 1 §17)."""
    out: dict[int, str] = {}
    for pcr in sorted({e.pcr for e in events}):
        out[pcr] = pcr_after([e.digest for e in events if e.pcr == pcr])
    return out


@dataclass(frozen=True)
class AttestationPolicy:
    """Allowed values (see module docstring); each attribute a frozenset of strings."""

    backends: frozenset[str]
    runtime_code: frozenset[str]
    config: frozenset[str]
    release_root: frozenset[str]


def parse_policy(doc: Any, what: str = "attestation policy") -> AttestationPolicy:
    """Check a policy document.

    Raises:
        PolicyError: a field missing, unknown or of the wrong type (names the field).
    """
    fields = Fields(what, PolicyError)
    fields.object(doc, "")
    keys = ("schema", "backends", "runtime_code", "config", "release_root")
    fields.only(doc, keys)
    fields.get(doc, "schema", "choice", choices=(POLICY_SCHEMA,))
    out = {}
    for key in keys[1:]:
        items = fields.get(doc, key, "array", max_len=4096)
        for i, value in enumerate(items):
            path = fields.join(key, i)
            if key == "backends":
                fields.string(value, path, max_len=64)
            else:
                fields.hex64(value, path)
        out[key] = frozenset(items)
    return AttestationPolicy(**out)


@dataclass(frozen=True)
class Attested:
    """What a verified piece of evidence proves: backend, PCR values, the events."""

    backend: str
    pcrs: Mapping[int, str]
    events: tuple[Event, ...]

    @property
    def release_root(self) -> str:
        """The release root digest the device booted (its last ``release-root`` event)."""
        return [e.digest for e in self.events if e.type == "release-root"][-1]


def verify_evidence(evidence: Any, ak_public_key: ECC.EccKey, nonce: bytes, policy: AttestationPolicy,
                    *, purpose: str = CHALLENGE_PURPOSE, data: bytes | None = None) -> Attested:
    """Verify a device's evidence against a pinned AK, the verifier's fresh ``nonce`` and a policy.

    Args:
        evidence: the parsed evidence document.
        ak_public_key: the device's pinned AK public key.
        nonce: the challenge the verifier issued for this request (1..64 bytes).
        policy: allowed values.
        purpose, data: the quote's purpose and data; default ``"challenge"`` over ``nonce``
            (the key broker passes ``data`` = nonce || binding, see :mod:`sealfl.kbs`).

    Returns:
        :class:`Attested`.

    Raises:
        QuoteError: malformed evidence, bad signature, wrong or replayed nonce, PCR digest,
            an event log that does not replay to the quoted PCRs (checked before the policy:
            a forged event is reported as such).
        PolicyError: backend or an event digest not allowed, or a required event missing.
    """
    fields = Fields("evidence", QuoteError)
    fields.object(evidence, "")
    fields.only(evidence, ("schema", "quote", "eventlog"))
    fields.get(evidence, "schema", "choice", choices=(EVIDENCE_SCHEMA,))
    quote = fields.get(evidence, "quote", "object")
    events = parse_eventlog(fields.get(evidence, "eventlog", "object"), "evidence eventlog")
    expected = replay(events)
    if not expected:
        raise QuoteError("evidence eventlog has no events; the device did not boot measured")
    verify_quote(quote, ak_public_key, purpose, nonce if data is None else data, {},
                 allowed_backends=policy.backends)
    quoted = {int(k): v for k, v in quote["pcrs"].items()}
    unexplained = sorted(set(quoted) - set(expected))
    if unexplained:
        raise QuoteError(f"quoted PCR(s) {unexplained} have no events in the event log")
    for index in sorted(expected):  # the log must replay to what the TEE signed, before any policy is asked
        if index not in quoted:
            raise QuoteError(f"the event log has events for PCR {index}, which the quote does not cover")
        if not hmac.compare_digest(quoted[index], expected[index]):
            raise QuoteError(f"the event log does not replay to the quoted PCR {index} (replays to "
                             f"{expected[index][:16]}…, the TEE signed {quoted[index][:16]}…): an event was added, "
                             "removed or altered -- the log is forged or incomplete")
    kinds = [e.type for e in events]
    for need in ("runtime-code", "config", "release-root"):
        if need not in kinds:
            raise PolicyError(f"evidence eventlog has no {need!r} event; the device did not boot measured")
    boot_code = [e.digest for e in events if e.type == "runtime-code"]
    for i, e in enumerate(events):
        allowed = getattr(policy, _POLICY_KEY[e.type])
        if e.digest not in allowed:
            raise PolicyError(f"event {i} ({e.type}, PCR {e.pcr}) digest {e.digest[:16]}… is not allowed by "
                              f"policy field '{_POLICY_KEY[e.type]}'" + (
                                  ": a runtime file changed after boot" if e.type == "runtime-recheck" else ""))
        if e.type == "runtime-recheck" and e.digest not in boot_code:
            raise PolicyError(f"event {i}: the runtime measured at attestation differs from the one measured at "
                              "boot: a runtime file changed after boot")
    return Attested(quote["backend"], quoted, tuple(events))
