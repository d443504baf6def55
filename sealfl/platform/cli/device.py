"""``sealfl device`` and ``sealfl verify``: what a device runs.

Part of the device runtime's measurement (:data:`sealfl.enclave.measurement.DEVICE_RUNTIME_ROOTS`):
editing this module changes every device's PCR 16. Each command parses its options and
calls one function of :mod:`sealfl.enclave.device`; the decisions (what boots, what is
refused, exit codes) live there -- :mod:`sealfl.enclave.device.policy` for the one "boot,
else keep the last good release" policy and its exit codes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from sealfl.common.errors import Interrupted, SealflError
from sealfl.platform.cli.options import BootRelease, KeyBroker, StateDir, Tee, TrustDir, Variant, check_tee
from sealfl.platform.cli.output import command_group, console, emit_json, err, error_text, fail, json_mode, say, stopped

__all__ = ["app", "verify_app"]

app = command_group("device")
verify_app = typer.Typer(name="verify", add_completion=False)

_MAX_NONCE_BYTES = 64


def _boot(trust: Path, release_dir: Path, state: Path, *, tee: str | None = None, key_broker: str | None = None,
          variant: str | None = None, require_llm: bool = False):
    """:func:`~sealfl.enclave.device.policy.boot_or_last_good`, its refusals on stderr, its
    failures as exit codes (:func:`~sealfl.enclave.device.policy.exit_code_of`: 2 nothing
    runs, 4 TEE state)."""
    from sealfl.enclave.device.kbs_client import broker_key_source
    from sealfl.enclave.device.policy import NothingRuns, boot_or_last_good, exit_code_of
    from sealfl.enclave.errors import BootError

    keys = broker_key_source(key_broker) if key_broker else None
    try:
        outcome = boot_or_last_good(trust, release_dir, state, backend=check_tee(tee), key_source=keys,
                                    variant=variant, require_llm=require_llm,
                                    on_refused=lambda exc: say(f"refused: {exc}"))
    except NothingRuns as exc:
        fail(f"nothing runs: {exc}", exit_code_of(exc))
    except BootError as exc:
        fail(f"nothing runs: {exc}" if exit_code_of(exc) == 2 else str(exc), exit_code_of(exc))
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    if outcome.kept_last_good:
        say(f"kept the last good release v{outcome.device.release.version}")
    return outcome


@app.command("boot")
def boot(
    trust: TrustDir,
    state: StateDir,
    release_dir: BootRelease = None,
    features_csv: Optional[Path] = typer.Option(
        None, "--input", help="CSV of raw feature rows to score (heart model: 13 columns age, sex(1=male), trestbps, "
        "chol, fbs, thalch, exang, oldpeak, cp=atypical angina, cp=non-anginal, cp=typical angina, "
        "restecg=normal, restecg=st-t abnormality; an optional header row). Prints one probability per row. "
        "Read before anything boots (a malformed file: exit 1); rows that do not fit the release: exit 5."),
    tee: Tee = None,
    key_broker: KeyBroker = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout: ok, exit_code, the "
                                 "running release, kept_last_good, refused (why) and the scores (or the error)."),
) -> None:
    """Measure, verify and boot a release into the sandboxed runtime. If it is refused, boot
    the last good release instead and exit 3 (0 = the new release runs; 1/2 = nothing runs;
    4 = the TEE state is missing or of another key: provision / re-provision on purpose;
    5 = the release runs but the --input rows do not fit it). Optionally score a CSV of
    feature rows."""
    from sealfl.enclave.device.input_file import read_feature_rows
    from sealfl.enclave.device.policy import EXIT_INPUT_REFUSED

    json_mode(as_json)
    rows = probs = None
    if features_csv:
        try:
            rows = read_feature_rows(features_csv, None)
        except SealflError as exc:
            fail(str(exc))
    outcome = _boot(trust, release_dir, state, tee=tee, key_broker=key_broker)
    with outcome.device as dev:
        (err if as_json else console).print(f"booted {dev.release.name} v{dev.release.version} "
                                            f"({dev.release.root_digest})")
        if rows is not None:
            width = len(dev.input_spec.features) if dev.input_spec is not None else rows.shape[1]
            try:
                if rows.shape[1] != width:
                    raise SealflError(f"the rows have {rows.shape[1]} columns, release {dev.release.name} takes "
                                      f"{width}")
                probs = dev.predict(rows).reshape(-1)
            except SealflError as exc:
                fail(f"{features_csv}: {exc} (the release runs; nothing was scored)", EXIT_INPUT_REFUSED)
            if not as_json:
                sys.stdout.write("".join(f"{float(p):.4f}\n" for p in probs))
        if as_json:
            r = dev.release
            emit_json({"ok": True, "exit_code": outcome.exit_code,
                       "release": {"name": r.name, "version": r.version, "root_digest": r.root_digest,
                                   "statement_digest": r.statement_digest},
                       "tee": {"backend": dev.tee.backend, "insecure": bool(dev.tee.insecure)},
                       "kept_last_good": outcome.kept_last_good,
                       "refused": str(outcome.refused) if outcome.refused is not None else None,
                       "scores": [float(p) for p in probs] if probs is not None else None})
    raise typer.Exit(outcome.exit_code)


@app.command("generate")
def generate(
    trust: TrustDir,
    state: StateDir,
    release_dir: BootRelease = None,
    prompt: str = typer.Option(..., "--prompt", "-p", help="The user's message (or raw text with --raw)."),
    raw: bool = typer.Option(False, help="Continue PROMPT as plain text instead of applying the chat template."),
    max_tokens: int = typer.Option(128, min=1, max=4096, help="New tokens at most."),
    temperature: float = typer.Option(0.0, min=0.0, max=5.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, min=1e-6, max=1.0, help="Nucleus sampling mass."),
    seed: int = typer.Option(0, min=0, help="Sampler seed (same seed, same answer)."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeat, at most 8)."),
    variant: Variant = None,
    tee: Tee = None,
    key_broker: KeyBroker = None,
) -> None:
    """Verify and boot a causal-LM release, then answer PROMPT, streaming the text to
    stdout (token counts and timing on stderr). A refused release falls back to the last
    good one (exit 3), as 'device boot' does."""
    from sealfl.enclave.sandbox.decode import SamplingParams

    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
                                stop=tuple(stop or ()))
    except ValueError as exc:
        fail(str(exc))
    outcome = _boot(trust, release_dir, state, tee=tee, key_broker=key_broker, variant=variant, require_llm=True)
    with outcome.device as dev:

        def out(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        try:
            if raw:
                res = dev.generate(prompt, params, on_text=out)
            else:
                res = dev.chat([{"role": "user", "content": prompt}], params, on_text=out)
        except (ValueError, SealflError) as exc:
            fail(str(exc))
        sys.stdout.write("\n")
        err.print(f"{dev.release.name} v{dev.release.version} ({dev.llm_spec.variant}): {res.prompt_tokens} prompt "
                  f"tokens, {res.completion_tokens} generated, finish {res.finish_reason}; first token "
                  f"{res.seconds_to_first_token * 1000:.0f} ms, {res.seconds:.2f} s total")
    raise typer.Exit(outcome.exit_code)


def _access_log_to(where: str) -> None:
    """Give ``device serve``'s access logger its handler (``--access-log``)."""
    import logging

    from sealfl.enclave.device.serve.access_log import ACCESS_LOGGER

    logger = logging.getLogger(ACCESS_LOGGER)
    logger.propagate = False
    if where == "off":
        logger.setLevel(logging.CRITICAL + 1)
        return
    try:
        handler = logging.StreamHandler(sys.stderr) if where == "-" else logging.FileHandler(where, encoding="utf-8")
    except OSError as exc:
        fail(f"--access-log {where}: cannot open it ({exc.strerror or exc}); give a writable file, '-' or 'off'")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


