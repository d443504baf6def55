"""The ``sealfl`` command line (typer + rich).

Personas: ``consortium`` / ``campaign`` / ``release`` for the coordinator, ``partner``
for consortium partners, ``device`` and ``verify`` for edge devices, ``demo`` for the
whole path end to end.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from sealfl.common.errors import SealflError

app = typer.Typer(help="sealfl: encrypted federated fine-tuning -> attested, signed edge releases.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
consortium_app = typer.Typer(help="Coordinator: create a consortium (CKKS key ceremony, partner kits, release enclave).",
                             no_args_is_help=True)
campaign_app = typer.Typer(help="Coordinator: run encrypted FedAvg campaigns on Ray.", no_args_is_help=True)
release_app = typer.Typer(help="Coordinator: build, gate, sign and attest a release.", no_args_is_help=True)
partner_app = typer.Typer(help="Partner: check a startup kit and the local data before joining a campaign.",
                          no_args_is_help=True)
device_app = typer.Typer(help="Device: verify and boot a release in the sandboxed runtime.", no_args_is_help=True)
app.add_typer(consortium_app, name="consortium")
app.add_typer(campaign_app, name="campaign")
app.add_typer(release_app, name="release")
app.add_typer(partner_app, name="partner")
app.add_typer(device_app, name="device")

console = Console()
err = Console(stderr=True)


VERBOSE = {"on": False}


def setup_logging(verbose: bool) -> None:
    """Our logs at INFO with -v (else WARNING); Flower's and Ray's chatter at WARNING."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("flwr", "ray", "filelock"):
        lg = logging.getLogger(noisy)
        lg.setLevel(logging.WARNING if not verbose else logging.INFO)
    flwr_log = logging.getLogger("flwr")
    flwr_log.propagate = False  # Flower installs its own console handler
    VERBOSE["on"] = verbose


