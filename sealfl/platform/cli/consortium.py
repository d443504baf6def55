"""``sealfl consortium``: the coordinator creates a consortium."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from sealfl.common.errors import SealflError
from sealfl.platform.cli.output import command_group, console, fail

__all__ = ["app"]

app = command_group("consortium")


def _fresh(directory: Path) -> bool | None:
    """What :func:`_undo` may remove if the ceremony fails: True if ``directory`` does not
    exist yet (remove it), False if it is an empty directory (empty it again), None if it
    holds something (the ceremony refuses it before writing: leave it alone)."""
    if not directory.exists() and not directory.is_symlink():
        return True
    try:
        return False if directory.is_dir() and not any(directory.iterdir()) else None
    except OSError:
        return None


def _undo(directory: Path, created: bool) -> None:
    """Remove what a failed ``consortium create`` wrote into ``directory`` (and the directory
    itself if it ``created`` it)."""
    import shutil

    if created:
        shutil.rmtree(directory, ignore_errors=True)
        return
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


@app.command("create")
def create(
    directory: Path = typer.Argument(..., help="New consortium directory."),
    name: Optional[str] = typer.Option(None, help="Consortium name (default: the task's name)."),
    partner: Optional[list[str]] = typer.Option(None, "--partner", "-p",
                                                help="Partner name (repeat). Default: every partner the task has data "
                                                     "for (heart: the 4 FLamby hospitals; causal-lm: the 4 manuals)."),
    task: str = typer.Option("heart", help="What the consortium trains: 'heart' (logistic regression on "
                                          "Fed-Heart-Disease) or 'causal-lm' (LoRA of SmolLM2-135M on the Python docs)."),
    he: str = typer.Option("bfv", help="Homomorphic encryption of the updates: 'bfv' (default; packed BFV: "
                                       "~1.05x the fp32 bytes, exact sums, parameters clipped to ±8) or 'ckks' "
                                       "(NVIDIA FLARE's parameters, ~7x the fp32 bytes); docs/encryption.md."),
    pack_bits: Optional[int] = typer.Option(None, "--pack-bits",
                                            help="Packed BFV: bits per update value -- 27 (default; 2 per slot, step "
                                                 "2^-23), 18 (3), 13 (4), 10 (5 per slot, ~0.43x the fp32 bytes); "
                                                 "narrower widths round stochastically (unbiased). docs/encryption.md."),
    pack_range: Optional[int] = typer.Option(None, "--pack-range",
                                             help="Packed BFV, narrow widths: values clipped to about ±RANGE (8 "
                                                  "default, 4, 2, 1); each halving halves the step."),
    tee: str = typer.Option("sim", "--tee", help="The release enclave's TEE: 'sim' (an INSECURE, labelled "
                            "simulation for tests and demos) or 'tpm' (TPM 2.0 via SEALFL_TPM_TCTI; the "
                            "release-enclave role's handles, see docs/device.md 'Device trust on a TPM 2.0')."),
    partner_key: Optional[list[str]] = typer.Option(None, "--partner-key",
                                                    help="NAME=PUB.pem (repeat): a partner that made its key on its "
                                                         "own machine ('sealfl partner keygen') and sent only the "
                                                         "public half; its kit is wrapped to that key and it brings "
                                                         "its own data (any printable name with a letter or digit, "
                                                         "at most 64 characters)."),
    superlink_host: Optional[list[str]] = typer.Option(None, "--superlink-host",
                                                       help="Name or IP address partners reach the SuperLink at "
                                                            "(repeat; the TLS certificate's SAN). Default: 127.0.0.1 "
                                                            "and localhost."),
) -> None:
    """Run the HE key ceremony, write one startup kit per partner, provision the release
    enclave (HE secret sealed in it) and export the device trust anchors."""
    from sealfl.clients.plugins import get_task
    from sealfl.he.codecs import params_for
    from sealfl.platform.consortium import create_consortium
    from sealfl.platform.release import provision_release_enclave, trust_dir
    from sealfl.platform.repo.keys import make_authority_root_keys

    if tee not in ("sim", "tpm"):
        fail(f"--tee must be 'sim' or 'tpm', got {tee[:40]!r}")
    parent = directory.resolve().parent
    if not parent.is_dir():
        fail(f"cannot create the consortium in {directory}: its parent {parent} does not exist; create it first "
             "or choose another directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(f"cannot create the consortium in {directory}: {parent} is not writable by this user; choose a "
             "directory you can write")
    from sealfl.common.fsutil import read_capped

    keys: dict[str, bytes] = {}
    for item in partner_key or []:
        pname, sep, pub = item.partition("=")
        if not sep or not pname or not pub:
            fail(f"--partner-key {item[:80]!r}: give NAME=PUB.pem (the partner's name and its partner_key.pub.pem)")
        if pname in keys:
            fail(f"--partner-key: partner {pname!r} is given twice; each partner once")
        try:
            keys[pname] = read_capped(Path(pub), 16 * 1024)
        except OSError as exc:
            fail(f"--partner-key {pname}: cannot read {pub}: {exc.strerror or exc}")
    fresh = _fresh(directory)
    try:
        name = name or task
        named = list(partner or ([] if keys else get_task(task).partners))
        cons, codec = create_consortium(directory, name, named + [k for k in keys if k not in named], task=task,
                                        params=params_for(he, pack_bits, pack_range), superlink_hosts=superlink_host,
                                        public_keys=keys)
        provision_release_enclave(cons, codec.secret_context_bytes(), backend=tee)
        tuf_root = make_authority_root_keys(directory)
    except BaseException as exc:  # a refused or stopped ceremony leaves no half-written consortium
        if fresh is not None:
            _undo(directory, fresh)
        if isinstance(exc, SealflError):
            fail(str(exc))
        if isinstance(exc, OSError):
            fail(f"cannot create the consortium in {directory}: {exc.strerror or exc}"
                 f"{' (' + str(exc.filename) + ')' if exc.filename else ''}; choose a directory you can write")
        raise
    from sealfl.clients.kit import kit_dir

    kits = [f"{p} -> {kit_dir(directory, p)}" for p in cons.partners[:8]]  # a kit's directory is not its name
    more = f" and {len(cons.partners) - 8} more in {directory / 'partners'}" if len(cons.partners) > 8 else ""
    console.print(f"consortium {name} in {directory}: partners {', '.join(cons.partners)}; "
                  f"device trust anchors in {trust_dir(cons)}; startup kits (each with a README): "
                  f"{directory / 'superlink'}, {directory / 'aggregator'}, partners' kits {', '.join(kits)}{more}; "
                  f"TUF root keys in {tuf_root} ('sealfl repo init REPO -c {directory}'; keep the authority "
                  "directory offline)", markup=False, highlight=False)  # names and paths are shown as they are
