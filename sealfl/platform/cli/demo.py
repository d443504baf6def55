"""``sealfl demo`` and ``sealfl llm-demo``: the whole path end to end on the embedded real data."""

from __future__ import annotations

from pathlib import Path

import typer

from sealfl.common.errors import Interrupted, SealflError
from sealfl.platform.cli.options import RayAddress
from sealfl.platform.cli.output import console, error_text, fail, stopped
from sealfl.platform.supervisor import interruptible

__all__ = ["demo_app", "llm_demo_app", "deploy_demo_app"]

demo_app = typer.Typer(name="demo", add_completion=False)
llm_demo_app = typer.Typer(name="llm-demo", add_completion=False)
deploy_demo_app = typer.Typer(name="deploy-demo", add_completion=False)


@demo_app.command("demo")
def demo(
    out: Path = typer.Option(Path("demo-out"), "--out", "-o", help="Output directory (replaced if it holds an "
                                                                   "earlier demo)."),
    rounds: int = typer.Option(10, min=1, help="Training rounds."),
    ray_address: RayAddress = None,
) -> None:
    """The whole path on the real four-hospital data: consortium -> encrypted campaign on Ray
    -> INT8 release (signed, attested) -> device boot -> on-device inference; prints a
    table and writes OUT/report.json."""
    with interruptible():
        from sealfl.platform.demo import run_demo

        try:
            run_demo(out, rounds=rounds, ray_address=ray_address, console=console)
        except Interrupted as exc:
            stopped(exc)
        except (SealflError, OSError) as exc:
            fail(error_text(exc))


@llm_demo_app.command("llm-demo")
def llm_demo(
    out: Path = typer.Option(Path("llm-out"), "--out", "-o", help="Output directory (replaced if it holds an "
                                                                  "earlier LLM demo)."),
    rounds: int = typer.Option(3, min=1, help="Federated rounds."),
    local_steps: int = typer.Option(6, min=1, help="Local LoRA steps per partner and round."),
    ray_address: RayAddress = None,
) -> None:
    """Federated LoRA of SmolLM2-135M on four manuals of the Python documentation, end to
    end: consortium -> encrypted campaign on Ray -> INT4/INT8 release (gated, signed,
    attested) -> device boot -> generate. Writes OUT/report.json."""
    with interruptible():
        from sealfl.platform.llm.demo import run_llm_demo

        try:
            run_llm_demo(out, rounds=rounds, local_steps=local_steps, ray_address=ray_address, console=console)
        except Interrupted as exc:
            stopped(exc)
        except (SealflError, OSError) as exc:
            fail(error_text(exc))


@deploy_demo_app.command("deploy-demo")
def deploy_demo(
    out: Path = typer.Option(Path("deploy-out"), "--out", "-o", help="Output directory (replaced if it holds an "
                                                                     "earlier deploy demo)."),
    rounds: int = typer.Option(3, min=1, max=100, help="Training rounds (each ~15-25 s on Flower's deployment "
                                                        "engine here)."),
) -> None:
    """The distributed product on one machine: a SuperLink and 4 SuperNodes as separate
    processes on 127.0.0.1 (each SuperNode with only its own kit, in its own directory), an
    encrypted campaign over TLS with node authentication, the release, a device boot and
    on-device scoring; prints where each log is and a summary, writes OUT/report.json, and
    stops every process it started."""
    from rich.table import Table

    with interruptible():
        from sealfl.platform.deploy_demo import run_deploy_demo

        try:
            rep = run_deploy_demo(out, rounds=rounds, say=lambda m: console.print(m, markup=False, highlight=False))
        except Interrupted as exc:
            stopped(exc)
        except (SealflError, OSError) as exc:
            fail(error_text(exc))
    t = Table(title=f"deploy demo: {len(rep['partners'])} partners over TLS (node auth {rep['node_auth']}), "
                    f"{rep['rounds']} rounds")
    for col in ("round", "pooled acc", "s", "ciphertext B / partner"):
        t.add_column(col, justify="right")
    for i, (acc_i, sec, b) in enumerate(zip(rep["pooled_test_accuracy_per_round"], rep["round_seconds"],
                                            rep["per_partner_ciphertext_bytes_per_round"]), 1):
        t.add_row(str(i), f"{acc_i:.3f}" if acc_i is not None else "n/a", f"{sec:.1f}" if sec is not None else "n/a",
                  f"{b:,.0f}")
    console.print(t)
    acc = rep["accuracy"]
    console.print(f"pooled test accuracy {acc['pooled_test']:.3f} after the last round; release fp32 "
                  f"{acc['release_fp32_pooled_test']}, INT8 {acc['release_int8_pooled_test']}; on the device "
                  f"{acc['device_pooled_test']:.3f}")
    for name, path in rep["logs"].items():
        console.print(f"log {name}: {path}", markup=False, highlight=False)
    console.print(f"report: {out / 'report.json'}", markup=False, highlight=False)
