"""``sealfl device update``, ``device status`` and ``device tuf-client``: the device's side of
the TUF repository (fetch, verify and switch to a newer release; show what runs; the
tuf-conformance client CLI). Registered on the ``device`` group by :mod:`.device`; part of
the device runtime's measurement through it (:mod:`sealfl.enclave.measurement`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from sealfl.common.errors import SealflError
from sealfl.platform.cli.options import KeyBroker, StateDir, Tee, TrustDir, check_tee
from sealfl.platform.cli.output import console, error_text, fail, say

__all__ = ["update", "status", "tuf_client_app"]


def update(
    trust: TrustDir,
    state: StateDir,
    repo: str = typer.Option(..., "--repo", help="TUF repository URL ('sealfl repo serve' prints it)."),
    name: Optional[str] = typer.Option(None, "--name", help="Release name to follow (default: the running "
                                       "release's)."),
    timeout: float = typer.Option(10.0, "--timeout", min=0.1, max=600.0, help="Connect and between-bytes timeout, "
                                  "seconds."),
    deadline: float = typer.Option(300.0, "--deadline", min=0.1, max=86400.0, help="Longest one file's download "
                                   "may take, seconds (a stalling mirror is given up on)."),
    tee: Tee = None,
    no_delta: bool = typer.Option(False, "--no-delta", help="Download the full release even when the repository "
                                  "has a signed delta from the running one."),
    key_broker: KeyBroker = None,
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
) -> None:
    """Fetch the newest release from a TUF repository (python-tuf's client: signatures,
    versions, expiry, lengths and hashes), verify it, run its canary and switch slots as
    'device boot' does. A signed delta from the running release is used when the repository
    has one (the result verified in full; any refusal falls back to the full release).
    Exit 0 = the new release is installed or the device is up to date;
    3 = refused (by the repository checks or on the device), the running release is kept;
    2 = refused and nothing runs; 4 = the TEE state needs (re-)provisioning."""
    import dataclasses
    import json

    from sealfl.enclave.device.policy import EXIT_KEPT_LAST_GOOD, EXIT_NOTHING_RUNS, exit_code_of
    from sealfl.enclave.device.tuf_fetch import DEFAULT_LIMITS
    from sealfl.enclave.device.update import update as run_update
    from sealfl.enclave.errors import BootError, UpdateError

    limits = dataclasses.replace(DEFAULT_LIMITS, socket_timeout_s=timeout, download_deadline_s=deadline)
    try:
        from sealfl.enclave.device.kbs_client import broker_key_source

        res = run_update(trust, repo, state, name=name, backend=check_tee(tee), limits=limits,
                         on_refused=lambda exc: say(f"refused: {exc}"), prefer_delta=not no_delta,
                         key_source=broker_key_source(key_broker) if key_broker else None)
    except UpdateError as exc:
        from sealfl.enclave.device.boot import read_device_state

        try:
            runs = read_device_state(state).last_good is not None
        except BootError:
            runs = False
        if as_json:
            sys.stdout.write(json.dumps({"action": "refused", "stage": exc.stage, "message": str(exc)}) + "\n")
        fail(f"update refused ({exc.stage}): {exc}", EXIT_KEPT_LAST_GOOD if runs else EXIT_NOTHING_RUNS)
    except BootError as exc:
        fail(f"nothing runs: {exc}" if exit_code_of(exc) == 2 else str(exc), exit_code_of(exc))
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    if as_json:
        sys.stdout.write(json.dumps({"action": res.action, "name": res.name, "version": res.version,
                                     "root_digest": res.root_digest, "via": res.via,
                                     "delta_refused": res.delta_refused}) + "\n")
    elif res.action == "current":
        console.print(f"up to date: {res.name} v{res.version} ({res.root_digest})")
    elif res.action == "installed":
        console.print(f"installed {res.name} v{res.version} ({res.root_digest}) from {repo}"
                      + (" (from a signed delta)" if res.via == "delta" else ""))
        if res.delta_refused:
            say(f"the repository's delta was refused ({res.delta_refused}); the full release was installed")
    else:
        say(f"kept the last good release v{res.outcome.device.release.version}")
    raise typer.Exit(res.exit_code)


def status(
    state: StateDir,
    as_json: bool = typer.Option(False, "--json", help="Print the status as one JSON object."),
) -> None:
    """Show the running release (name, version, root digest, where it came from), the TEE
    backend, the rollback floor, the last update check and its result. Reads only."""
    import json

    from sealfl.enclave.device.status import device_status, format_status

    if not state.is_dir():
        what = "is not a directory" if state.exists() else "does not exist"
        fail(f"the device state directory {state} {what}: this device has not been set up there. Provision it "
             f"('sealfl device provision --state {state} --tee tpm'), then install a release ('sealfl device update "
             f"--trust TRUST --state {state} --repo URL --name NAME' or 'sealfl device boot --trust TRUST --release "
             f"DIR --state {state}'); or give the --state of an existing device")
    try:
        s = device_status(state)
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    if as_json:
        sys.stdout.write(json.dumps(s, indent=1, sort_keys=True) + "\n")
    else:
        for line in format_status(s):
            console.print(line, markup=False, highlight=False)


tuf_client_app = typer.Typer(name="tuf-client", no_args_is_help=True, add_completion=False, help=(
    "The device's TUF client behind the tuf-conformance CLI (init / refresh / download; exit 0 or 1)."))


@tuf_client_app.callback()
def tuf_client(
    ctx: typer.Context,
    metadata_dir: Path = typer.Option(..., "--metadata-dir", help="The client's trusted metadata directory."),
    metadata_url: Optional[str] = typer.Option(None, "--metadata-url", help="The repository's metadata URL."),
    target_name: Optional[list[str]] = typer.Option(None, "--target-name", help="Target path (repeat: in order)."),
    target_base_url: Optional[str] = typer.Option(None, "--target-base-url", help="The repository's targets URL."),
    target_dir: Optional[Path] = typer.Option(None, "--target-dir", help="Where downloaded targets are stored."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More logging."),
) -> None:
    """The tuf-conformance client CLI (its CLIENT-CLI.md) over the updater 'device update' runs."""
    import logging

    if verbose:
        logging.getLogger().setLevel(logging.INFO if verbose == 1 else logging.DEBUG)
    ctx.obj = {"metadata_dir": metadata_dir, "metadata_url": metadata_url, "targets": target_name or [],
               "target_base_url": target_base_url, "target_dir": target_dir}


def _tuf_client_run(what: str, fn) -> None:
    try:
        fn()
    except typer.Exit:
        raise
    except Exception as exc:  # the protocol: any failure is exit 1 with a message
        fail(f"tuf-client {what}: {type(exc).__name__}: {exc}")


@tuf_client_app.command("init")
def tuf_client_init(ctx: typer.Context, trusted_root: Path = typer.Argument(..., help="Initial root.json.")) -> None:
    """Install TRUSTED_ROOT as the trusted root (no network)."""
    from sealfl.enclave.device import tuf_client as tc

    _tuf_client_run("init", lambda: tc.init(ctx.obj["metadata_dir"], trusted_root))


@tuf_client_app.command("refresh")
def tuf_client_refresh(ctx: typer.Context) -> None:
    """Refresh the top-level metadata (the TUF client workflow)."""
    from sealfl.enclave.device import tuf_client as tc

    o = ctx.obj
    if not o["metadata_url"]:
        fail("tuf-client refresh needs --metadata-url")
    _tuf_client_run("refresh", lambda: tc.refresh(o["metadata_dir"], o["metadata_url"]))


@tuf_client_app.command("download")
def tuf_client_download(ctx: typer.Context) -> None:
    """Download every --target-name in order (after a refresh); stop at the first failure."""
    from sealfl.enclave.device import tuf_client as tc

    o = ctx.obj
    if not (o["metadata_url"] and o["targets"] and o["target_base_url"] and o["target_dir"]):
        fail("tuf-client download needs --metadata-url, --target-name, --target-base-url and --target-dir")
    _tuf_client_run("download", lambda: tc.download(o["metadata_dir"], o["metadata_url"], o["targets"],
                                                    o["target_base_url"], o["target_dir"]))