def fail(msg: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


@app.callback()
def main_options(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details.")) -> None:
    setup_logging(verbose)


# ---- consortium ------------------------------------------------------------------------
@consortium_app.command("create")
def consortium_create(
    directory: Path = typer.Argument(..., help="New consortium directory."),
    name: str = typer.Option("heart", help="Consortium name."),
    partner: Optional[list[str]] = typer.Option(None, "--partner", "-p",
                                                help="Partner name (repeat). Default: the 4 FLamby hospitals."),
) -> None:
    """Run the CKKS key ceremony, write one startup kit per partner, provision the release
    enclave (CKKS secret sealed in it) and export the device trust anchors."""
    from sealfl.clients.data import HOSPITALS
    from sealfl.platform.consortium import create_consortium
    from sealfl.platform.release import provision_release_enclave, trust_dir

    try:
        cons, codec = create_consortium(directory, name, list(partner or HOSPITALS))
        provision_release_enclave(cons, codec.secret_context_bytes())
    except SealflError as exc:
        fail(str(exc))
    console.print(f"consortium [bold]{name}[/] in {directory}: partners {', '.join(cons.partners)}; "
                  f"device trust anchors in {trust_dir(cons)}")


# ---- campaign --------------------------------------------------------------------------
@campaign_app.command("run")
def campaign_run(
    consortium: Path = typer.Option(..., "--consortium", "-c", help="Consortium directory."),
    out: Path = typer.Option(..., "--out", "-o", help="Campaign directory (status, rounds.jsonl, checkpoint)."),
    rounds: int = typer.Option(10, min=1, help="Training rounds."),
    local_epochs: int = typer.Option(5, min=1, help="Local epochs per round."),
    lr: float = typer.Option(0.05, help="Local SGD learning rate."),
    min_partners: Optional[int] = typer.Option(None, help="Fewest valid updates per round (default: all but one)."),
    ray_address: Optional[str] = typer.Option(None, envvar="RAY_ADDRESS",
                                              help="Attach to this Ray cluster instead of a local Ray."),
) -> None:
    """Run an encrypted FedAvg campaign (Flower simulation engine on Ray)."""
    from .progress import run_campaign_with_progress
    from .campaign import CampaignSpec

    spec = CampaignSpec(str(consortium), str(out), rounds=rounds, local_epochs=local_epochs, lr=lr,
                        min_partners=min_partners, ray_address=ray_address,
                        flower_log_level="INFO" if VERBOSE["on"] else "WARNING")
    try:
        res = run_campaign_with_progress(spec, console)
    except SealflError as exc:
        fail(str(exc))
    last = res.rounds[-1]
    console.print(f"campaign finished: {len(res.rounds)} rounds in {res.seconds:.1f} s, pooled test accuracy "
                  f"{last['pooled_test_accuracy']:.3f}; checkpoint in {out / 'checkpoint'}")


# ---- partner ---------------------------------------------------------------------------
@partner_app.command("check")
def partner_check(
    kit: Path = typer.Argument(..., help="The partner's startup kit directory (consortium/partners/<name>)."),
) -> None:
    """Unwrap the kit's CKKS secret with the partner key, round-trip a test ciphertext, and
    load the partner's own data split. Nothing leaves this machine."""
    import numpy as np

    from sealfl.clients.data import load_partition
    from sealfl.clients.kit import load_kit

    try:
        k = load_kit(str(kit))
        probe = np.array([1.25, -2.5, 3.0])
        err_max = float(np.max(np.abs(k.codec.decrypt(k.codec.encrypt(probe)) - probe)))
        part = load_partition(k.partner)
    except SealflError as exc:
        fail(str(exc))
    console.print(f"partner [bold]{k.partner}[/] of consortium {k.consortium}: CKKS secret unwrapped "
                  f"(context {k.codec.context_id.hex()[:16]}…, round-trip error {err_max:.1e}); "
                  f"data: {part.n_train} training rows, {len(part.y_test)} test rows")


# ---- release ---------------------------------------------------------------------------
@release_app.command("build")
def release_build(
    consortium: Path = typer.Option(..., "--consortium", "-c", help="Consortium directory."),
    campaign: Path = typer.Option(..., "--campaign", help="Finished campaign directory."),
    out: Path = typer.Option(..., "--out", "-o", help="New release directory."),
    version: int = typer.Option(..., min=0, help="Release version (devices refuse older ones)."),
    max_drop: float = typer.Option(0.01, help="Largest allowed INT8 accuracy drop vs fp32 (0.01 = 1 point)."),
) -> None:
    """Decrypt the final model in the release enclave, export ONNX, quantize to INT8, gate
    on accuracy, and write a signed, attested release."""
    from .release import release

    try:
        res = release(consortium, campaign, out, version=version, max_drop=max_drop)
    except SealflError as exc:
        fail(str(exc))
    console.print(f"release v{version} in {out}: root digest {res.summary['root_digest']}; "
                  f"fp32 {res.accuracy['fp32']['pooled']:.3f}, INT8 {res.accuracy['int8']['pooled']:.3f}")


# ---- verify / device -------------------------------------------------------------------
@app.command("verify")
def verify(
    release_dir: Path = typer.Argument(..., help="Release directory to check."),
    trust: Path = typer.Option(..., "--trust", "-t", help="Pinned trust anchors directory."),
) -> None:
    """Check a release (signature, attestation, manifest, every file hash) without loading it.
    Exit 0 if it verifies; otherwise exit 1 and name the failing file and check."""
    from sealfl.enclave.verify_cli import verify_dir

    try:
        v = verify_dir(trust, release_dir)
    except SealflError as exc:
        fail(str(exc))
    console.print(f"[green]OK[/] {v.name} v{v.version} root digest {v.root_digest}")


@device_app.command("boot")
def device_boot(
    release_dir: Path = typer.Option(..., "--release", "-r", help="Release directory to boot."),
    trust: Path = typer.Option(..., "--trust", "-t", help="Pinned trust anchors directory."),
    state: Path = typer.Option(..., "--state", "-s", help="Device state directory (TEE, last good release)."),
    features_csv: Optional[Path] = typer.Option(None, "--input", help="CSV of raw features (13 columns) to score."),
) -> None:
    """Measure, verify and boot a release into the sandboxed runtime; if it is refused, keep
    the last good release. Optionally score a CSV of feature rows."""
    import numpy as np

    from sealfl.enclave.device import boot, boot_last_good
    from sealfl.enclave.errors import BootError

    try:
        dev = boot(trust, release_dir, state)
    except BootError as exc:
        err.print(f"[bold red]refused:[/] {exc}")
        try:
            dev = boot_last_good(trust, state)
        except SealflError as exc2:
            fail(f"no last good release to fall back to: {exc2}", 2)
        err.print(f"kept the last good release v{dev.release.version}")
    with dev:
        console.print(f"booted {dev.release.name} v{dev.release.version} ({dev.release.root_digest})")
        if features_csv:
            x = np.loadtxt(features_csv, delimiter=",", dtype=np.float32, ndmin=2)
            for p in dev.predict(x).reshape(-1):
                console.print(f"{float(p):.4f}")


@app.command("demo")
def demo(
    out: Path = typer.Option(Path("demo-out"), "--out", "-o", help="Output directory (replaced if it holds an earlier demo)."),
    rounds: int = typer.Option(10, min=1, help="Training rounds."),
    ray_address: Optional[str] = typer.Option(None, envvar="RAY_ADDRESS", help="Attach to this Ray cluster."),
) -> None:
    """The whole path on the real four-hospital data: consortium -> encrypted campaign on Ray
    -> INT8 release (signed, attested) -> device boot -> on-device inference; prints a
    table and writes OUT/report.json."""
    from .demo import run_demo

    try:
        run_demo(out, rounds=rounds, ray_address=ray_address, console=console)
    except SealflError as exc:
        fail(str(exc))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    sys.exit(main())
