"""The chain of evidence from a campaign's encrypted rounds to a device's quote. Pure; no I/O.

A third party holding only public material -- the trust directory, the campaign's public
round log (``rounds.jsonl``), the release directory and a device's attestation evidence
(with the device's AK public key and the nonce it answered) -- checks five links
(:func:`audit_chain`), each reported as pass or the reason:

1. ``rounds``               every round of the public log (its ``aggregate_sha256`` and
                            ``accepted`` partners) is the one the signed provenance lists, and
                            the provenance lists no other round;
2. ``decrypted-aggregate``  the aggregate the release enclave decrypted (provenance
                            ``decrypted_aggregate``) is the log's last round's aggregate;
3. ``provenance``           ``provenance.dsse.json`` is signed by a pinned release key, bound to
                            the release's name and root digest, and names the release enclave
                            measurement the trust directory pins;
4. ``release``              the release verifies as a device verifies it
                            (:func:`sealfl.attestation.verify.verify_release`: manifest
                            signature, ``model.sig``, the enclave's attestation, every hash);
5. ``device``               the device's evidence verifies (:func:`~sealfl.attestation.eventlog.verify_evidence`:
                            its AK, the nonce, the event log replayed to the quoted PCRs, the
                            allowed runtime and configuration) and its quoted ``release-root``
                            is this release's root digest.

Links 1-3 need the provenance (links 1-2 fail as "not checked" when it is missing or
bad); link 3 needs the release's root digest as signed (from link 4's manifest). A link that
fails never stops the others: the report names every broken link.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from Crypto.PublicKey import ECC

from sealfl.attestation.canonical import JSONFormatError, loads_strict
from sealfl.attestation.errors import AttestationError, AuditError
from sealfl.attestation.eventlog import POLICY_SCHEMA, parse_policy, verify_evidence
from sealfl.attestation.manifest import MANIFEST_FILE, parse_manifest
from sealfl.attestation.provenance import PROVENANCE_FILE, Provenance, verify_provenance
from sealfl.attestation.trust import TrustAnchors
from sealfl.attestation.verify import verify_release
from sealfl.common.fields import Fields

__all__ = ["LINKS", "Link", "DeviceEvidence", "parse_round_log", "audit_chain"]

#: the links, in chain order
LINKS = ("rounds", "decrypted-aggregate", "provenance", "release", "device")
#: most rounds a public log may hold (a campaign runs at most 100,000)
MAX_ROUNDS = 100_000


@dataclass(frozen=True)
class Link:
    """One link's outcome: ``name`` (:data:`LINKS`), ``ok``, ``detail`` (what holds, or why not),
    ``skipped`` (not checked because the auditor said so: only the device link, with
    ``device_required=False``; a skipped link is never ``ok``)."""

    name: str
    ok: bool
    detail: str
    skipped: bool = False

    def to_dict(self) -> dict:
        return {"link": self.name, "ok": self.ok, "skipped": self.skipped, "detail": self.detail}


@dataclass(frozen=True)
class DeviceEvidence:
    """What the auditor holds of one device.

    Attributes:
        evidence: the parsed evidence document (``sealfl device attest`` output).
        ak_public_key: the device's AK public key (``device provision --export-ak``).
        nonce: the challenge the device answered (1..64 bytes).
        backends: TEE backends accepted (``{"tpm"}``; ``"sim"`` only when asked for).
        runtime_code: allowed device runtime measurements (hex).
        config: allowed device configuration digests (hex; the trust directory's).
    """

    evidence: object
    ak_public_key: ECC.EccKey
    nonce: bytes
    backends: frozenset[str]
    runtime_code: frozenset[str]
    config: frozenset[str]


def parse_round_log(data: bytes, what: str = "rounds.jsonl") -> dict[int, dict]:
    """``{round: {"aggregate_sha256", "partners"}}`` of a public round log, one strict JSON
    object per line (empty lines skipped; a round logged twice keeps its last line, as a
    resumed campaign writes it). Pure.

    Raises:
        AuditError: a line that is not a strict JSON object, or a record without an integer
            ``round`` >= 1, a hex ``aggregate_sha256`` or a list of partner names
            ``accepted``; the message names the line.
    """
    out: dict[int, dict] = {}
    for number, line in enumerate(bytes(data).split(b"\n"), start=1):
        if not line.strip():
            continue
        fields = Fields(f"{what} line {number}", AuditError)
        try:
            rec = loads_strict(line)
        except JSONFormatError as exc:
            raise AuditError(f"{what} line {number} is not one strict JSON object: {exc}") from exc
        r = fields.get(rec, "round", "integer", lo=1)
        digest = fields.get(rec, "aggregate_sha256", "hex64")
        partners = fields.get(rec, "accepted", "array", nonempty=True, max_len=10_000)
        for i, p in enumerate(partners):
            fields.string(p, fields.join("accepted", i), max_len=256)
        out[r] = {"aggregate_sha256": digest, "partners": sorted(partners)}
        if len(out) > MAX_ROUNDS:
            raise AuditError(f"{what} holds more than {MAX_ROUNDS} rounds")
    if not out:
        raise AuditError(f"{what} records no round")
    return out


def _rounds_link(log: dict[int, dict], prov: Provenance) -> Link:
    signed = {e["round"]: {"aggregate_sha256": e["aggregate_sha256"], "partners": sorted(e["partners"])}
              for e in prov.rounds}
    problems = [f"round {r} is in the round log but not in the provenance" for r in sorted(set(log) - set(signed))]
    problems += [f"round {r} is in the provenance but not in the round log" for r in sorted(set(signed) - set(log))]
    for r in sorted(set(log) & set(signed)):
        if log[r]["aggregate_sha256"] != signed[r]["aggregate_sha256"]:
            problems.append(f"round {r}: the log's aggregate {log[r]['aggregate_sha256'][:16]}… differs from the "
                            f"provenance's {signed[r]['aggregate_sha256'][:16]}…")
        if log[r]["partners"] != signed[r]["partners"]:
            problems.append(f"round {r}: the log counts partners {log[r]['partners']}, the provenance "
                            f"{signed[r]['partners']}")
    if problems:
        return Link("rounds", False, "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)"
                                                                if len(problems) > 5 else ""))
    return Link("rounds", True, f"{len(log)} round(s) of the public log match the signed provenance "
                                f"(aggregate digests and the partners that counted)")


def _decrypted_link(log: dict[int, dict], prov: Provenance) -> Link:
    last = max(log)
    dec = prov.decrypted_aggregate
    if dec["round"] != last or not hmac.compare_digest(dec["sha256"], log[last]["aggregate_sha256"]):
        return Link("decrypted-aggregate", False,
                    f"the release enclave decrypted round {dec['round']}'s aggregate {dec['sha256'][:16]}…, but the "
                    f"log's last round {last} committed {log[last]['aggregate_sha256'][:16]}…")
    return Link("decrypted-aggregate", True, f"the enclave decrypted round {last}'s aggregate "
                                             f"{dec['sha256'][:16]}…, the log's last")


def _device_link(device: DeviceEvidence | None, root_digest: str | None, required: bool) -> Link:
    if device is None and not required:
        return Link("device", False, "not checked (--no-device): the chain is audited up to the release",
                    skipped=True)
    if device is None:
        return Link("device", False, "no device evidence given: pass --evidence, --device-ak and --nonce, "
                                     "or --no-device to audit the chain up to the release")
    if root_digest is None:
        return Link("device", False, "not checked: the release's root digest is unknown (see the release link)")
    policy = parse_policy({"schema": POLICY_SCHEMA, "backends": sorted(device.backends),
                           "runtime_code": sorted(device.runtime_code), "config": sorted(device.config),
                           "release_root": [root_digest]})
    try:
        attested = verify_evidence(device.evidence, device.ak_public_key, device.nonce, policy)
    except AttestationError as exc:
        return Link("device", False, f"the device's evidence does not hold: {exc}")
    return Link("device", True, f"the device's {attested.backend} quote (fresh nonce, replayed event log) "
                                f"covers release root {attested.release_root[:16]}…")


def audit_chain(*, trust: TrustAnchors, round_log: bytes, release_files: Mapping[str, bytes],
                device: DeviceEvidence | None, device_required: bool = True) -> list[Link]:
    """Check every link of the chain (module docstring). Pure.

    Args:
        trust: the pinned trust anchors.
        round_log: the campaign's public ``rounds.jsonl`` bytes.
        release_files: ``{name: bytes}`` of every file of the release directory.
        device: the device's evidence and what the auditor allows, or None.
        device_required: False to audit up to the release: with no ``device``, the device
            link is then ``skipped`` instead of failed.

    Returns:
        one :class:`Link` per name of :data:`LINKS`, in that order.
    """
    try:
        log: dict[int, dict] | None = parse_round_log(round_log)
        log_problem = ""
    except AuditError as exc:
        log, log_problem = None, str(exc)
    root_digest = name = None
    try:
        verified = verify_release(dict(release_files), trust)
        release = Link("release", True, f"{verified.name} v{verified.version} root {verified.root_digest[:16]}…: "
                                        f"manifest signature, model.sig, the enclave's {verified.backend} "
                                        "attestation and every file hash hold")
        root_digest, name = verified.root_digest, verified.name
    except AttestationError as exc:
        release = Link("release", False, str(exc))
        try:  # the provenance can still be held against the signed-for root digest the manifest states
            manifest = parse_manifest(release_files[MANIFEST_FILE])
            root_digest, name = manifest["root_digest"], manifest["name"]
        except (KeyError, AttestationError):
            pass
    prov: Provenance | None = None
    if PROVENANCE_FILE not in release_files:
        provenance = Link("provenance", False, f"the release holds no {PROVENANCE_FILE}")
    elif root_digest is None:
        provenance = Link("provenance", False, "not checked: the release has no readable manifest")
    else:
        try:
            prov = verify_provenance(release_files[PROVENANCE_FILE], trust.release_public_keys, name=name,
                                     root_digest=root_digest)
            pinned = {str(k): v for k, v in trust.expected_pcrs.items()}
            if prov.measurement != pinned:
                provenance = Link("provenance", False, f"it names release enclave measurement {prov.measurement}, "
                                                       f"the trust directory pins {pinned}")
                prov = None
            else:
                provenance = Link("provenance", True, f"signed by the release key, bound to root {root_digest[:16]}…, "
                                                      "from the pinned release enclave measurement")
        except AttestationError as exc:
            provenance = Link("provenance", False, str(exc))
    if log is None:
        rounds = Link("rounds", False, f"the public round log is unusable: {log_problem}")
        decrypted = Link("decrypted-aggregate", False, "not checked: the public round log is unusable")
    elif prov is None:
        rounds = Link("rounds", False, "not checked: no valid provenance to hold the round log against")
        decrypted = Link("decrypted-aggregate", False, "not checked: no valid provenance")
    else:
        rounds, decrypted = _rounds_link(log, prov), _decrypted_link(log, prov)
    return [rounds, decrypted, provenance, release, _device_link(device, root_digest, device_required)]


def all_hold(links: Collection[Link]) -> bool:
    """True iff every link holds or was skipped on the auditor's request (and there are all of
    :data:`LINKS`)."""
    return len(links) == len(LINKS) and all(link.ok or link.skipped for link in links)
