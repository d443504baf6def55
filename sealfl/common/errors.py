"""The error base every sealfl package derives from, and the few errors truly shared.

Each package has one base of its own (``sealfl.he.errors.HEError``,
``sealfl.attestation.errors.AttestationError``, ``sealfl.enclave.errors.EnclaveError``,
``sealfl.server.errors.ServerError``, ``sealfl.clients.errors.ClientError``,
``sealfl.platform.errors.PlatformError``), all subclasses of :class:`SealflError`, so the CLI
catches every deliberate error with one ``except``.
"""

from __future__ import annotations

import re

from sealfl._moved import moved_names_hook

__all__ = ["SealflError", "Interrupted", "ProtocolError", "ProcessInfoError", "signal_name", "short_repr",
           "plain_text"]


class SealflError(Exception):
    """Base class of every error sealfl raises on purpose."""


class Interrupted(SealflError):
    """A signal (SIGINT, SIGTERM) stopped a long command. Raised only after every process
    the command started is gone and its directory is consistent again (campaigns, releases,
    ``device serve``).

    Attributes:
        signum: the signal number; ``exit_code`` is ``128 + signum`` (130 for SIGINT,
            143 for SIGTERM), the shell convention for "killed by a signal".
    """

    def __init__(self, signum: int, message: str = ""):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(message or f"stopped by {signal_name(signum)}")


class ProtocolError(SealflError, ValueError):
    """A message record between partners and the aggregator cannot be encoded or decoded
    (:mod:`sealfl.common.protocol`)."""


class ProcessInfoError(SealflError, ValueError):
    """A ``/proc`` record does not have the documented layout (:mod:`sealfl.common.procs`)."""


def signal_name(signum: int) -> str:
    """``2`` -> ``"SIGINT"`` (``"signal N"`` for numbers without a name)."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for error messages about hostile
    input (a config may hold a 400-digit int or a megabyte string)."""
    r = repr(value)
    return r if len(r) <= limit else r[:max(limit - 3, 1)] + "..."


#: ECMA-48 control sequences (CSI ``ESC [ ... final``, OSC ``ESC ] ... BEL/ST``, two-byte ``ESC x``)
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def plain_text(text: str, limit: int = 2000) -> str:
    """Text another program wrote (a child's stderr, a tool's message), fit for a one-line
    refusal: terminal escape sequences (ECMA-48: colours, cursor moves, window titles) and
    other control characters removed, lines joined with `` | ``, cut to ``limit`` characters
    (the end kept: that is where the error is)."""
    lines = [ln.strip() for ln in _CONTROLS.sub("", _ESCAPES.sub("", str(text))).splitlines() if ln.strip()]
    out = " | ".join(lines)
    return out if len(out) <= limit else "..." + out[-(limit - 3):]


__getattr__ = moved_names_hook(__name__)  # names moved out of this module in 0.2 (sealfl._moved)
