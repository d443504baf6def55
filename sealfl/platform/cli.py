"""The ``sealfl`` command line (typer + rich).

Personas: ``consortium`` / ``campaign`` / ``release`` for the coordinator, ``partner``
for consortium partners, ``device`` and ``verify`` for edge devices, ``demo`` for the
whole path end to end.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from sealfl.common.errors import SealflError

from .errors import Interrupted
from .supervisor import interruptible

app = typer.Typer(help="sealfl: encrypted federated fine-tuning -> attested, signed edge releases.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
consortium_app = typer.Typer(help="Coordinator: create a consortium (HE key ceremony, partner kits, release enclave).",
                             no_args_is_help=True)
campaign_app = typer.Typer(help="Coordinator: run encrypted campaigns on Ray (FedAvg, or FedAvgM / FedAdam at the key holders).", no_args_is_help=True)
release_app = typer.Typer(help="Coordinator: build, gate, sign and attest a release.", no_args_is_help=True)
partner_app = typer.Typer(help="Partner: check a startup kit and the local data before joining a campaign.",
                          no_args_is_help=True)
device_app = typer.Typer(help="Device: verify and boot a release in the sandboxed runtime.", no_args_is_help=True)
app.add_typer(consortium_app, name="consortium")
app.add_typer(campaign_app, name="campaign")
app.add_typer(release_app, name="release")
app.add_typer(partner_app, name="partner")
app.add_typer(device_app, name="device")

# rich assumes 80 columns when output is not a terminal (CI logs, pipes): too narrow for
# the demo table and long paths, so use 120 there
console = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 120)


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


def stopped(exc: Interrupted) -> None:
    """One line for a command a signal stopped, then exit 128 + signal (130 SIGINT, 143 SIGTERM)."""
    err.print(f"[bold yellow]interrupted:[/] {exc}", soft_wrap=True)
    raise typer.Exit(exc.exit_code)


@app.callback()
def main_options(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details.")) -> None:
    setup_logging(verbose)


# ---- consortium ------------------------------------------------------------------------
@consortium_app.command("create")
def consortium_create(
    directory: Path = typer.Argument(..., help="New consortium directory."),
    name: Optional[str] = typer.Option(None, help="Consortium name (default: the task's name)."),
    partner: Optional[list[str]] = typer.Option(None, "--partner", "-p",
                                                help="Partner name (repeat). Default: every partner the task has data "
                                                     "for (heart: the 4 FLamby hospitals; causal-lm: the 4 manuals)."),
    task: str = typer.Option("heart", help="What the consortium trains: 'heart' (logistic regression on "
                                          "Fed-Heart-Disease) or 'causal-lm' (LoRA of SmolLM2-135M on the Python docs)."),
    he: str = typer.Option("ckks", help="Homomorphic encryption of the updates: 'ckks' (default; NVFlare's "
                                        "parameters, ~7x the fp32 bytes on the wire) or 'bfv' (packed BFV: ~1.05x, "
                                        "exact sums, parameters clipped to ±8; README 'Encrypted aggregation')."),
) -> None:
    """Run the HE key ceremony, write one startup kit per partner, provision the release
    enclave (HE secret sealed in it) and export the device trust anchors."""
    from sealfl.clients.tasks import get_task
    from sealfl.platform.consortium import create_consortium
    from sealfl.platform.release import provision_release_enclave, trust_dir

    try:
        from sealfl.common.codecs import params_for

        name = name or task
        cons, codec = create_consortium(directory, name, list(partner or get_task(task).partners), task=task,
                                        params=params_for(he))
        provision_release_enclave(cons, codec.secret_context_bytes())
    except (SealflError, OSError) as exc:
        fail(str(exc))
    console.print(f"consortium [bold]{name}[/] in {directory}: partners {', '.join(cons.partners)}; "
                  f"device trust anchors in {trust_dir(cons)}")


# ---- campaign --------------------------------------------------------------------------
@campaign_app.command("run")
def campaign_run(
    consortium: Path = typer.Option(..., "--consortium", "-c", help="Consortium directory."),
    out: Path = typer.Option(..., "--out", "-o", help="Campaign directory (status, rounds.jsonl, checkpoint)."),
    rounds: int = typer.Option(10, min=1, help="Training rounds."),
    local_epochs: Optional[int] = typer.Option(None, min=1, help="Local epochs per round (causal-lm: local steps; "
                                                                 "default: the task's, 5 / 6)."),
    lr: Optional[float] = typer.Option(None, min=1e-9, help="Local learning rate (default: the task's, 0.05 / 0.003)."),
    min_partners: Optional[int] = typer.Option(None, min=1, help="Fewest valid updates per round (default: all but one)."),
    server_opt: str = typer.Option("fedavg", help="Server optimizer the key holders run on each decrypted aggregate: "
                                   "fedavg, fedavgm (server momentum) or fedadam (Reddi et al. 2021). Its state travels "
                                   "encrypted in the aggregate: updates are 3x (fedavgm) / 4x (fedadam) larger."),
    server_lr: Optional[float] = typer.Option(None, help="fedavgm/fedadam: server learning rate in [1e-4, 100] "
                                              "(default: 1.0 fedavgm, 0.1 fedadam; Flower's defaults)."),
    server_momentum: Optional[float] = typer.Option(None, help="fedavgm only: server momentum in [0, 1) "
                                                    "(default 0.9)."),
    proximal_mu: Optional[float] = typer.Option(None, help="FedProx: weight μ of the proximal term ½μ‖w - w_global‖² "
                                                "in local training (heart task; default 0)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier campaign in --out."),
    ray_address: Optional[str] = typer.Option(None, envvar="RAY_ADDRESS",
                                              help="Attach to this Ray cluster instead of a local Ray."),
) -> None:
    """Run an encrypted campaign -- FedAvg, or FedAvgM / FedAdam at the key holders with
    --server-opt -- (Flower simulation engine on Ray, in a worker
    process tree; Ctrl-C or SIGTERM stop it at any moment: exit 130 / 143 with
    status.json saying 'interrupted' after the last finished round)."""
    with interruptible():  # a signal is acted on where it is safe, from the first import on
        from .campaign import CampaignSpec
        from .progress import run_campaign_with_progress
        from sealfl.common.server_opt import ServerOpt

        try:
            if server_momentum is None:
                server_momentum = 0.9 if server_opt.strip().lower() == "fedavgm" else 0.0
            opt = ServerOpt(server_opt, lr=server_lr, momentum=server_momentum)
            spec = CampaignSpec(str(consortium), str(out), rounds=rounds, local_epochs=local_epochs, lr=lr,
                                min_partners=min_partners, ray_address=ray_address, overwrite=overwrite,
                                flower_log_level="INFO" if VERBOSE["on"] else "WARNING", server_opt=opt,
                                proximal_mu=proximal_mu)
            res = run_campaign_with_progress(spec, console)
        except Interrupted as exc:
            stopped(exc)
        except (SealflError, OSError) as exc:
            fail(str(exc))
    acc = res.rounds[-1].get("pooled_test_accuracy") if res.rounds else None
    console.print(f"campaign finished: {len(res.rounds)} rounds in {res.seconds:.1f} s, pooled test accuracy "
                  f"{acc if acc is not None else float('nan'):.3f}; checkpoint in {out / 'checkpoint'}")


@campaign_app.command("status")
def campaign_status(
    out: Path = typer.Argument(..., help="Campaign directory (running or finished)."),
) -> None:
    """Show a campaign's status and one line per finished round (works while it runs)."""
    from rich.table import Table

    from sealfl.server.bookkeeping import CampaignDir

    cd = CampaignDir(out)
    try:
        status = cd.read_status()
        view = cd.view()
    except SealflError as exc:
        fail(str(exc))
    state = f"{view.state}: {view.note}" if view.note else view.state
    rounds = cd.rounds()
    t = Table(title=f"campaign {out}: {state} (round {view.round}/{view.num_rounds})")
    for col in ("round", "pooled acc", "partners", "rejected", "MB in", "seconds"):
        t.add_column(col, justify="right" if col not in ("partners", "rejected") else "left")
    for r in rounds:
        try:
            t.add_row(str(r["round"]), f"{float(r.get('pooled_test_accuracy', 'nan')):.3f}",
                      ", ".join(map(str, r.get("accepted", []))),
                      "; ".join(f"{k}: {v}" for k, v in dict(r.get("rejected") or {}).items()),
                      f"{float(r.get('ciphertext_bytes_in', 0)) / 1e6:.2f}", f"{float(r.get('round_seconds', 0)):.2f}")
        except (TypeError, ValueError):
            t.add_row(str(r["round"]), "(malformed record)", "", "", "", "")
    console.print(t)
    if view.error:
        err.print(f"[bold red]{'stopped' if view.state == 'interrupted' else 'error'}:[/] {view.error}")
    ray = status.get("ray") if isinstance(status.get("ray"), dict) else {}
    if ray:
        console.print(f"Ray: {ray.get('mode')} at {ray.get('gcs_address')}, authentication {ray.get('auth')}"
                      f"{', loopback only' if ray.get('loopback_only') else ''}")
    console.print(f"aggregator held a secret key: {status.get('server_has_secret_key')}")
    from sealfl.common.server_opt import ServerOptError
    from .release import campaign_server_opt

    try:
        console.print(f"server optimizer: {campaign_server_opt(out, missing_ok=False).describe()}")
    except ServerOptError as exc:
        console.print(f"server optimizer: unknown ({exc})")


