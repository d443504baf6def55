"""Typed access to the fields of trusted JSON documents -- sealfl's one field checker.

Every document sealfl trusts (policy.json, manifest.json, the in-toto statement, the DSSE
envelope, attestation.json and its quote, the device's state.json, enclave.json, SimTEE's
tee.json and pcrs.json) is read through a :class:`Fields` reader: each field is checked for
its JSON type and range *before* it is used, and a failure raises the document's own
package error with a message naming the file and the field path, e.g.
``policy.json: field 'allowed_backends[0]' must be a string, got array``. No ``TypeError``,
``KeyError`` or ``AttributeError`` reaches a caller.

Field paths use ``.`` between object keys and ``[i]`` for array items
(``predicate.files[1].size``).

The same checker reads every other value that comes from outside: partners' replies
(:mod:`sealfl.server.validation`), OpenAI requests
(:mod:`sealfl.enclave.device.serve.openai_api`), canaries, campaign files and the release
register. Where the caller's error carries the field and a code separately (a reply's
``ReplyError(field, reason)``, an API error's ``param`` and ``code``), :class:`Fields` is made
with ``detailed=True`` and calls ``error(path, problem, code)``; ``code`` is ``"missing"``,
``"invalid_type"``, ``"out_of_range"`` or ``"invalid_value"``.

Versions everywhere are integers in ``0 ..`` :data:`MAX_VERSION` (2**31 - 1, the largest
signed 32-bit integer): enough for any release cadence, representable in every JSON
implementation (RFC 8259 §6 notes interoperability only within IEEE 754 doubles) and in a
signed 32-bit field of any device runtime, so a signed release cannot push a device's
rollback floor out of reach.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Collection
from typing import Any

from sealfl.common.errors import short_repr

__all__ = ["MAX_VERSION", "Fields", "is_sha256_hex", "json_type"]

MAX_VERSION = 2**31 - 1
_HEX64 = re.compile(r"\A[0-9a-f]{64}\Z")
_MISSING: Any = object()


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))


def json_type(value: Any) -> str:
    """The JSON type name of a parsed value, for messages (``"object"``, ``"array"``,
    ``"string"``, ``"integer"``, ``"number"``, ``"boolean"``, ``"null"``; a Python type's
    name otherwise). ``bool`` is tested before ``int``: ``True`` is an ``int`` in Python."""
    if value is None:
        return "null"
    return next((name for kind, name in _JSON_TYPES if isinstance(value, kind)), type(value).__name__)


def _got(value: Any) -> str:
    """What a refused value was, for messages: its JSON type, and for a scalar its value
    (cut short: a hostile value may be a megabyte string or a 400-digit integer)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return f"boolean {str(bool(value)).lower()}"
    if isinstance(value, (numbers.Number, str)):
        kind = json_type(value) if isinstance(value, (int, float, str)) else type(value).__name__
        shown = short_repr(value, 40) if isinstance(value, str) else short_repr(_plain(value), 40)
        return f"{kind} {shown}"
    return json_type(value)


def _plain(value: Any) -> Any:
    try:
        return value.item()  # numpy scalars print as plain numbers
    except AttributeError:
        return value


def is_sha256_hex(value: Any) -> bool:
    """True iff ``value`` is a ``str`` of exactly 64 lowercase hex digits."""
    return isinstance(value, str) and _HEX64.match(value) is not None


