"""``sealfl campaign``: the coordinator runs and watches encrypted campaigns."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sealfl.common.errors import Interrupted, SealflError
from sealfl.platform.cli.options import ConsortiumDir, RayAddress, Superlink
from sealfl.platform.cli.output import VERBOSE, command_group, console, err, fail, stopped
from sealfl.platform.supervisor import interruptible

__all__ = ["app"]

app = command_group("campaign")


@app.command("run")
def run(
    consortium: ConsortiumDir,
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
    ray_address: RayAddress = None,
    superlink: Superlink = None,
    prepare_only: bool = typer.Option(False, "--prepare-only", help="Only write the campaign directory and print the "
                                      "'flwr run .' command that runs it (Flower's own CLI; local simulation "
                                      "federation or a SuperLink)."),
) -> None:
    """Run an encrypted campaign -- FedAvg, or FedAvgM / FedAdam at the key holders with
    --server-opt -- (Flower simulation engine on Ray, in a worker
    process tree; with --superlink, on partners' SuperNodes through that SuperLink over TLS; Ctrl-C or SIGTERM stop it at any moment: exit 130 / 143 with
    status.json saying 'interrupted' after the last finished round)."""
    with interruptible():  # a signal is acted on where it is safe, from the first import on
        from sealfl.he.server_opt import ServerOpt
        from sealfl.platform.campaign import CampaignSpec
        from sealfl.platform.progress import run_campaign_with_progress

        try:
            if server_momentum is None:
                server_momentum = 0.9 if server_opt.strip().lower() == "fedavgm" else 0.0
            opt = ServerOpt(server_opt, lr=server_lr, momentum=server_momentum)
            spec = CampaignSpec(str(consortium), str(out), rounds=rounds, local_epochs=local_epochs, lr=lr,
                                min_partners=min_partners, ray_address=ray_address, overwrite=overwrite,
                                flower_log_level="INFO" if VERBOSE["on"] else "WARNING", server_opt=opt,
                                proximal_mu=proximal_mu, superlink=superlink)
            if prepare_only:
                _prepare_only(spec)
                return
            res = run_campaign_with_progress(spec, console)
        except Interrupted as exc:
            stopped(exc)
        except (SealflError, OSError) as exc:
            fail(str(exc))
    acc = res.rounds[-1].get("pooled_test_accuracy") if res.rounds else None
    console.print(f"campaign finished: {len(res.rounds)} rounds in {res.seconds:.1f} s, pooled test accuracy "
                  f"{acc if acc is not None else float('nan'):.3f}; checkpoint in {out / 'checkpoint'}")


def _prepare_only(spec) -> None:
    from sealfl.platform.campaign import prepare_campaign
    from sealfl.platform.flwr_cli import toml_config

    cons, cd = prepare_campaign(spec)
    rc = toml_config({"campaign-dir": str(cd.dir.resolve()), "consortium-dir": str(cons.dir.resolve())})
    console.print(f"campaign prepared in {cd.dir}; from the sealfl source tree run it with Flower's CLI:", highlight=False)
    console.print(f"  RAY_ADDRESS=local flwr run . CONNECTION --federation-config num-supernodes={len(cons.partners)} "
                  f"--run-config '{rc}'", highlight=False, soft_wrap=True)


@app.command("status")
def status(
    out: Path = typer.Argument(..., help="Campaign directory (running or finished)."),
) -> None:
    """Show a campaign's status and one line per finished round (works while it runs)."""
    from rich.table import Table

    from sealfl.server.bookkeeping import CampaignDir

    cd = CampaignDir(out)
    try:
        status_doc = cd.read_status()
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
    ray = status_doc.get("ray") if isinstance(status_doc.get("ray"), dict) else {}
    if ray:
        console.print(f"Ray: {ray.get('mode')} at {ray.get('gcs_address')}, authentication {ray.get('auth')}"
                      f"{', loopback only' if ray.get('loopback_only') else ''}")
    console.print(f"aggregator held a secret key: {status_doc.get('server_has_secret_key')}")
    from sealfl.he.errors import ServerOptError
    from sealfl.platform.release import campaign_server_opt

    try:
        console.print(f"server optimizer: {campaign_server_opt(out, missing_ok=False).describe()}")
    except ServerOptError as exc:
        console.print(f"server optimizer: unknown ({exc})")
