"""``sealfl release``: the coordinator builds, gates, signs and attests a release."""

from __future__ import annotations

from pathlib import Path

import typer

from sealfl.common.errors import Interrupted, SealflError
from sealfl.platform.cli.options import ConsortiumDir, RayAddress
from sealfl.platform.cli.output import command_group, console, emit_json, err, error_text, fail, json_mode, stopped
from sealfl.platform.supervisor import interruptible

__all__ = ["app"]

app = command_group("release")


def _warn_same_content(consortium: Path, root_digest: str, version: int) -> None:
    from sealfl.platform.register import read_register, same_content

    try:
        earlier = same_content(read_register(consortium), root_digest, version)
    except SealflError:
        return
    if earlier:
        err.print(f"[yellow]warning:[/] release v{version} has the same content (root digest {root_digest[:16]}…) "
                  f"as issued version(s) {', '.join(map(str, earlier))}: devices that run those gain nothing")


@app.command("build")
def build(
    consortium: ConsortiumDir,
    campaign: Path = typer.Option(..., "--campaign", help="Finished campaign directory."),
    out: Path = typer.Option(..., "--out", "-o", help="New release directory."),
    version: int = typer.Option(..., min=0, max=2**31 - 1, help="Release version (devices refuse older ones)."),
    max_drop: float = typer.Option(0.01, min=0.0, max=1.0,
                                   help="Largest allowed INT8 accuracy drop vs fp32 (0.01 = 1 point)."),
    ray_address: RayAddress = None,
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object on stdout (ok, "
                                 "version, dir, root digest, accuracy; or the error)."),
) -> None:
    """Decrypt the final model in the release enclave, export ONNX, quantize to INT8, gate
    on accuracy, and write a signed, attested release. Each phase is shown as it starts (a
    plain line on stderr when not on a terminal)."""
    import sys
    import time

    json_mode(as_json)
    t0 = time.perf_counter()
    interactive = sys.stderr.isatty() and not as_json
    with interruptible():
        from sealfl.platform.release import release

        try:
            with err.status("release build…") as status:
                def on_stage(name: str) -> None:
                    if interactive:
                        status.update(f"{name}…")
                    else:
                        err.print(f"[{time.perf_counter() - t0:6.1f} s] {name}", markup=False, highlight=False)

                res = release(consortium, campaign, out, version=version, max_drop=max_drop, ray_address=ray_address,
                              on_stage=on_stage)
        except Interrupted as exc:
            stopped(exc)
        except (SealflError, OSError) as exc:
            fail(error_text(exc))
    _warn_same_content(consortium, res.summary["root_digest"], version)
    if as_json:
        emit_json({"ok": True, "version": version, "dir": str(out), "root_digest": res.summary["root_digest"],
                   "files": res.summary.get("files"), "accuracy": res.accuracy, "seconds": res.seconds})
        return
    if "gate" in res.accuracy:  # a causal-LM release: gate figures per variant
        g = res.accuracy["gate"]
        console.print(f"release v{version} in {out}: root digest {res.summary['root_digest']}; " + ", ".join(
            f"{v.upper()} top-1 agreement {d['top1_agreement']:.3f}, perplexity {d['perplexity']:.2f} "
            f"(fp32 {d['perplexity_fp32']:.2f})" for v, d in g.items()))
        return
    console.print(f"release v{version} in {out}: root digest {res.summary['root_digest']}; "
                  f"fp32 {res.accuracy['fp32']['pooled']:.3f}, INT8 {res.accuracy['int8']['pooled']:.3f}")


@app.command("delta")
def delta(
    old: Path = typer.Argument(..., help="The base release directory (what devices run now)."),
    new: Path = typer.Argument(..., help="The newer release directory of the same model."),
    out: Path = typer.Option(..., "--out", "-o", help="New delta directory (delta.dsse.json, patches/)."),
    consortium: ConsortiumDir = ...,
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object on stdout."),
) -> None:
    """Write a signed delta from OLD to NEW: an HDiffPatch patch per changed file and a
    statement the release enclave signs, pinning OLD's and NEW's root digests. Publish it
    with 'sealfl repo publish NEW --delta DIR'; a device running OLD applies it and verifies
    the result in full, any other device installs NEW whole."""
    json_mode(as_json)
    from sealfl.platform.delta import delta_for_consortium

    try:
        res = delta_for_consortium(consortium, old, new, out)
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    ratio = res.patch_bytes / max(res.full_bytes, 1)
    if as_json:
        emit_json({"ok": True, "dir": str(out), "name": res.name, "base_version": res.base_version,
                   "version": res.version, "base_root_digest": res.base_root_digest, "root_digest": res.root_digest,
                   "patch_bytes": res.patch_bytes, "full_bytes": res.full_bytes, "ratio": ratio,
                   "patched": list(res.patched)})
        return
    console.print(f"delta {res.name} v{res.base_version} -> v{res.version} in {out}: {res.patch_bytes} bytes "
                  f"({ratio:.1%} of the full release's {res.full_bytes}); {len(res.patched)} file(s) patched")
