"""``sealfl audit``: a third party checks the chain from a campaign's rounds to a device's quote.

Only public material is read: the trust directory, the campaign's public round log, the
release directory and a device's attestation evidence (with its AK public key and the nonce
it answered). One line per link of :mod:`sealfl.attestation.audit` (``PASS`` or ``FAIL`` and
the reason); exit 0 only when every link holds, 1 otherwise (and on unreadable input).
``--json`` prints ``{"ok": bool, "links": [{"link", "ok", "skipped", "detail"}, ...]}``.
``--no-device`` audits up to the release (before any device runs it): the device link is
``SKIP`` and exit 0 needs every other link. ``--rounds`` takes the log or its campaign
directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from sealfl.common.errors import SealflError
from sealfl.platform.cli.device import parse_nonce
from sealfl.platform.cli.options import TrustDir
from sealfl.platform.cli.output import console, fail

__all__ = ["audit_app"]

audit_app = typer.Typer(name="audit", add_completion=False)

#: caps on what the auditor reads (bytes)
_MAX_ROUND_LOG = 64 << 20
_MAX_EVIDENCE = 4 << 20
_MAX_KEY = 64 << 10


def _read(path: Path, cap: int, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read(cap + 1)
    except OSError as exc:
        fail(f"cannot read the {what} {path}: {exc.strerror or exc}")
    if len(data) > cap:
        fail(f"the {what} {path} is larger than {cap} bytes")
    return data


def _device(trust: Path, evidence: Optional[Path], device_ak: Optional[Path], nonce: Optional[str],
            runtime: list[str], allow_sim: bool):
    from sealfl.attestation.audit import DeviceEvidence
    from sealfl.attestation.canonical import JSONFormatError, loads_strict
    from sealfl.attestation.keys import load_public_key
    from sealfl.enclave.device.evidence import measure_config
    from sealfl.enclave.measurement import measure_device_runtime

    given = [evidence is not None, device_ak is not None, nonce is not None]
    if not any(given):
        return None
    if not all(given):
        fail("the device link needs --evidence, --device-ak and --nonce together")
    try:
        doc = loads_strict(_read(evidence, _MAX_EVIDENCE, "device evidence"))
        ak = load_public_key(_read(device_ak, _MAX_KEY, "device AK public key"))
    except JSONFormatError as exc:
        fail(f"the device evidence {evidence} is not strict JSON: {exc}")
    except SealflError as exc:
        fail(f"the device AK public key {device_ak}: {exc}")
    for value in runtime:
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            fail(f"--runtime must be 64 lowercase hex digits, got {value[:80]!r}")
    allowed = set(runtime) or {measure_device_runtime().hex()}
    return DeviceEvidence(doc, ak, parse_nonce(nonce), frozenset({"tpm", "sim"} if allow_sim else {"tpm"}),
                          frozenset(allowed), frozenset({measure_config(trust).hex()}))


@audit_app.command("audit")
def audit(
    trust: TrustDir,
    rounds: Annotated[Path, typer.Option("--rounds", help="The campaign's public round log (rounds.jsonl), "
                                                          "or the campaign directory holding it.")],
    release_dir: Annotated[Path, typer.Option("--release", "-r", help="Release directory to audit.")],
    evidence: Annotated[Optional[Path], typer.Option("--evidence", help="A device's attestation evidence "
                                                                        "(sealfl device attest output).")] = None,
    device_ak: Annotated[Optional[Path], typer.Option("--device-ak", help="That device's AK public key "
                                                                          "(device provision --export-ak).")] = None,
    nonce: Annotated[Optional[str], typer.Option("--nonce", help="The nonce the evidence answers, hex.")] = None,
    runtime: Annotated[list[str], typer.Option("--runtime", help="Allowed device runtime measurement, hex "
                                                                 "(repeatable; default: this sealfl's).")] = [],
    allow_sim: Annotated[bool, typer.Option("--allow-sim", help="Accept quotes of the INSECURE sim TEE "
                                                                "(tests and demos).")] = False,
    no_device: Annotated[bool, typer.Option("--no-device", help="Audit up to the release: the device link is "
                                                                "skipped (SKIP), not failed.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the links as JSON.")] = False,
) -> None:
    """Check the chain link by link: round digests -> the aggregate the enclave decrypted ->
    provenance -> release signature and attestation -> the device's quote over the same root
    digest. One line per link; exit 0 only when every link holds."""
    from sealfl.attestation.audit import all_hold, audit_chain
    from sealfl.attestation.release import load_trust_anchors, read_release_dir
    from sealfl.server.campaign_files import ROUNDS

    if no_device and (evidence is not None or device_ak is not None or nonce is not None):
        fail("--no-device skips the device link: give it without --evidence, --device-ak and --nonce")

    try:
        anchors = load_trust_anchors(trust)
    except SealflError as exc:
        fail(str(exc))
    if rounds.is_dir():
        rounds = rounds / ROUNDS
    log = _read(rounds, _MAX_ROUND_LOG, "round log")
    try:
        files = read_release_dir(release_dir)
    except SealflError as exc:
        fail(f"cannot read the release {release_dir}: {exc}")
    device = _device(trust, evidence, device_ak, nonce, runtime, allow_sim)
    links = audit_chain(trust=anchors, round_log=log, release_files=files, device=device,
                        device_required=not no_device)
    ok = all_hold(links)
    if as_json:
        sys.stdout.write(json.dumps({"ok": ok, "links": [link.to_dict() for link in links]}) + "\n")
    else:
        for link in links:
            word = "SKIP" if link.skipped else "PASS" if link.ok else "FAIL"
            console.print(f"{word}  {link.name:20s} {link.detail}", markup=False,
                          highlight=False, soft_wrap=True)
    raise typer.Exit(0 if ok else 1)
