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

    @device_app.command("serve")
    def device_serve(
        release_dir: Path = typer.Option(..., "--release", "-r", help="Release directory to boot."),
        trust: Path = typer.Option(..., "--trust", "-t", help="Pinned trust anchors directory."),
        state: Path = typer.Option(..., "--state", "-s", help="Device state directory."),
        host: str = typer.Option("127.0.0.1", help="Address to bind (loopback unless you mean otherwise)."),
        port: int = typer.Option(8000, min=0, max=65535, help="TCP port (0: a free one, see --port-file)."),
        port_file: Optional[Path] = typer.Option(None, help="Write the bound port here once listening."),
        max_concurrent: int = typer.Option(1, min=1, max=16, help="Requests generating at once; one sandboxed "
                                           "child per slot; beyond it: 429 with Retry-After."),
        max_body_bytes: int = typer.Option(1 << 20, min=1024, max=64 << 20, help="Largest request body (400 "
                                           "beyond)."),
        threads: Optional[int] = typer.Option(None, min=1, max=64, help="onnxruntime threads per slot "
                                              "(default: cores / slots)."),
        variant: Optional[str] = typer.Option(None, help="Model variant of the release (default: its default, int4)."),
    ) -> None:
        """Verify and boot a causal-LM release as 'device boot' does, then serve it over an
        OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) with
        /health and /metrics. Runs until SIGINT/SIGTERM (exit 130/143). A refused release
        falls back to the last good one; with none, exit 2 (/health never answered 200)."""
        import dataclasses

        from sealfl.common.errors import SealflError
        from sealfl.enclave.errors import BootError
        from sealfl.enclave.openai_api import DEFAULT_LIMITS
        from sealfl.enclave.serve import EXIT_REFUSED, ServeOptions, run_server

        from .errors import Interrupted

        opts = ServeOptions(host=host, port=port, max_concurrent=max_concurrent, variant=variant,
                            port_file=port_file, threads=threads,
                            limits=dataclasses.replace(DEFAULT_LIMITS, max_body_bytes=max_body_bytes))
        try:
            run_server(trust, release_dir, state, opts, say=lambda m: err.print(m, soft_wrap=True, markup=False,
                                                                                highlight=False))
        except Interrupted as exc:
            stopped(exc)
        except BootError as exc:
            fail(f"nothing is served: {exc}", EXIT_REFUSED)
        except (SealflError, OSError) as exc:
            fail(str(exc))

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
