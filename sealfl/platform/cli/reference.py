"""The CLI reference (``docs/cli.md``) generated from the CLI itself: every command with its
help text, arguments and options (type, default). ``python -m sealfl.platform.cli.reference
> docs/cli.md`` writes it; ``tests/platform/test_cli_reference.py`` checks the committed file
is what this prints, so the reference cannot drift from the code."""

from __future__ import annotations

import inspect

import click
import typer

__all__ = ["render_reference"]


def _walk(cmd: click.Command, ctx: click.Context, path: list[str]):
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _walk(sub, click.Context(sub, info_name=name, parent=ctx), [*path, name])
    else:
        yield path, cmd


def _default(p: click.Parameter) -> str:
    d = p.default
    if d is None or d is False or callable(d) or (isinstance(p, click.Option) and p.is_flag and not d):
        return ""
    if isinstance(d, (list, tuple)):
        return "" if not d else ", ".join(map(str, d))
    return str(d)


def _one_line(text: str | None) -> str:
    return " ".join(inspect.cleandoc(text or "").split())


def render_reference() -> str:
    """Markdown of every ``sealfl`` command (sorted as the CLI lists them)."""
    from sealfl.platform.cli import app

    root = typer.main.get_command(app)
    ctx = click.Context(root, info_name="sealfl")
    out = ["# sealfl command reference", "",
           "Generated from the CLI (`python -m sealfl.platform.cli.reference > docs/cli.md`); "
           "`sealfl COMMAND --help` shows the same.", ""]
    for path, cmd in _walk(root, ctx, []):
        out += [f"## `sealfl {' '.join(path)}`", "", _one_line(cmd.help), ""]
        rows = []
        for p in cmd.params:
            if isinstance(p, click.Argument):
                rows.append((p.human_readable_name.upper(), "argument" + (", required" if p.required else ""),
                             "", _one_line(getattr(p, "help", ""))))
            elif isinstance(p, click.Option) and p.name != "help":
                names = ", ".join(f"`{o}`" for o in (*p.opts, *p.secondary_opts))
                kind = "flag" if p.is_flag else p.type.name
                rows.append((names, kind + (", required" if p.required else ""), _default(p),
                             _one_line(getattr(p, "help", ""))))
        if rows:
            out += ["| parameter | kind | default | meaning |", "|---|---|---|---|"]
            out += [f"| {a} | {b} | {c.replace('|', '/')} | {d.replace('|', '/')} |" for a, b, c, d in rows]
            out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render_reference(), end="")
