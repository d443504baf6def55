"""Rich progress display for campaigns (a bar over rounds, one line per round)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sealfl.platform.campaign import CampaignResult, CampaignSpec, run_campaign
from sealfl.platform.campaign_checks import preflight


def run_campaign_with_progress(spec: CampaignSpec, console: Console, **kwargs) -> CampaignResult:
    """:func:`run_campaign` with a progress bar; each finished round prints its accuracy,
    accepted/rejected partners and time. ``kwargs`` go to :func:`run_campaign`
    (``client_app``, ``client_app_kwargs``, ``app_dir``). Raises what it raises."""
    preflight(spec)  # fail on bad settings before drawing a progress bar
    if spec.superlink:  # and on a SuperLink that does not answer (or lacks this consortium's CA)
        from pathlib import Path

        from sealfl.platform.deployed import check_superlink

        check_superlink(spec.superlink, Path(spec.consortium_dir))
        kwargs = {**kwargs, "superlink_checked": True}
    with Progress(TextColumn("[bold]encrypted rounds"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=False) as bar:
        task = bar.add_task(f"submitting to the SuperLink {spec.superlink}, statistics round…" if spec.superlink
                            else "starting Ray + Flower, statistics round…", total=spec.rounds)

        plain = not console.is_terminal  # a log file or a pipe: one plain line per round instead of a redrawn bar
        if plain:
            console.print(f"campaign started ({spec.rounds} rounds, "
                          f"{'SuperLink ' + spec.superlink if spec.superlink else 'simulation on Ray'})",
                          markup=False, highlight=False)

        def on_round(rec: dict) -> None:
            rej = rec.get("rejected") or {}
            note = f", rejected {', '.join(rej)}" if rej else ""
            acc = rec.get("pooled_test_accuracy")
            line = (f"round {rec['round']}: pooled acc {acc if acc is not None else float('nan'):.3f}, "
                    f"{len(rec.get('accepted', []))} partners{note}, {rec.get('round_seconds', 0):.2f} s")
            bar.update(task, advance=1, description=line)
            if plain:
                console.print(f"round {rec['round']}/{spec.rounds} done: {line.split(': ', 1)[1]}", markup=False,
                              highlight=False)

        return run_campaign(spec, on_round=on_round, **kwargs)
