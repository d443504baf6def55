"""Options several commands share, defined once (``Annotated`` types for typer).

A command writes ``trust: TrustDir`` instead of repeating the ``typer.Option(...)``; the
flag names, short forms and help text are the same wherever they appear, and a test checks
that ``deploy/`` and the README use them as defined here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["TrustDir", "StateDir", "ReleaseDir", "BootRelease", "ConsortiumDir", "RayAddress", "CpusPerPartner", "Superlink", "Variant", "KeyBroker", "Tee", "check_tee"]

TrustDir = Annotated[Path, typer.Option("--trust", "-t", help="Pinned trust anchors directory.")]
StateDir = Annotated[Path, typer.Option("--state", "-s", help="Device state directory (TEE, slots, last good "
                                                              "release).")]
ReleaseDir = Annotated[Path, typer.Option("--release", "-r", help="Release directory to boot.")]
BootRelease = Annotated[Optional[Path], typer.Option("--release", "-r", help="Release directory to boot (default: "
                                                     "the device's last good release, e.g. the one 'device update' "
                                                     "installed).")]
ConsortiumDir = Annotated[Path, typer.Option("--consortium", "-c", help="Consortium directory.")]
RayAddress = Annotated[Optional[str], typer.Option("--ray-address", envvar="RAY_ADDRESS",
                                                   help="Attach to this Ray cluster instead of a local Ray.")]
CpusPerPartner = Annotated[float, typer.Option(
    "--cpus-per-partner", min=0.01, max=1024.0,
    help="Simulation only: Ray CPUs reserved per simulated partner (Flower's client-resources num-cpus); the "
         "partners trained at once are the Ray CPUs / this (default 1: one partner per core; 0.5: two).")]
Superlink = Annotated[Optional[str], typer.Option("--superlink", help="HOST:PORT of the consortium's SuperLink "
                                                 "(sealfl superlink start); TLS checked against the kit's ca.crt.")]
Variant = Annotated[Optional[str], typer.Option("--variant", help="Model variant of a causal-LM release (default: "
                                                                  "its default, int4).")]
KeyBroker = Annotated[Optional[str], typer.Option("--key-broker", help="Key broker URL for a release encrypted at "
                                                                       "rest (sealfl kbs serve).")]
Tee = Annotated[Optional[str], typer.Option(
    "--tee", help="TEE the device must run on: 'tpm' (TPM 2.0) or 'sim' (an INSECURE simulation for tests and "
    "demos). Default: the one 'sealfl device provision' set up. A fresh state is provisioned by itself only with "
    "--tee sim; a device never falls back to the simulation on its own.")]


def check_tee(tee: str | None) -> str | None:
    """The ``--tee`` value checked against the registered TEE backends (None = the state's own).

    Exits through :func:`~sealfl.platform.cli.output.fail` (exit 1) naming the backends on any other value."""
    from sealfl.enclave.tee.backends import BACKENDS
    from sealfl.platform.cli.output import fail

    if tee is not None and tee not in BACKENDS:
        fail(f"--tee must be one of {', '.join(BACKENDS)}, got {tee[:40]!r}")
    return tee