# ---- partner ---------------------------------------------------------------------------
@partner_app.command("check")
def partner_check(
    kit: Path = typer.Argument(..., help="The partner's startup kit directory (consortium/partners/<name>)."),
) -> None:
    """Unwrap the kit's HE secret with the partner key, round-trip a test ciphertext, and
    load the partner's own data split. Nothing leaves this machine."""
    import numpy as np

    from sealfl.clients.kit import load_kit
    from sealfl.clients.tasks import get_task

    try:
        k = load_kit(str(kit))
        probe = np.array([1.25, -2.5, 3.0])
        err_max = float(np.max(np.abs(k.codec.decrypt(k.codec.encrypt(probe)) - probe)))
        task = get_task(k.task)
        data = task.load_data(k.partner, task.train_defaults())
    except (SealflError, OSError) as exc:
        fail(str(exc))
    console.print(f"partner [bold]{k.partner}[/] of consortium {k.consortium} (task {task.name}): HE secret "
                  f"unwrapped (context {k.codec.context_id.hex()[:16]}…, round-trip error {err_max:.1e}); "
                  f"data: {task.n_train(data)} training examples")


# ---- release ---------------------------------------------------------------------------
@release_app.command("build")
def release_build(
    consortium: Path = typer.Option(..., "--consortium", "-c", help="Consortium directory."),
    campaign: Path = typer.Option(..., "--campaign", help="Finished campaign directory."),
    out: Path = typer.Option(..., "--out", "-o", help="New release directory."),
    version: int = typer.Option(..., min=0, max=2**31 - 1, help="Release version (devices refuse older ones)."),
    max_drop: float = typer.Option(0.01, min=0.0, max=1.0,
                                   help="Largest allowed INT8 accuracy drop vs fp32 (0.01 = 1 point)."),
    ray_address: Optional[str] = typer.Option(None, envvar="RAY_ADDRESS",
                                              help="Ray cluster for the partners' evaluation of the candidates."),
) -> None:
    """Decrypt the final model in the release enclave, export ONNX, quantize to INT8, gate
    on accuracy, and write a signed, attested release."""
    with interruptible():
        from .release import release

        try:
            with console.status("decrypting in the release enclave; partners score the fp32 and INT8 candidates…"):
                res = release(consortium, campaign, out, version=version, max_drop=max_drop, ray_address=ray_address)
        except Interrupted as exc:
            stopped(exc)
        except (SealflError, OSError) as exc:
            fail(str(exc))
    if "gate" in res.accuracy:  # a causal-LM release: gate figures per variant
        g = res.accuracy["gate"]
        console.print(f"release v{version} in {out}: root digest {res.summary['root_digest']}; " + ", ".join(
            f"{v.upper()} top-1 agreement {d['top1_agreement']:.3f}, perplexity {d['perplexity']:.2f} "
            f"(fp32 {d['perplexity_fp32']:.2f})" for v, d in g.items()))
        return
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
    except (SealflError, OSError) as exc:
        fail(str(exc))
    console.print(f"[green]OK[/] {v.name} v{v.version} root digest {v.root_digest}")


