"""``sealfl campaign``: the coordinator runs and watches encrypted campaigns."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sealfl.common.errors import Interrupted, SealflError
from sealfl.platform.cli.options import ConsortiumDir, CpusPerPartner, RayAddress, Superlink
from sealfl.platform.cli.output import (
    VERBOSE,
    command_group,
    console,
    emit_json,
    err,
    error_text,
    fail,
    json_mode,
    stopped,
)
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
    dp_epsilon: Optional[float] = typer.Option(None, help="Record-level DP: ε budget; the campaign stops before the "
                                               "round that would exceed it (without --dp-noise-multiplier the noise "
                                               "is calibrated so all --rounds fit). Packed BFV and FedAvg only."),
    dp_delta: float = typer.Option(1e-5, help="DP: δ (in (0, 1); below 1/records)."),
    dp_noise_multiplier: Optional[float] = typer.Option(None, help="DP: noise std over one record's sensitivity "
                                                        "(z), instead of calibrating it to --dp-epsilon."),
    dp_clip: float = typer.Option(1.0, help="DP: per-example gradient L2 clip norm C."),
    dp_trust: int = typer.Option(0, help="DP: t, partners that may skip their noise share or collude; shares are "
                                 "sized for k - t honest partners (k = --min-partners)."),
    dp_sampling_rate: float = typer.Option(0.1, help="DP: each record's Poisson inclusion probability per round."),
    round_timeout: float = typer.Option(600.0, "--round-timeout", min=1.0, max=1e6,
                                        help="Seconds each round waits for the partners' replies (and for partners "
                                             "to connect); a partner that has not answered by then is recorded as "
                                             "late in rounds.jsonl and its reply does not count."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier campaign in --out."),
    ray_address: RayAddress = None,
    cpus_per_partner: CpusPerPartner = 1.0,
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
        from sealfl.platform.campaign import CampaignSpec, DPSpec
        from sealfl.platform.progress import run_campaign_with_progress

        try:
            _simulation_only(cpus_per_partner, superlink)
            if superlink is not None:
                from sealfl.platform.services import parse_hostport

                parse_hostport(superlink)  # before "campaign started" is printed
            if server_momentum is None:
                server_momentum = 0.9 if server_opt.strip().lower() == "fedavgm" else 0.0
            opt = ServerOpt(server_opt, lr=server_lr, momentum=server_momentum)
            dp = None
            if dp_epsilon is not None or dp_noise_multiplier is not None:
                dp = DPSpec(delta=dp_delta, epsilon=dp_epsilon, noise_multiplier=dp_noise_multiplier, clip=dp_clip,
                            trust=dp_trust, sampling_rate=dp_sampling_rate)
            spec = CampaignSpec(str(consortium), str(out), rounds=rounds, local_epochs=local_epochs, lr=lr,
                                min_partners=min_partners, ray_address=ray_address, overwrite=overwrite,
                                flower_log_level="INFO" if VERBOSE["on"] else "WARNING", server_opt=opt,
                                proximal_mu=proximal_mu, dp=dp, superlink=superlink, timeout_s=round_timeout,
                                cpus_per_partner=cpus_per_partner)
            if prepare_only:
                _prepare_only(spec)
                return
            res = run_campaign_with_progress(spec, console)
        except Interrupted as exc:
            stopped(exc)
        except (SealflError, OSError) as exc:
            fail(error_text(exc))
    acc = res.rounds[-1].get("pooled_test_accuracy") if res.rounds else None
    console.print(f"campaign finished: {len(res.rounds)} rounds in {res.seconds:.1f} s, pooled test accuracy "
                  f"{acc if acc is not None else float('nan'):.3f}; checkpoint in {out / 'checkpoint'}")
    priv = res.rounds[-1].get("privacy") if res.rounds else None
    if isinstance(priv, dict):
        console.print(f"record-level DP: ε = {priv.get('epsilon', float('nan')):.4f}, δ = {priv.get('delta')} after "
                      f"{priv.get('rounds')} noised rounds ({priv.get('accountant')})")


def _simulation_only(cpus_per_partner: float, superlink: str | None) -> None:
    if superlink and cpus_per_partner != 1.0:
        from sealfl.platform.errors import CampaignError

        raise CampaignError("--cpus-per-partner sizes the simulated partners on Ray; with --superlink every partner "
                            "is a SuperNode on its own machine: drop one of the two")


def _prepare_only(spec) -> None:
    from sealfl.platform.campaign import prepare_campaign
    from sealfl.platform.flwr_cli import toml_config

    cons, cd = prepare_campaign(spec)
    rc = toml_config({"campaign-dir": str(cd.dir.resolve()), "consortium-dir": str(cons.dir.resolve())})
    console.print(f"campaign prepared in {cd.dir}; from the sealfl source tree run it with Flower's CLI:", highlight=False)
    console.print(f"  RAY_ADDRESS=local flwr run . CONNECTION --federation-config num-supernodes={len(cons.partners)} "
                  f"--run-config '{rc}'", highlight=False, soft_wrap=True)
    console.print("  where CONNECTION names a [superlink.CONNECTION] table (address, root-certificates or insecure) "
                  "in $FLWR_HOME/config.toml: a SuperLink of this consortium, or a 'flower-superlink --simulation' "
                  "for the local simulation federation", markup=False, highlight=False, soft_wrap=True)


@app.command("resume")
def resume(
    consortium: ConsortiumDir,
    out: Path = typer.Argument(..., help="Campaign directory of a stopped campaign (interrupted, dead or failed)."),
    ray_address: RayAddress = None,
    cpus_per_partner: CpusPerPartner = 1.0,
    superlink: Superlink = None,
) -> None:
    """Continue a stopped campaign (Ctrl-C, kill -9 of the coordinator or ServerApp, a
    failure) from its last finished round's checkpoint, as a new run with the campaign's
    own settings: the final model is an uninterrupted run's. 'campaign status' says what
    it will do. Refuses a finished campaign, one still running, a damaged checkpoint and
    a campaign of another consortium."""
    with interruptible():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from sealfl.platform.resume import resume_campaign
        from sealfl.server.bookkeeping import CampaignDir

        try:
            _simulation_only(cpus_per_partner, superlink)
            if superlink is not None:
                from sealfl.platform.services import parse_hostport

                parse_hostport(superlink)
            from sealfl.platform.consortium import Consortium

            plan = CampaignDir(out).plan_resume(Consortium.load(consortium).context_id)
            if not plan.ok:  # refused before anything is announced (another consortium, finished, running)
                fail(f"{out}: {plan.message}")
            console.print(plan.message, markup=False, highlight=False)
            with Progress(TextColumn("[bold]encrypted rounds"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TextColumn("{task.description}"), console=console, transient=False) as bar:
                task = bar.add_task("resuming: statistics round…", total=plan.num_rounds or 1,
                                    completed=plan.from_round)

                def on_round(rec: dict) -> None:
                    acc = rec.get("pooled_test_accuracy")
                    bar.update(task, completed=rec["round"], description=(
                        f"round {rec['round']}: pooled acc {acc if acc is not None else float('nan'):.3f}, "
                        f"{len(rec.get('accepted', []))} partners, {rec.get('round_seconds', 0):.2f} s"))

                res = resume_campaign(out, consortium, ray_address=ray_address, superlink=superlink,
                                      cpus_per_partner=cpus_per_partner,
                                      flower_log_level="INFO" if VERBOSE["on"] else "WARNING", on_round=on_round)
        except Interrupted as exc:
            stopped(exc)
        except (SealflError, OSError) as exc:
            fail(error_text(exc))
    acc = res.rounds[-1].get("pooled_test_accuracy") if res.rounds else None
    if res.status.get("note"):  # the stopped run had committed every round: nothing was run again
        console.print(f"campaign finished: {res.status['note']}; pooled test accuracy "
                      f"{acc if acc is not None else float('nan'):.3f}; checkpoint in {out / 'checkpoint'}",
                      highlight=False)
        return
    console.print(f"campaign finished after resuming at round {plan.from_round + 1}: {len(res.rounds)} rounds, "
                  f"pooled test accuracy {acc if acc is not None else float('nan'):.3f}; checkpoint in "
                  f"{out / 'checkpoint'}")


@app.command("status")
def status(
    out: Path = typer.Argument(..., help="Campaign directory (running or finished)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (state as decided from the owner "
                                 "process: 'dead' after a kill) instead of the table."),
) -> None:
    """Show a campaign's status and one line per finished round (works while it runs)."""
    from rich.markup import escape
    from rich.table import Table

    from sealfl.server.bookkeeping import CampaignDir

    json_mode(as_json)  # a refusal is one JSON object on stdout too
    cd = CampaignDir(out)
    try:
        status_doc = cd.read_status()
        view = cd.view()
        plan = cd.plan_resume()
    except SealflError as exc:
        fail(str(exc))
    rounds = cd.rounds()
    damaged = len(rounds) < view.round  # the checkpoint is at round k: k records must be there
    if damaged:
        err.print(f"[yellow]warning:[/] {cd.rounds_path} holds {len(rounds)} readable round record(s) but the "
                  f"checkpoint is at round {view.round}: the round log is damaged (release build and audit will "
                  "refuse it); restore it from a backup")
    if as_json:
        keep = ("started", "started_iso", "finished", "finished_iso", "updated", "updated_iso",
                "server_has_secret_key", "owner")
        emit_json({"dir": str(out), "state": view.state, "note": view.note, "round": view.round,
                   "num_rounds": view.num_rounds, "error": view.error, "resume": plan.to_dict(),
                   "recorded_status": status_doc.get("status"), **{k: status_doc.get(k) for k in keep},
                   "rounds_log_complete": not damaged, "rounds": rounds})
        return
    state = f"{view.state}: {view.note}" if view.note else view.state
    t = Table(title=escape(f"campaign {out}: {state} (round {view.round}/{view.num_rounds})"))
    for col in ("round", "pooled acc", "partners", "rejected", "MB in", "seconds"):
        t.add_column(col, justify="right" if col not in ("partners", "rejected") else "left")
    for r in rounds:
        try:
            t.add_row(str(r["round"]), f"{float(r.get('pooled_test_accuracy', 'nan')):.3f}",  # names: as they are
                      escape(", ".join(map(str, r.get("accepted", [])))),
                      escape(_refusals(r)),
                      f"{float(r.get('ciphertext_bytes_in', 0)) / 1e6:.2f}", f"{float(r.get('round_seconds', 0)):.2f}")
        except (TypeError, ValueError):
            t.add_row(str(r["round"]), "(malformed record)", "", "", "", "")
    console.print(t)
    priv = next((r["privacy"] for r in reversed(rounds) if isinstance(r.get("privacy"), dict)), None)
    if priv is not None:
        try:
            budget = priv.get("epsilon_budget")
            console.print(f"privacy (record-level DP, {priv.get('accountant')}): ε = {float(priv['epsilon']):.4f}, "
                          f"δ = {float(priv['delta']):g} after {int(priv['rounds'])} rounds"
                          f"{f' (budget ε = {float(budget):g})' if budget is not None else ''}; noise multiplier "
                          f"{float(priv['noise_multiplier']):.4g}, clip {float(priv['clip']):g}, "
                          f"k = {priv.get('min_partners')}, t = {priv.get('trust')}")
        except (KeyError, TypeError, ValueError):
            console.print("privacy: (malformed record)")
    if view.error:
        err.print(f"[bold red]{'stopped' if view.state == 'interrupted' else 'error'}:[/] {escape(str(view.error))}")
    if view.state not in ("finished", "running", "starting"):  # stopped: say what resume would do
        console.print(f"{plan.message}{f' (sealfl campaign resume {out} -c CONSORTIUM)' if plan.ok else ''}",
                      markup=False, highlight=False)
    ray = status_doc.get("ray") if isinstance(status_doc.get("ray"), dict) else {}
    if ray:
        console.print(f"Ray: {ray.get('mode')} at {ray.get('gcs_address')}, authentication {ray.get('auth')}"
                      f"{', loopback only' if ray.get('loopback_only') else ''}")
    console.print(f"aggregator held a secret key: {status_doc.get('server_has_secret_key')}")
    from sealfl.he.errors import ServerOptError
    from sealfl.platform.campaign_outcome import campaign_server_opt

    try:
        console.print(f"server optimizer: {campaign_server_opt(out, missing_ok=False).describe()}")
    except ServerOptError as exc:
        console.print(f"server optimizer: unknown ({exc})")


