"""Output directories a command owns (``demo-out/``, ``llm-out/``): replaced on the next run,
never anything else.

A directory is the command's when it holds the command's marker file; it is emptied only if
everything in it is a name the command writes.
"""

from __future__ import annotations

import shutil
from collections.abc import Collection
from pathlib import Path

from sealfl.common.fsutil import atomic_write
from sealfl.platform.errors import PlatformError

__all__ = ["prepare_owned_dir"]


def prepare_owned_dir(out: Path, marker: str, owned: Collection[str], what: str) -> None:
    """Empty ``out`` of an earlier run's files and mark it as ``what``'s; create it if missing.

    Args:
        out: the output directory.
        marker: the name of the marker file the command writes first.
        owned: every top-level name the command writes (the marker included).
        what: the command, for messages (``"demo"``, ``"LLM demo"``).

    Raises:
        PlatformError: ``out`` is a file, holds no marker, or holds files the command did not
            write (nothing is removed then).
    """
    if out.exists():
        if not out.is_dir():
            raise PlatformError(f"{out} is a file; choose another --out")
        names = {p.name for p in out.iterdir()}
        if names and marker not in names:
            raise PlatformError(f"{out} exists and is not an earlier {what} output; choose another --out")
        foreign = names - set(owned)
        if foreign:
            raise PlatformError(f"{out} holds files the {what} did not write ({', '.join(sorted(foreign))}); "
                                "move them or choose another --out")
        for name in names:
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / marker, f"written by sealfl {what}; replaced on the next run\n".encode(), 0o644)