EXIT_REFUSED_KEPT_LAST_GOOD = 3
EXIT_TEE_STATE = 4  # TEE state missing or of another AK: `sealfl device provision --force` on purpose


def read_feature_rows(path: Path, n_features: int):
    """Rows of a CSV of raw features -> float32 (n, n_features). A first row that is not
    numeric is taken as a header. Raises ValueError naming the row and the problem."""
    import csv

    import numpy as np

    def number(c: str) -> bool:
        try:
            float(c)
            return True
        except ValueError:
            return False

    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:  # -sig: tolerate a BOM
            rows = [r for r in csv.reader(fh) if r and any(c.strip() for c in r)]
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text CSV ({exc.reason})") from exc
    if rows and not any(number(c) for c in rows[0]):  # a header: every cell non-numeric
        if len(rows[0]) != n_features:
            raise ValueError(f"{path}: the header has {len(rows[0])} columns, the model takes {n_features}")
        rows = rows[1:]
    if not rows:
        raise ValueError(f"{path}: no data rows")
    out = np.zeros((len(rows), n_features), dtype=np.float32)
    for i, row in enumerate(rows):
        if len(row) != n_features:
            raise ValueError(f"{path}: data row {i + 1} has {len(row)} columns, the model takes {n_features}")
        bad = [c for c in row if not number(c)]
        if bad:
            raise ValueError(f"{path}: data row {i + 1} has a non-numeric value {bad[0]!r}")
        with np.errstate(over="ignore"):
            out[i] = np.asarray([float(c) for c in row], dtype=np.float64).astype(np.float32)
        if not np.all(np.isfinite(out[i])):
            raise ValueError(f"{path}: data row {i + 1} has a NaN, infinite or out-of-float32-range value")
    return out


