"""The ``sealfl`` command line (typer + rich): one module per persona.

=================  =====================================================================
``consortium``     coordinator: create a consortium (:mod:`.consortium`)
``campaign``       coordinator: run and watch encrypted campaigns (:mod:`.campaign`)
``superlink``      coordinator: run the SuperLink from its kit (:mod:`.superlink`)
``release``        coordinator: build, gate, sign and attest a release (:mod:`.release`)
``repo``           coordinator: the TUF repository devices update from (:mod:`.repo`)
``partner``        partner: make its key, check a startup kit and its data (:mod:`.partner`)
``device``         device: provision, boot, generate, serve, attest, doctor (:mod:`.device`)
``verify``         anyone: check a release without loading it (:mod:`.device`)
``attest`` ``kbs``  verifier and key broker (:mod:`.attest`)
``audit``          anyone: rounds -> provenance -> release -> device quote (:mod:`.audit`)
``demo`` ...       the whole path end to end (:mod:`.demo`)
=================  =====================================================================

A command group's module is imported only when that group runs (:class:`_LazyGroup`):
``sealfl device boot`` loads this module, :mod:`.device` and what they import -- all of it
part of the device runtime's measurement (:mod:`sealfl.enclave.measurement`) -- and no
coordinator code. Options shared by several commands are defined once in :mod:`.options`.
"""

from __future__ import annotations

import importlib
import sys

import click
import typer
from typer.core import TyperGroup

from sealfl.platform.cli.output import VERBOSE, err, setup_logging

__all__ = ["app", "main", "COMMANDS"]

#: command name -> (module, attribute holding its typer app, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "consortium": ("sealfl.platform.cli.consortium", "app",
                   "Coordinator: create a consortium (HE key ceremony, partner kits, release enclave)."),
    "campaign": ("sealfl.platform.cli.campaign", "app",
                 "Coordinator: run encrypted campaigns on Ray (FedAvg, or FedAvgM / FedAdam at the key holders)."),
    "superlink": ("sealfl.platform.cli.superlink", "app",
                  "Coordinator: run the consortium's SuperLink (TLS, SuperNode authentication) from its kit."),
    "release": ("sealfl.platform.cli.release", "app", "Coordinator: build, gate, sign and attest a release."),
    "repo": ("sealfl.platform.cli.repo", "app",
             "Coordinator: the TUF repository devices update from (init, publish, serve, rotate)."),
    "partner": ("sealfl.platform.cli.partner", "app",
                "Partner: make its own key, check a startup kit and its data, run the SuperNode that joins campaigns."),
    "device": ("sealfl.platform.cli.device", "app",
               "Device: provision, verify, boot, serve and attest releases in the sandboxed runtime."),
    "verify": ("sealfl.platform.cli.device", "verify_app",
               "Check a release (signature, attestation, every file hash) without loading it."),
    "attest": ("sealfl.platform.cli.attest", "app", "Verifier: write a policy, check a device's evidence."),
    "audit": ("sealfl.platform.cli.audit", "audit_app",
              "Anyone: check the chain from the campaign's rounds to a device's quote, link by link."),
    "kbs": ("sealfl.platform.cli.attest", "kbs_app", "Key broker: release model keys to attested devices."),
    "demo": ("sealfl.platform.cli.demo", "demo_app",
             "The whole path on the real four-hospital data, end to end."),
    "llm-demo": ("sealfl.platform.cli.demo", "llm_demo_app",
                 "Federated LoRA of SmolLM2-135M on four manuals, end to end."),
    "deploy-demo": ("sealfl.platform.cli.demo", "deploy_demo_app",
                    "A SuperLink and 4 SuperNodes over TLS on this machine, a campaign, a release, a device."),
}


#: the entries of :data:`COMMANDS` that are command groups (``sealfl device boot``)
GROUPS = frozenset({"consortium", "superlink", "campaign", "release", "repo", "partner", "device", "attest", "kbs"})


def keep_argument_help(command: click.Command) -> click.Command:
    """Give every argument of ``command`` (and of its subcommands) the help its declaration
    has, and each subcommand a one-line summary for the group's list; return ``command``.

    typer 0.20 sets an argument's ``help`` and then calls click's ``Argument.__init__``,
    which since click 8.5 takes a ``help`` of its own and resets it to None: every
    argument's help was missing from ``--help``. A no-op where the help arrived."""
    import inspect

    try:
        from typer.models import ArgumentInfo
        from typer.utils import get_params_from_function
    except ImportError:  # another typer: its help stays as it arrives, the CLI still works
        return command
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            keep_argument_help(sub)
            if sub.help and not sub.short_help:  # the group's list: the first paragraph as one line (typer's
                # rich mode kept the docstring's line breaks there)
                sub.short_help = " ".join(inspect.cleandoc(sub.help).split("\n\n")[0].split())
        return command
    if command.callback is None:
        return command
    declared = get_params_from_function(inspect.unwrap(command.callback))
    for p in command.params:
        meta = declared.get(p.name or "")
        if isinstance(p, click.Argument) and not getattr(p, "help", None) and meta is not None \
                and isinstance(meta.default, ArgumentInfo):
            p.help = meta.default.help
    return command


class _LazyGroup(TyperGroup):
    """The root group: a command's module is imported when the command is looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module, attr, help_ = entry
        # the one import by name in the CLI: which persona module runs is the command line's
        # choice; the device's measured-imports test runs the device commands and checks
        # what they loaded
        typer_app = getattr(importlib.import_module(module), attr)
        # a group stays a group even with one subcommand (``consortium create``); the
        # top-level commands (verify, demo, llm-demo) are one-command apps
        command = keep_argument_help(typer.main.get_group(typer_app) if cmd_name in GROUPS
                                     else typer.main.get_command(typer_app))
        command.name = cmd_name
        command.short_help = help_
        return command


app = typer.Typer(cls=_LazyGroup, help="sealfl: encrypted federated fine-tuning -> attested, signed edge releases.",
                  no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False)


def _print_version(value: bool) -> None:
    if value:
        import sealfl

        typer.echo(f"sealfl {sealfl.__version__}")
        raise typer.Exit(0)


@app.callback()
def _main_options(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details."),
                  version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                               help="Print sealfl's version and exit.")) -> None:
    setup_logging(verbose)


def main() -> None:
    """Console-script entry point: an unexpected error becomes one line (with -v: the traceback)."""
    try:
        app(standalone_mode=True)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]")
        sys.exit(130)
    except Exception as exc:  # the last line of defence: no tracebacks for users
        if VERBOSE["on"]:
            raise
        from rich.markup import escape

        err.print(f"[bold red]error:[/] {type(exc).__name__}: {escape(str(exc))}\n(run with -v for the traceback)",
                  highlight=False)
        sys.exit(1)