@app.command("serve")
def serve(
    trust: TrustDir,
    state: StateDir,
    release_dir: BootRelease = None,
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback unless you mean otherwise)."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port (0: a free one, see --port-file)."),
    port_file: Optional[Path] = typer.Option(None, help="Write the bound port here once listening."),
    max_concurrent: int = typer.Option(1, min=1, max=16, help="Requests generating at once; one sandboxed "
                                       "child per slot; beyond them (and a full --queue): 429 with Retry-After."),
    queue: int = typer.Option(0, "--queue", min=0, max=1024, help="Requests that may wait for a slot (in arrival "
                              "order; 0: none wait, a request without a free slot gets 429 at once)."),
    queue_timeout: float = typer.Option(30.0, "--queue-timeout", min=0.1, max=3600.0, help="Longest wait in the "
                                        "queue, seconds; then 429 with Retry-After."),
    default_max_tokens: int = typer.Option(256, "--default-max-tokens", min=1, max=4096, help="New tokens a chat "
                                           "request without max_tokens gets at most (a request may ask for more, "
                                           "up to the context; completions default to 16 as in OpenAI's API)."),
    max_body_bytes: int = typer.Option(1 << 20, min=1024, max=64 << 20, help="Largest request body (400 "
                                       "beyond)."),
    threads: Optional[int] = typer.Option(None, min=1, max=64, help="onnxruntime threads per slot "
                                          "(default: the cores really free when it starts, split over the slots; also SEALFL_LLM_THREADS)."),
    access_log: str = typer.Option("-", "--access-log", help="Where the access log goes, one line per request "
                                   "(method, path, status, tokens, time to first token, total time; never the "
                                   "prompt): '-' = stderr, 'off', or a file to append to."),
    variant: Variant = None,
    tee: Tee = None,
    key_broker: KeyBroker = None,
    repo: Optional[str] = typer.Option(None, "--repo", help="TUF repository URL to poll for newer releases "
                                       "(as 'device update'); a newer verified release is switched to while "
                                       "serving."),
    poll: float = typer.Option(300.0, "--poll", min=0.2, max=86400.0, help="Seconds between update checks of "
                               "--repo."),
) -> None:
    """Verify and boot a release as 'device boot' does, then serve it: a causal LM over an
    OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models), a tabular
    model over the Open Inference Protocol (KServe v2: /v2/health/ready,
    /v2/models/NAME, POST /v2/models/NAME/infer), both with /health and /metrics. Runs
    until SIGINT/SIGTERM (exit 130/143). A refused release falls back to the last good
    one; with none, exit 2 (/health never answered 200); exit 4 when the TEE state needs
    (re-)provisioning. With --repo (causal-LM releases), the TUF repository is checked
    every --poll seconds as 'device update' does, and a newer verified release is switched
    to while serving (requests in flight finish on the old model)."""
    import dataclasses

    from sealfl.enclave.device.kbs_client import broker_key_source
    from sealfl.enclave.device.policy import exit_code_of
    from sealfl.enclave.device.serve.openai_api import DEFAULT_LIMITS
    from sealfl.enclave.device.serve.server import ServeOptions, run_server
    from sealfl.enclave.errors import BootError

    opts = ServeOptions(host=host, port=port, max_concurrent=max_concurrent, variant=variant,
                        port_file=port_file, threads=threads, backend=check_tee(tee),
                        queue_size=queue, queue_timeout_s=queue_timeout,
                        limits=dataclasses.replace(DEFAULT_LIMITS, max_body_bytes=max_body_bytes,
                                                   default_max_tokens=default_max_tokens),
                        key_source=broker_key_source(key_broker) if key_broker else None, repo=repo, poll_s=poll)
    _access_log_to(access_log)
    try:
        run_server(trust, release_dir, state, opts, say=say)
    except Interrupted as exc:
        stopped(exc)
    except BootError as exc:
        code = exit_code_of(exc)
        fail(f"nothing is served: {exc}", 2 if code == 1 else code)
    except (SealflError, OSError) as exc:
        fail(error_text(exc))


