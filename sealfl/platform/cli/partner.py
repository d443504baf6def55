"""``sealfl partner``: what a consortium partner runs on its own machine."""

from __future__ import annotations

from pathlib import Path

import typer

from sealfl.common.errors import SealflError
from sealfl.platform.cli.output import command_group, console, fail

__all__ = ["app"]

app = command_group("partner")


@app.command("check")
def check(
    kit: Path = typer.Argument(..., help="The partner's startup kit directory (consortium/partners/<name>)."),
) -> None:
    """Unwrap the kit's HE secret with the partner key, round-trip a test ciphertext, and
    load the partner's own data split. Nothing leaves this machine."""
    import numpy as np

    from sealfl.clients.kit import load_kit
    from sealfl.clients.plugins import get_task

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
