"""Flower's own command line (``flwr``), driven the way a user drives it: an app directory,
a ``FLWR_HOME`` with one SuperLink connection, ``--format json`` answers.

Flower 1.42 keeps connections in ``$FLWR_HOME/config.toml``::

    [superlink]
    default = "sealfl"
    [superlink.sealfl]
    address = "127.0.0.1:9092"
    root-certificates = "/abs/ca.crt"      # TLS: the consortium CA (or insecure = true)

The app directory :func:`write_app` makes holds only a ``pyproject.toml`` (and a README)
naming the installed package's module-level apps, so the bundle Flower ships to the
SuperLink carries no code (``[tool.flwr.app] fab-include``): every host runs the sealfl it
has installed, and the SuperLink runs with ``--disable-runtime-dependency-installation``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from sealfl.common.errors import plain_text
from sealfl.common.fsutil import atomic_write
from sealfl.platform.errors import DeploymentError

__all__ = ["flower_bin", "flower_env", "write_app", "write_flwr_home", "flwr_json", "toml_config",
           "SERVERAPP", "CLIENTAPP", "CONNECTION"]

log = logging.getLogger(__name__)

#: the module-level apps (also in the repository's pyproject.toml)
SERVERAPP = "sealfl.server.app:app"
CLIENTAPP = "sealfl.clients.app:app"
#: the connection name written into FLWR_HOME
CONNECTION = "sealfl"

_APP_PYPROJECT = """\
[project]
name = "sealfl"
version = "0.1.0"
description = "sealfl's encrypted campaign (the installed sealfl's module-level apps)"
license = "Apache-2.0"
dependencies = ["flwr>=1.42,<1.43"]

[tool.flwr.app]
publisher = "sealfl"
fab-include = ["README.md"]

[tool.flwr.app.components]
serverapp = "{serverapp}"
clientapp = "{clientapp}"

[tool.flwr.app.config]
campaign-dir = ""
consortium-dir = ""
"""


def flower_bin(name: str) -> str:
    """Path of a Flower executable (``flwr``, ``flower-superlink``, ``flower-supernode``):
    next to this Python first (the same installation), else on PATH. Raises DeploymentError."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise DeploymentError(f"{name} is not installed here; install sealfl with the partner extra "
                              "(pip install 'sealfl[partner]')")
    return found


def flower_env(base: dict | None = None, flwr_home: Path | None = None) -> dict:
    """Environment for Flower processes: this Python's bin directory first on PATH (the
    SuperLink starts ``flower-superexec`` by name, the SuperNode ``flwr-clientapp``), this
    sealfl importable, Flower's update check off, ``FLWR_HOME`` if given. (SuperExec's task
    poll stays Flower's 1 s: 0.1 s measured 20.0 s per deployed round against 16.0 s at 1 s
    on this loaded 2-core box, i.e. no gain within the noise.)"""
    import sealfl

    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    root = str(Path(sealfl.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


def write_app(d: Path, serverapp: str = SERVERAPP, clientapp: str = CLIENTAPP) -> Path:
    """Write the thin app directory (``pyproject.toml`` + ``README.md``) into ``d``; returns ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(d / "pyproject.toml", _APP_PYPROJECT.format(serverapp=serverapp, clientapp=clientapp).encode(), 0o644)
    atomic_write(d / "README.md", b"sealfl campaign app: runs the installed sealfl's ServerApp and ClientApp.\n", 0o644)
    return d


def write_flwr_home(d: Path, address: str, root_certificates: Path | None) -> Path:
    """Write ``d/config.toml`` with the one connection :data:`CONNECTION` to ``address``
    (TLS checked against ``root_certificates``; None: insecure, for tests of the refusal
    only). Returns ``d``."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    tls = (f"root-certificates = {json.dumps(str(Path(root_certificates).resolve()))}\n" if root_certificates
           else "insecure = true\n")
    atomic_write(d / "config.toml", (f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                                     f"address = {json.dumps(address)}\n{tls}").encode(), 0o600)
    return d


def toml_config(values: dict) -> str:
    """``--run-config`` / ``--node-config`` text for ``values`` (strings quoted as TOML basic
    strings, numbers and booleans as TOML literals)."""
    parts = []
    for k, v in values.items():
        if isinstance(v, bool):
            parts.append(f"{k}={'true' if v else 'false'}")
        elif isinstance(v, (int, float)):
            parts.append(f"{k}={v!r}")
        else:
            parts.append(f"{k}={json.dumps(str(v))}")
    return " ".join(parts)


def flwr_json(args: list[str], flwr_home: Path, timeout_s: float = 60.0) -> dict:
    """Run ``flwr ARGS --format json`` with ``FLWR_HOME=flwr_home``; returns its JSON answer.

    Raises DeploymentError with Flower's own error text if it exits non-zero, answers
    ``"success": false`` or does not answer JSON.
    """
    cmd = [flower_bin("flwr"), *args, "--format", "json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=flower_env(flwr_home=flwr_home),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise DeploymentError(f"'flwr {args[0]}' did not answer within {timeout_s:.0f} s") from exc
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = None
    if proc.returncode != 0 or not isinstance(doc, dict) or doc.get("success") is False:
        why = (doc or {}).get("error-message") if isinstance(doc, dict) else None
        why = why or proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}"
        raise DeploymentError(f"'flwr {' '.join(args[:2])}' failed: {plain_text(str(why))}")
    return doc