@app.command("provision")
def provision(
    state: StateDir,
    tee: str = typer.Option("tpm", "--tee", help="TEE backend: 'tpm' (TPM 2.0; SEALFL_TPM_TCTI selects it, "
                            "default device:/dev/tpmrm0) or 'sim' (an INSECURE simulation for tests and demos)."),
    force: bool = typer.Option(False, "--force", help="Re-provision a used device on purpose (new AK; the "
                               "rollback floor is kept), also replacing the AK another device state left in "
                               "this TPM (that state then stops booting)."),
    export_ak: Optional[Path] = typer.Option(None, "--export-ak", help="Also write the AK public key here."),
) -> None:
    """Create the device's attestation key (AK) under the TEE's endorsement hierarchy and
    its rollback floor; print the AK keyid for the verifier. Refuses a used state directory,
    a TPM that holds another state's AK (both without --force), a TPM that serves a release
    enclave, and a TPM without a SHA-256 PCR bank; a refused or failed provisioning leaves
    nothing behind."""
    from sealfl.enclave.device.provision import provision as provision_tee

    check_tee(tee)
    try:
        t = provision_tee(state, tee, force=force)
        if export_ak:
            export_ak.write_bytes(t.public_key())
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    console.print(f"provisioned a {tee} TEE in {state / 'tee'}; AK keyid {t.ak_keyid()}"
                  + (f"; AK public key -> {export_ak}" if export_ak else f"; AK public key {state / 'tee' / 'ak.pem'}"))
    if t.insecure:
        say("warning: the sim TEE is an INSECURE simulation (keys in plain files): for tests and demos only")


