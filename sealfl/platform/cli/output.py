"""What every command prints with: the consoles, logging set-up, and the two ways a command
ends early (:func:`fail`, :func:`stopped`)."""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from sealfl.common.errors import Interrupted

__all__ = ["console", "err", "VERBOSE", "setup_logging", "say", "error_text", "fail", "stopped", "command_group"]

# rich assumes 80 columns when output is not a terminal (CI logs, pipes): too narrow for
# the demo table and long paths, so use 120 there
console = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 120)

VERBOSE = {"on": False}


def setup_logging(verbose: bool) -> None:
    """Our logs at INFO with -v, each line with its time (else WARNING); Flower's and Ray's
    chatter at WARNING."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format=("%(asctime)s " if verbose else "") + "%(levelname)s %(name)s: %(message)s")
    for noisy in ("flwr", "ray", "filelock", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not verbose else logging.INFO)
    logging.getLogger("flwr").propagate = False  # Flower installs its own console handler
    VERBOSE["on"] = verbose


#: set by a command given ``--json`` (:func:`json_mode`): its result and its failure are
#: one JSON object on stdout
JSON_MODE = {"on": False}


def json_mode(on: bool) -> bool:
    """Switch this command's output to one JSON object on stdout (``--json``); returns ``on``."""
    JSON_MODE["on"] = bool(on)
    return JSON_MODE["on"]


def _strict(value):
    """``value`` with every NaN or infinity (of a record, a metric) replaced by None: JSON has
    no such numbers, and Python's ``NaN`` token breaks every other JSON reader."""
    import math

    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()  # NumPy scalars
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def emit_json(doc: dict) -> None:
    """Print ``doc`` as one line of strict JSON on stdout (``--json`` output; NaN and
    infinities as null)."""
    import json

    typer.echo(json.dumps(_strict(doc), ensure_ascii=False, allow_nan=False, default=str))


def say(message: str) -> None:
    """Print one plain line on stderr (no markup, no highlighting: text from elsewhere stays as it is)."""
    err.print(message, soft_wrap=True, markup=False, highlight=False)


def error_text(exc: BaseException) -> str:
    """The one line a command stops with for ``exc``: a sealfl error's own message; an
    ``OSError`` as ``PATH: reason`` and what to check (not Python's ``[Errno 2] ...``)."""
    from sealfl.common.errors import SealflError

    if isinstance(exc, OSError) and not isinstance(exc, SealflError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}; check that the path exists and that this user may read and write there"
    return str(exc)


def fail(msg: str, code: int = 1) -> NoReturn:
    """Print ``error: msg`` on stderr and exit ``code``; under ``--json`` also print
    ``{"ok": false, "exit_code": code, "error": msg}`` on stdout."""
    err.print(f"[bold red]error:[/] {escape(str(msg))}", soft_wrap=True, highlight=False)
    if JSON_MODE["on"]:
        emit_json({"ok": False, "exit_code": code, "error": str(msg)})
    raise typer.Exit(code)


def stopped(exc: Interrupted) -> NoReturn:
    """One line for a command a signal stopped, then exit 128 + signal (130 SIGINT, 143 SIGTERM)."""
    err.print(f"[bold yellow]interrupted:[/] {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(exc.exit_code)


def command_group(name: str) -> typer.Typer:
    """A persona's command group (``sealfl <name> ...``) with its one-line help from
    :data:`sealfl.platform.cli.COMMANDS`; no arguments shows its help."""
    from sealfl.platform.cli import COMMANDS  # the package's __init__ has run: this is its submodule

    return typer.Typer(name=name, no_args_is_help=True, help=COMMANDS[name][2])
