"""CLI commands of device trust: ``sealfl device provision``, ``sealfl device attest``,
``sealfl attest policy`` and ``sealfl attest verify`` (registered on the main app by
:mod:`sealfl.platform.cli`). I/O around the pure checks of :mod:`sealfl.attestation.eventlog`.

Exit codes: 0 success; 1 refused or failed (the message names the check); ``device boot``
exits 4 (:data:`sealfl.enclave.provision.EXIT_TEE_STATE`) when the TEE state is missing or
belongs to another key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

__all__ = ["register"]

_MAX_DOC = 4 * 1024 * 1024


def _nonce(value: str, fail) -> bytes:
    try:
        nonce = bytes.fromhex(value)
    except ValueError:
        fail(f"--nonce must be hex, got {value[:80]!r}")
    if not 1 <= len(nonce) <= 64:
        fail(f"--nonce must be 1..64 bytes (2..128 hex digits), got {len(nonce)} bytes")
    return nonce


def _read_json(path: Path, what: str, fail):
    from sealfl.attestation.canonical import JSONFormatError, loads_strict

    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_DOC + 1)
    except OSError as exc:
        fail(f"cannot read the {what} {path}: {exc.strerror or exc}")
    if len(data) > _MAX_DOC:
        fail(f"the {what} {path} is larger than {_MAX_DOC} bytes")
    try:
        return loads_strict(data)
    except JSONFormatError as exc:
        fail(f"the {what} {path} is not strict JSON: {exc}")


def register(app: typer.Typer, device_app: typer.Typer, console, err, fail) -> None:
    """Add the commands to ``app`` / ``device_app``."""
    attest_app = typer.Typer(help="Verifier: check a device's attestation evidence.", no_args_is_help=True)
    app.add_typer(attest_app, name="attest")
    kbs_app = typer.Typer(help="Key broker: release model keys to attested devices.", no_args_is_help=True)
    app.add_typer(kbs_app, name="kbs")

    @kbs_app.command("serve")
    def kbs_serve(
        policy: Path = typer.Option(..., "--policy", "-p", help="Attestation policy JSON (sealfl attest policy)."),
        ak: list[Path] = typer.Option(..., "--ak", help="A registered device's AK public key PEM (repeat)."),
        keys: Path = typer.Option(..., "--keys", help="Keys file {root digest hex: base64 key}, mode 0600."),
        port: int = typer.Option(8443, "--port", min=1, max=65535, help="Port on 127.0.0.1."),
        nonce_ttl: float = typer.Option(60.0, "--nonce-ttl", min=1.0, max=3600.0, help="Challenge lifetime, s."),
    ) -> None:
        """Serve POST /challenge and POST /key on 127.0.0.1 (protocol: sealfl.kbs.broker)."""
        import uvicorn

        from sealfl.common.errors import SealflError
        from sealfl.kbs.server import create_app, load_broker

        try:
            broker = load_broker(policy, ak, keys, nonce_ttl_s=nonce_ttl)
        except SealflError as exc:
            fail(str(exc))
        err.print(f"key broker on http://127.0.0.1:{port} ({len(ak)} AK file(s))")
        uvicorn.run(create_app(broker), host="127.0.0.1", port=port, log_level="warning")

    @device_app.command("provision")
    def device_provision(
        state: Path = typer.Option(..., "--state", "-s", help="Device state directory."),
        tee: str = typer.Option("sim", "--tee", help="TEE backend: 'tpm' (TPM 2.0; SEALFL_TPM_TCTI selects it, "
                                "default device:/dev/tpmrm0) or 'sim' (INSECURE simulation)."),
        force: bool = typer.Option(False, "--force", help="Re-provision a used device on purpose (new AK; the "
                                   "rollback floor is kept)."),
        export_ak: Optional[Path] = typer.Option(None, "--export-ak", help="Also write the AK public key here."),
    ) -> None:
        """Create the device's attestation key (AK) under the TEE's endorsement hierarchy and
        its rollback floor; print the AK keyid for the verifier."""
        from sealfl.common.errors import SealflError
        from sealfl.enclave.provision import provision

        try:
            t = provision(state, tee, force=force)
            if export_ak:
                export_ak.write_bytes(t.public_key())
        except (SealflError, OSError) as exc:
            fail(str(exc))
        console.print(f"provisioned a {tee} TEE in {state / 'tee'}; AK keyid {t.ak_keyid()}"
                      + (f"; AK public key -> {export_ak}" if export_ak else f"; AK public key {state / 'tee' / 'ak.pem'}"))

    @device_app.command("doctor")
    def device_doctor(
        state: Optional[Path] = typer.Option(None, "--state", "-s", help="Device state directory (for free disk)."),
        require_tpm: bool = typer.Option(False, "--require-tpm", help="Exit 1 unless a TPM with a SHA-256 bank "
                                         "answers."),
    ) -> None:
        """Print the hardware baseline releases depend on: CPU integer-kernel features, memory,
        free disk, TPM presence and PCR banks, onnxruntime execution providers."""
        from sealfl.enclave.doctor import format_profile, profile

        p = profile(state)
        for line in format_profile(p):
            console.print(line)
        if require_tpm and not p.get("tpm_sha256_bank"):
            fail("no TPM with a SHA-256 PCR bank answered; set SEALFL_TPM_TCTI or install a TPM")

    @device_app.command("attest")
    def device_attest(
        state: Path = typer.Option(..., "--state", "-s", help="Device state directory (booted)."),
        nonce: str = typer.Option(..., "--nonce", help="The verifier's challenge, hex (1..64 bytes)."),
        out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the evidence here (default: stdout)."),
    ) -> None:
        """Quote the device's PCRs for the verifier's nonce; print the evidence (quote, PCR
        values, event log) as JSON."""
        from sealfl.attestation.canonical import canonical_json
        from sealfl.common.errors import SealflError
        from sealfl.enclave.measured import attest_device

        try:
            doc = canonical_json(attest_device(state, _nonce(nonce, fail))) + b"\n"
            if out:
                out.write_bytes(doc)
            else:
                sys.stdout.write(doc.decode())
        except (SealflError, OSError) as exc:
            fail(str(exc))

    @attest_app.command("policy")
    def attest_policy(
        trust: Path = typer.Option(..., "--trust", "-t", help="The devices' pinned trust directory."),
        release: list[Path] = typer.Option(..., "--release", "-r", help="An approved release directory (repeat)."),
        tee: list[str] = typer.Option(["tpm"], "--tee", help="Allowed TEE backend (repeat)."),
        out: Path = typer.Option(..., "--out", "-o", help="Policy file to write."),
    ) -> None:
        """Write an attestation policy allowing this sealfl runtime, this configuration and
        these releases (their signed root digests, checked against the trust anchors)."""
        from sealfl.attestation.canonical import canonical_json
        from sealfl.attestation.eventlog import POLICY_SCHEMA
        from sealfl.attestation.reader import load_release
        from sealfl.attestation.trust import load_trust_anchors
        from sealfl.common.errors import SealflError
        from sealfl.enclave.measure import measure_device_runtime
        from sealfl.enclave.measured import measure_config

        try:
            anchors = load_trust_anchors(trust)
            roots = sorted({load_release(r, anchors).root_digest for r in release})
            doc = {"schema": POLICY_SCHEMA, "backends": sorted(set(tee)),
                   "runtime_code": [measure_device_runtime().hex()], "config": [measure_config(trust).hex()],
                   "release_root": roots}
            out.write_bytes(canonical_json(doc) + b"\n")
        except (SealflError, OSError) as exc:
            fail(str(exc))
        console.print(f"wrote {out}: {len(roots)} release(s), backends {sorted(set(tee))}")

    @attest_app.command("verify")
    def attest_verify(
        evidence: Path = typer.Option(..., "--evidence", "-e", help="Evidence JSON from 'sealfl device attest'."),
        ak: Path = typer.Option(..., "--ak", help="The device's pinned AK public key (PEM)."),
        nonce: str = typer.Option(..., "--nonce", help="The challenge you issued for this request, hex."),
        policy: Path = typer.Option(..., "--policy", "-p", help="Attestation policy JSON (sealfl attest policy)."),
    ) -> None:
        """Check AK signature, nonce, PCR digest, event-log replay and the policy. Exit 0 if
        the device is in an approved state, 1 with the failed check otherwise."""
        from sealfl.attestation.eventlog import parse_policy, verify_evidence
        from sealfl.attestation.keys import load_public_key
        from sealfl.common.errors import SealflError

        n = _nonce(nonce, fail)
        try:
            key = load_public_key(ak.read_bytes())
            pol = parse_policy(_read_json(policy, "policy", fail), str(policy))
            result = verify_evidence(_read_json(evidence, "evidence", fail), key, n, pol)
        except (SealflError, OSError) as exc:
            fail(f"attestation refused: {exc}")
        console.print(json.dumps({"verified": True, "backend": result.backend, "release_root": result.release_root,
                                  "pcrs": {str(k): v for k, v in sorted(result.pcrs.items())}}))