def _refusals(rec: dict) -> str:
    """Every refused reply of a round record, its phase named unless it is the train reply:
    the statistics query (``stats_rejected``, e.g. a reply signed by another partner's key)
    and the evaluation (``eval_rejected``) as well as the update (``rejected``)."""
    out = []
    for key, phase in (("stats_rejected", "statistics: "), ("rejected", ""), ("eval_rejected", "evaluation: ")):
        out += [f"{phase}{k}: {v}" for k, v in dict(rec.get(key) or {}).items()]
    return "; ".join(out)


@app.command("report")
def report(
    out: Path = typer.Argument(..., help="Campaign directory (running or finished)."),
    to: Optional[Path] = typer.Option(None, "--to", "-o", help="Where to write report.html and the PNGs "
                                      "(default: CAMPAIGN/report)."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON instead of a summary."),
) -> None:
    """Write a campaign's report: report.html with PNG plots of accuracy and loss per round,
    per partner and pooled (perplexity for the language-model task), bytes and time per
    round, and refused replies; prints the page's path."""
    from sealfl.platform.report import campaign_report

    json_mode(as_json)  # a refusal is one JSON object on stdout too
    try:
        rep, s = campaign_report(out, to)
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    if as_json:
        emit_json({"html": str(rep.html), "images": [str(p) for p in rep.images], **s.to_dict()})
        return
    console.print(f"report of {len(s.rounds)} round(s): {rep.html}")
    if s.skipped:
        err.print(f"[yellow]warning:[/] {s.skipped} malformed value(s) in {out}/rounds.jsonl were left out")
