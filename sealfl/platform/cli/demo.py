"""``sealfl demo`` and ``sealfl llm-demo``: the whole path end to end on the embedded real data."""

from __future__ import annotations

from pathlib import Path

import typer

from sealfl.common.errors import Interrupted, SealflError
from sealfl.platform.cli.options import RayAddress
from sealfl.platform.cli.output import console, fail, stopped
from sealfl.platform.supervisor import interruptible

__all__ = ["demo_app", "llm_demo_app"]

demo_app = typer.Typer(name="demo", add_completion=False)
llm_demo_app = typer.Typer(name="llm-demo", add_completion=False)


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
            fail(str(exc))


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
            fail(str(exc))
