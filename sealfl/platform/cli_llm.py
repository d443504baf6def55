"""CLI commands of the causal-LM path: ``sealfl device generate`` and ``sealfl llm-demo``
(registered on the main ``sealfl`` app by :mod:`sealfl.platform.cli`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

__all__ = ["register"]


def register(app: typer.Typer, device_app: typer.Typer, console, err, fail, stopped, exit_kept: int) -> None:
    """Add the commands to ``app`` / ``device_app``."""

    @device_app.command("generate")
    def device_generate(
        release_dir: Path = typer.Option(..., "--release", "-r", help="Release directory to boot."),
        trust: Path = typer.Option(..., "--trust", "-t", help="Pinned trust anchors directory."),
        state: Path = typer.Option(..., "--state", "-s", help="Device state directory."),
        prompt: str = typer.Option(..., "--prompt", "-p", help="The user's message (or raw text with --raw)."),
        raw: bool = typer.Option(False, help="Continue PROMPT as plain text instead of applying the chat template."),
        max_tokens: int = typer.Option(128, min=1, max=4096, help="New tokens at most."),
        temperature: float = typer.Option(0.0, min=0.0, max=5.0, help="0 = greedy."),
        top_p: float = typer.Option(1.0, min=1e-6, max=1.0, help="Nucleus sampling mass."),
        seed: int = typer.Option(0, min=0, help="Sampler seed (same seed, same answer)."),
        stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeat, at most 8)."),
        variant: Optional[str] = typer.Option(None, help="Model variant of the release (default: its default, int4)."),
    ) -> None:
        """Verify and boot a causal-LM release, then answer PROMPT, streaming the text to
        stdout (token counts and timing on stderr). A refused release falls back to the last
        good one (exit 3), as 'device boot' does."""
        from sealfl.common.errors import SealflError
        from sealfl.enclave.device import boot, boot_last_good
        from sealfl.enclave.errors import BootError
        from sealfl.common.llm_decode import SamplingParams

        try:
            params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
                                    stop=tuple(stop or ()))
        except ValueError as exc:
            fail(str(exc))
        code = 0
        try:
            dev = boot(trust, release_dir, state, variant=variant)
        except BootError as exc:
            err.print(f"[bold red]refused:[/] {exc}")
            try:
                dev = boot_last_good(trust, state, variant=variant)
            except (SealflError, OSError) as exc2:
                fail(f"no last good release to fall back to: {exc2}", 2)
            err.print(f"kept the last good release v{dev.release.version}")
            code = exit_kept
        except (SealflError, OSError) as exc:
            fail(str(exc))
        with dev:
            if not dev.is_llm:
                fail(f"release {dev.release.name} is not a causal LM; use 'sealfl device boot --input'")

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
        if code:
            raise typer.Exit(code)

    @app.command("llm-demo")
    def llm_demo(
        out: Path = typer.Option(Path("llm-out"), "--out", "-o", help="Output directory (replaced if it holds an "
                                                                      "earlier LLM demo)."),
        rounds: int = typer.Option(3, min=1, help="Federated rounds."),
        local_steps: int = typer.Option(6, min=1, help="Local LoRA steps per partner and round."),
        ray_address: Optional[str] = typer.Option(None, envvar="RAY_ADDRESS", help="Attach to this Ray cluster."),
    ) -> None:
        """Federated LoRA of SmolLM2-135M on four manuals of the Python documentation, end to
        end: consortium -> encrypted campaign on Ray -> INT4/INT8 release (gated, signed,
        attested) -> device boot -> generate. Writes OUT/report.json."""
        from .errors import Interrupted
        from .supervisor import interruptible

        with interruptible():
            from sealfl.common.errors import SealflError

            from .llm.demo import run_llm_demo

            try:
                run_llm_demo(out, rounds=rounds, local_steps=local_steps, ray_address=ray_address, console=console)
            except Interrupted as exc:
                stopped(exc)
            except (SealflError, OSError) as exc:
                fail(str(exc))