@device_app.command("boot")
def device_boot(
    release_dir: Path = typer.Option(..., "--release", "-r", help="Release directory to boot."),
    trust: Path = typer.Option(..., "--trust", "-t", help="Pinned trust anchors directory."),
    state: Path = typer.Option(..., "--state", "-s", help="Device state directory (TEE, last good release)."),
    features_csv: Optional[Path] = typer.Option(
        None, "--input", help="CSV of raw feature rows to score (heart model: 13 columns age, sex(1=male), trestbps, "
        "chol, fbs, thalch, exang, oldpeak, cp=atypical angina, cp=non-anginal, cp=typical angina, "
        "restecg=normal, restecg=st-t abnormality; an optional header row). Prints one probability per row."),
    key_broker: Optional[str] = typer.Option(None, "--key-broker", help="Key broker URL for a release encrypted "
                                             "at rest (sealfl kbs serve)."),
) -> None:
    """Measure, verify and boot a release into the sandboxed runtime. If it is refused, boot
    the last good release instead and exit 3 (0 = the new release runs; 1/2 = nothing runs;
    4 = the TEE state is missing or of another key: re-provision on purpose).
    Optionally score a CSV of feature rows."""
    from sealfl.enclave.device import boot, boot_last_good
    from sealfl.enclave.errors import BootError

    rel, st, tr = release_dir.resolve(), state.resolve(), trust.resolve()
    for other, what in ((rel, "release"), (tr, "trust anchors")):
        if st == other or other in st.parents or st in other.parents:
            fail(f"the state directory {state} overlaps the {what} directory {other}; keep device state apart")
    code = 0
    from sealfl.kbs.client import broker_key_source

    keys = broker_key_source(key_broker) if key_broker else None
    try:
        dev = boot(trust, release_dir, state, key_source=keys)
    except BootError as exc:
        if exc.reason == "tee-state":
            fail(str(exc), EXIT_TEE_STATE)
        err.print(f"[bold red]refused:[/] {exc}")
        try:
            dev = boot_last_good(trust, state, key_source=keys)
        except (SealflError, OSError) as exc2:
            fail(f"no last good release to fall back to: {exc2}", 2)
        err.print(f"kept the last good release v{dev.release.version}")
        code = EXIT_REFUSED_KEPT_LAST_GOOD
    except (SealflError, OSError) as exc:
        fail(str(exc))
    with dev:
        console.print(f"booted {dev.release.name} v{dev.release.version} ({dev.release.root_digest})")
        if features_csv:
            shape = (dev.release.metadata.get("input") or {}).get("shape") or [None, None]
            try:
                x = read_feature_rows(features_csv, int(shape[1]) if shape[1] else 13)
                probs = dev.predict(x).reshape(-1)
            except (ValueError, OSError, SealflError) as exc:
                msg = str(exc)
                fail(msg if msg.startswith(str(features_csv)) else f"{features_csv}: {msg}")
            sys.stdout.write("".join(f"{float(p):.4f}\n" for p in probs))
    if code:
        raise typer.Exit(code)


@app.command("demo")
def demo(
    out: Path = typer.Option(Path("demo-out"), "--out", "-o", help="Output directory (replaced if it holds an earlier demo)."),
    rounds: int = typer.Option(10, min=1, help="Training rounds."),
    ray_address: Optional[str] = typer.Option(None, envvar="RAY_ADDRESS", help="Attach to this Ray cluster."),
) -> None:
    """The whole path on the real four-hospital data: consortium -> encrypted campaign on Ray
    -> INT8 release (signed, attested) -> device boot -> on-device inference; prints a
    table and writes OUT/report.json."""
    with interruptible():
        from .demo import run_demo

        try:
            run_demo(out, rounds=rounds, ray_address=ray_address, console=console)
        except Interrupted as exc:
            stopped(exc)
        except (SealflError, OSError) as exc:
            fail(str(exc))


from .cli_llm import register as _register_llm  # noqa: E402  (device generate, llm-demo)

_register_llm(app, device_app, console, err, fail, stopped, EXIT_REFUSED_KEPT_LAST_GOOD)

from .cli_trust import register as _register_trust  # noqa: E402  (device provision/attest, attest *)

_register_trust(app, device_app, console, err, fail)


def main() -> None:
    """Console-script entry point: an unexpected error becomes one line (with -v: the traceback)."""
    try:
        app(standalone_mode=True)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]")
        sys.exit(130)
    except Exception as exc:  # the last line of defence: no tracebacks for users
        if VERBOSE["on"]:
            raise
        err.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}\n(run with -v for the traceback)")
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
