"""``sealfl attest`` (a verifier writes a policy and checks a device's evidence) and
``sealfl kbs`` (the key broker). I/O around the pure checks of
:mod:`sealfl.attestation.eventlog` and :mod:`sealfl.enclave.keybroker.broker`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sealfl.common.errors import SealflError
from sealfl.platform.cli.device import parse_nonce
from sealfl.platform.cli.options import TrustDir
from sealfl.platform.cli.output import command_group, console, err, error_text, fail

__all__ = ["app", "kbs_app"]

app = command_group("attest")
kbs_app = command_group("kbs")

_MAX_DOC = 4 * 1024 * 1024


def _read_json(path: Path, what: str):
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


@app.command("policy")
def policy(
    trust: TrustDir,
    release: Optional[list[Path]] = typer.Option(None, "--release", "-r", help="An approved release directory "
                                                 "(repeat; none: 'sealfl repo publish --encrypt-at-rest "
                                                 "--kbs-policy' adds each release it publishes)."),
    tee: list[str] = typer.Option(["tpm"], "--tee", help="Allowed TEE backend (repeat)."),
    out: Path = typer.Option(..., "--out", "-o", help="Policy file to write."),
) -> None:
    """Write an attestation policy allowing this sealfl runtime, this configuration and
    these releases (their signed root digests, checked against the trust anchors)."""
    from sealfl.attestation.canonical import canonical_json
    from sealfl.attestation.eventlog import POLICY_SCHEMA
    from sealfl.attestation.reader import load_release
    from sealfl.attestation.trust import load_trust_anchors
    from sealfl.common.fsutil import atomic_write
    from sealfl.enclave.device.evidence import measure_config
    from sealfl.enclave.measurement import measure_device_runtime

    try:
        anchors = load_trust_anchors(trust)
        roots = sorted({load_release(r, anchors).root_digest for r in release or ()})
        doc = {"schema": POLICY_SCHEMA, "backends": sorted(set(tee)),
               "runtime_code": [measure_device_runtime().hex()], "config": [measure_config(trust).hex()],
               "release_root": roots}
        atomic_write(out, canonical_json(doc) + b"\n", 0o644)
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    console.print(f"wrote {out}: {len(roots)} release(s), backends {sorted(set(tee))}")


@app.command("verify")
def verify(
    evidence: Path = typer.Option(..., "--evidence", "-e", help="Evidence JSON from 'sealfl device attest'."),
    ak: Path = typer.Option(..., "--ak", help="The device's pinned AK public key (PEM)."),
    nonce: str = typer.Option(..., "--nonce", help="The challenge you issued for this request, hex."),
    policy: Path = typer.Option(..., "--policy", "-p", help="Attestation policy JSON (sealfl attest policy)."),
) -> None:
    """Check AK signature, nonce, PCR digest, event-log replay and the policy. Exit 0 if
    the device is in an approved state, 1 with the failed check otherwise."""
    from sealfl.attestation.eventlog import parse_policy, verify_evidence
    from sealfl.attestation.keys import load_public_key

    n = parse_nonce(nonce)
    try:
        key = load_public_key(ak.read_bytes())
        pol = parse_policy(_read_json(policy, "policy"), str(policy))
        result = verify_evidence(_read_json(evidence, "evidence"), key, n, pol)
    except (SealflError, OSError) as exc:
        fail(f"attestation refused: {exc}")
    console.print(json.dumps({"verified": True, "backend": result.backend, "release_root": result.release_root,
                              "pcrs": {str(k): v for k, v in sorted(result.pcrs.items())}}))


@kbs_app.command("serve")
def kbs_serve(
    policy: Path = typer.Option(..., "--policy", "-p", help="Attestation policy JSON (sealfl attest policy)."),
    ak: list[Path] = typer.Option(..., "--ak", help="A registered device's AK public key PEM (repeat)."),
    keys: Path = typer.Option(..., "--keys", help="Keys file {root digest hex: base64 key}, mode 0600."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback unless devices reach it over "
                             "a network: then give --tls-cert/--tls-key too)."),
    port: int = typer.Option(8443, "--port", min=1, max=65535, help="TCP port."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="Serve HTTPS with this certificate chain "
                                            "(PEM); devices trust its CA through SSL_CERT_FILE."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="The certificate's private key (PEM, 0600)."),
    nonce_ttl: float = typer.Option(60.0, "--nonce-ttl", min=1.0, max=3600.0, help="Challenge lifetime, s."),
    per_client: int = typer.Option(16, "--max-challenges-per-client", min=1, max=1024,
                                   help="Unused challenges one client may hold (beyond: 429 with Retry-After)."),
    total: int = typer.Option(10_000, "--max-challenges", min=1, max=1_000_000,
                              help="Unused challenges in all (beyond: 429; issued ones are never evicted)."),
    rate: float = typer.Option(2.0, "--challenge-rate", min=0.01, max=1000.0,
                               help="Challenges per second per client (burst of --challenge-burst)."),
    burst: int = typer.Option(8, "--challenge-burst", min=1, max=1000, help="Challenges a client may ask at once."),
    forwarded_allow_ips: Optional[str] = typer.Option(
        None, "--forwarded-allow-ips", help="Reverse proxies (comma-separated addresses) whose X-Forwarded-For "
        "names the client; default: none, each connection's own address is the client."),
) -> None:
    """Serve POST /challenge and POST /key (protocol: sealfl.enclave.keybroker.broker), on
    127.0.0.1 unless --host says otherwise; HTTPS with --tls-cert/--tls-key (required for
    any address but loopback). Challenges are bounded per client and in total and
    rate-limited per client (429 with Retry-After), so a flood cannot crowd out a genuine
    device."""
    import ipaddress

    import uvicorn

    from sealfl.enclave.keybroker.broker import ChallengeLimits
    from sealfl.enclave.keybroker.server import ConfigWatcher, create_app, load_broker

    try:
        limits = ChallengeLimits(ttl_s=nonce_ttl, per_client=per_client, total=total, rate_per_s=rate, burst=burst)
        broker = load_broker(policy, ak, keys, nonce_ttl_s=nonce_ttl, limits=limits)
    except SealflError as exc:
        fail(str(exc))
    if (tls_cert is None) != (tls_key is None):
        fail("give both --tls-cert and --tls-key, or neither")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        fail(f"--host must be an IP address or localhost, got {host[:60]!r}")
    if not loopback and tls_cert is None:
        fail(f"--host {host} serves beyond this machine: give --tls-cert and --tls-key (model keys never travel "
             "in clear text over a network)")
    for what, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if path is not None and not path.is_file():
            fail(f"{what} {path}: no such file")
    scheme = "https" if tls_cert is not None else "http"
    err.print(f"key broker on {scheme}://{host}:{port} ({len(ak)} AK file(s))")
    tls = {"ssl_certfile": str(tls_cert), "ssl_keyfile": str(tls_key)} if tls_cert is not None else {}
    uvicorn.run(create_app(broker, ConfigWatcher(broker, policy, keys)), host=host, port=port, log_level="warning",
                proxy_headers=forwarded_allow_ips is not None, forwarded_allow_ips=forwarded_allow_ips or "", **tls)