class Fields:
    """Checked field access for one document.

    Args:
        file: the document's name for messages (e.g. ``"policy.json"``).
        error: builds the exception to raise from a message (the document's package error,
            e.g. :class:`~sealfl.attestation.errors.TrustAnchorError`).

    Every checker returns the value unchanged when it is valid and raises
    ``error("<file>: field '<path>' <problem>")`` otherwise.
    """

    def __init__(self, file: str, error: Callable[..., Exception], *, detailed: bool = False) -> None:
        self.file = file
        self.error = error
        self.detailed = detailed

    # -- building blocks -------------------------------------------------------------

    def fail(self, path: str, problem: str, code: str = "invalid_value") -> Exception:
        """The error for ``path`` (returned, so callers ``raise fields.fail(...)``):
        ``error("<file>: field '<path>' <problem>")``, or with ``detailed`` ``error(path,
        problem, code)``."""
        if self.detailed:
            return self.error(path, problem, code)
        where = f"field {path!r}" if path else "document"
        return self.error(f"{self.file}: {where} {problem}")

    @staticmethod
    def join(at: str, key: str | int) -> str:
        """Path of ``key`` inside the value at path ``at``."""
        if isinstance(key, int):
            return f"{at}[{key}]"
        return f"{at}.{key}" if at else key

    def get(self, parent: dict, key: str, kind: str, at: str = "", *, default: Any = _MISSING,
            **options: Any) -> Any:
        """Check ``parent[key]`` with the checker named ``kind`` (``"string"``, ``"integer"``, ...).

        Args:
            parent: an object already checked with :meth:`object`.
            key: the field name.
            kind: one of ``object array string integer number boolean hex64 choice``.
            at: path of ``parent``.
            default: returned when the field is absent; without it the field is required.
            options: passed to the checker (e.g. ``lo``/``hi`` for integers).

        Raises:
            the document's error: the field is missing (and required) or fails its checker.
        """
        path = self.join(at, key)
        if key not in parent:
            if default is not _MISSING:
                return default
            raise self.fail(path, "is missing", "missing")
        return getattr(self, kind)(parent[key], path, **options)

    def only(self, obj: dict, allowed: Collection[str], at: str = "") -> None:
        """Refuse fields of ``obj`` not in ``allowed`` (documents where an unknown field could
        be a restriction this reader would silently ignore)."""
        unknown = sorted(set(obj) - set(allowed))
        if unknown:
            raise self.fail(self.join(at, unknown[0]), f"is not a known field (known: {sorted(allowed)}); "
                            "the document was written by a newer or foreign tool")

    # -- checkers ----------------------------------------------------------------------

    def object(self, value: Any, path: str, *, nonempty: bool = False) -> dict:
        """``value`` must be a JSON object (non-empty if ``nonempty``)."""
        if not isinstance(value, dict):
            raise self.fail(path, f"must be an object, got {_got(value)}", "invalid_type")
        if nonempty and not value:
            raise self.fail(path, "must be a non-empty object")
        return value

    def array(self, value: Any, path: str, *, nonempty: bool = False, max_len: int | None = None) -> list:
        """``value`` must be a JSON array (non-empty if ``nonempty``; at most ``max_len`` items)."""
        if not isinstance(value, list):
            raise self.fail(path, f"must be an array, got {_got(value)}", "invalid_type")
        if nonempty and not value:
            raise self.fail(path, "must be a non-empty array")
        if max_len is not None and len(value) > max_len:
            raise self.fail(path, f"has {len(value)} items, more than the limit of {max_len}", "out_of_range")
        return value

    def string(self, value: Any, path: str, *, nonempty: bool = True, max_len: int = 4096) -> str:
        """``value`` must be a string (non-empty if ``nonempty``; at most ``max_len`` characters)."""
        if not isinstance(value, str):
            raise self.fail(path, f"must be a string, got {_got(value)}", "invalid_type")
        if nonempty and not value:
            raise self.fail(path, "must be a non-empty string")
        if len(value) > max_len:
            raise self.fail(path, f"is {len(value)} characters long, more than the limit of {max_len}", "out_of_range")
        return value

    def integer(self, value: Any, path: str, *, lo: int = 0, hi: int = MAX_VERSION) -> int:
        """``value`` must be an integer (a Python or NumPy integer; not a boolean, not a float
        such as ``1.0``) in ``lo..hi``; returned as a Python ``int``."""
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or type(value).__name__ == "bool_":
            raise self.fail(path, f"must be an integer, got {_got(value)}", "invalid_type")
        v = int(value)
        if not lo <= v <= hi:
            raise self.fail(path, f"must be in {lo}..{hi}, got {short_repr(v, 40)}", "out_of_range")
        return v

    def number(self, value: Any, path: str, *, lo: float = -math.inf, hi: float = math.inf,
               lo_open: bool = False, hi_open: bool = False) -> float:
        """``value`` must be a finite real number (an integer or a float, Python or NumPy; not a
        boolean, NaN or an infinity) in ``[lo, hi]`` (``(`` / ``)`` with ``lo_open`` /
        ``hi_open``); returned as a Python ``float``."""
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or type(value).__name__ == "bool_":
            raise self.fail(path, f"must be a number, got {_got(value)}", "invalid_type")
        try:
            v = float(value)
        except OverflowError:
            v = math.inf
        if not math.isfinite(v):
            raise self.fail(path, f"must be a finite number, got {_got(value)}", "out_of_range")
        if v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
            bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            raise self.fail(path, f"must lie in {bounds}, got {short_repr(_plain(value), 40)}", "out_of_range")
        return v

    def boolean(self, value: Any, path: str) -> bool:
        """``value`` must be ``true`` or ``false``."""
        if not isinstance(value, bool):
            raise self.fail(path, f"must be true or false, got {_got(value)}", "invalid_type")
        return value

    def hex64(self, value: Any, path: str) -> str:
        """``value`` must be 64 lowercase hex digits (a SHA-256 digest)."""
        if not is_sha256_hex(value):
            shown = json_type(value) if not isinstance(value, str) else f"{value[:80]!r}"
            raise self.fail(path, f"must be 64 lowercase hex digits (SHA-256), got {shown}", "invalid_value")
        return value

    def choice(self, value: Any, path: str, *, choices: Collection[Any]) -> Any:
        """``value`` must be a string equal to one of ``choices``."""
        self.string(value, path)
        if value not in choices:
            raise self.fail(path, f"must be one of {sorted(choices)}, got {short_repr(value, 60)}", "invalid_value")
        return value