@app.command("doctor")
def doctor(
    state: Optional[Path] = typer.Option(None, "--state", "-s", help="Device state directory (its TEE, free "
                                         "disk)."),
    require_tpm: bool = typer.Option(False, "--require-tpm", help="Exit 1 unless a TPM with a SHA-256 bank "
                                     "answers."),
    as_json: bool = typer.Option(False, "--json", help="Print the profile as one JSON object."),
) -> None:
    """Print the hardware baseline releases depend on: CPU integer-kernel features, memory,
    free disk, the TEE the device runs on (with --state), TPM presence, PCR banks and which
    sealfl roles hold keys in it, onnxruntime execution providers."""
    import json

    from sealfl.enclave.device.doctor import format_profile, profile

    p = profile(state)
    if as_json:
        sys.stdout.write(json.dumps(p, indent=1, sort_keys=True) + "\n")
    else:
        for line in format_profile(p):
            console.print(line, markup=False, highlight=False)
    if require_tpm and not p.get("tpm_sha256_bank"):
        fail("no TPM with a SHA-256 PCR bank answered; set SEALFL_TPM_TCTI or install a TPM")


def parse_nonce(value: str) -> bytes:
    """``--nonce`` hex -> 1..64 bytes; a bad value ends the command with a one-line error."""
    try:
        nonce = bytes.fromhex(value)
    except ValueError:
        fail(f"--nonce must be hex, got {value[:80]!r}")
    if not 1 <= len(nonce) <= _MAX_NONCE_BYTES:
        fail(f"--nonce must be 1..{_MAX_NONCE_BYTES} bytes (2..{2 * _MAX_NONCE_BYTES} hex digits), "
             f"got {len(nonce)} bytes")
    return nonce


@app.command("attest")
def attest(
    state: Path = typer.Option(..., "--state", "-s", help="Device state directory (booted)."),
    nonce: str = typer.Option(..., "--nonce", help="The verifier's challenge, hex (1..64 bytes)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the evidence here (default: stdout)."),
) -> None:
    """Quote the device's PCRs for the verifier's nonce; print the evidence (quote, PCR
    values, event log) as JSON."""
    from sealfl.attestation.canonical import canonical_json
    from sealfl.enclave.device.evidence import attest_device

    try:
        doc = canonical_json(attest_device(state, parse_nonce(nonce))) + b"\n"
        if out:
            out.write_bytes(doc)
        else:
            sys.stdout.write(doc.decode())
    except (SealflError, OSError) as exc:
        fail(error_text(exc))


@verify_app.command("verify")
def verify(
    trust: TrustDir,
    release_dir: Annotated[Path, typer.Argument(help="Release directory to check.")],
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout (ok, name, version, "
                                 "root_digest; or ok false and the error)."),
) -> None:
    """Check a release (signature, attestation, manifest, every file hash) without loading it.
    Exit 0 if it verifies; otherwise exit 1 and name the failing file and check."""
    from sealfl.enclave.device.verify import verify_dir

    json_mode(as_json)
    try:
        v = verify_dir(trust, release_dir)
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    if as_json:
        emit_json({"ok": True, "name": v.name, "version": v.version, "root_digest": v.root_digest})
        return
    console.print(f"[green]OK[/] {v.name} v{v.version} root digest {v.root_digest}")


# 'device update', 'device status' and 'device tuf-client' live in their own module.
from sealfl.platform.cli.device_update import status, tuf_client_app, update  # noqa: E402

app.command("update")(update)
app.command("status")(status)
app.add_typer(tuf_client_app)
