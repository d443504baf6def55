"""Canonical JSON, strict JSON parsing and strict Base64 for everything sealfl signs or verifies.

Our canonical form (used for quote signatures and for the bytes of every signed
document we emit): ``json.dumps(obj, sort_keys=True, separators=(",", ":"),
ensure_ascii=False, allow_nan=False)`` encoded as UTF-8. It is *not* RFC 8785 (JCS);
it is stable for the value types we sign (str, int, bool, None, lists, dicts with str
keys; floats only in free metadata). DSSE signatures cover the exact payload bytes, so
verifiers never need to re-canonicalise a DSSE payload.

Strict parsing rejects what lets two parsers disagree about a signed document:
duplicate object keys, NaN/Infinity, invalid UTF-8, a string that is not Unicode text (an
unpaired surrogate written as ``"\ud800"``: I-JSON, RFC 7493 §2.1; such a string cannot be
encoded, tokenised or signed), and a top-level value that is not an object.

Strict Base64 (:func:`b64decode_strict`) gives every byte string exactly one text: the
standard alphabet of RFC 4648 §4 only (no URL-safe ``-``/``_``, no whitespace or other
characters), canonical padding (RFC 4648 §3.2: ``=`` padding present, §3.5: pad bits
zero). A text is accepted only if re-encoding the decoded bytes gives the same text.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable
from typing import Any

from sealfl.attestation.errors import FormatError
from sealfl.common.fields import Fields, json_type

__all__ = ["canonical_json", "loads_strict", "parse_object", "load_document", "json_type", "b64decode_strict",
           "JSONFormatError"]

_B64_STANDARD = re.compile(r"\A(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?\Z")


class JSONFormatError(FormatError):
    """Raised by :func:`loads_strict` when bytes are not one strict JSON object.

    Attributes:
        path: the field path of the offending value (``messages[0].content``) when one
            value is at fault, else None.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


#: a JSON escape of a UTF-16 surrogate (only ``\uD800``..``\uDFFF`` escapes can make one:
#: the UTF-8 decoder refuses encoded surrogates)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _not_text(value: str) -> bool:
    try:
        value.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _lone_surrogate(obj: Any, path: str) -> str | None:
    """Path of the first key or string holding an unpaired surrogate, else None."""
    if isinstance(obj, str):
        return path if _not_text(obj) else None
    if isinstance(obj, dict):
        for key, value in obj.items():
            at = Fields.join(path, key) if not _not_text(key) else None
            if at is None:
                return Fields.join(path, key.encode("utf-8", "replace").decode("utf-8"))
            found = _lone_surrogate(value, at)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found = _lone_surrogate(value, Fields.join(path, i))
            if found is not None:
                return found
    return None


def b64decode_strict(text: Any, what: str) -> bytes:
    """Decode standard, canonically padded Base64 (RFC 4648 §4, §3.2, §3.5); see module docstring.

    Args:
        text: the Base64 text (a ``str`` from a parsed JSON document).
        what: names the field in messages, e.g. ``"manifest.dsse.json: field 'payload'"``.

    Returns:
        the decoded bytes (``b""`` for ``""``).

    Raises:
        FormatError: not a string, a character outside the standard alphabet (including
            URL-safe ``-``/``_`` and whitespace), missing or extra padding, or non-zero pad bits.
    """
    if not isinstance(text, str):
        raise FormatError(f"{what} must be a Base64 string, got {json_type(text)}")
    if not _B64_STANDARD.match(text):
        raise FormatError(f"{what} is not standard Base64 with canonical '=' padding (RFC 4648 §4); "
                          "URL-safe characters, whitespace and missing padding are refused")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError) as exc:  # unreachable after the pattern; kept as a guard
        raise FormatError(f"{what} is not valid Base64: {exc}") from exc
    if base64.b64encode(data).decode("ascii") != text:
        raise FormatError(f"{what} is not canonical Base64: its pad bits are not zero (RFC 4648 §3.5)")
    return data


def canonical_json(obj: Any) -> bytes:
    """Serialise ``obj`` to canonical JSON bytes (sorted keys, no whitespace, UTF-8).

    Args:
        obj: a JSON-serialisable value (dict keys must be ``str``).

    Returns:
        ``bytes`` of UTF-8 encoded JSON.

    Raises:
        ValueError: ``obj`` contains NaN or infinity.
        TypeError: ``obj`` contains a non-JSON type (bytes, set, numpy scalar, ...).
    """
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JSONFormatError(f"duplicate JSON object key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise JSONFormatError(f"JSON constant {name} is not allowed")


def loads_strict(data: bytes) -> dict[str, Any]:
    """Parse ``data`` as one strict UTF-8 JSON object.

    Args:
        data: raw bytes (not ``str``), e.g. a file's content or a DSSE payload.

    Returns:
        the parsed top-level ``dict``.

    Raises:
        JSONFormatError: invalid UTF-8, invalid JSON, nesting too deep, duplicate keys,
            NaN/Infinity, a string or key with an unpaired surrogate (``.path`` names it),
            or a top-level value that is not an object.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise JSONFormatError(f"expected bytes, got {type(data).__name__}")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONFormatError(f"not valid UTF-8: {exc}") from exc
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except JSONFormatError:
        raise
    except ValueError as exc:
        raise JSONFormatError(f"not valid JSON: {exc}") from exc
    except RecursionError as exc:  # e.g. 100k nested '[': json's C decoder recurses
        raise JSONFormatError("JSON nested too deeply") from exc
    if not isinstance(obj, dict):
        raise JSONFormatError(f"top-level JSON value must be an object, got {type(obj).__name__}")
    if _SURROGATE_ESCAPE.search(text):  # rare: walk only when an escape could have made one
        where = _lone_surrogate(obj, "")
        if where is not None:
            raise JSONFormatError(f"the string at {where!r} is not valid Unicode (an unpaired UTF-16 surrogate "
                                  "escape such as \\ud800); send text that is valid UTF-8", path=where)
    return obj


def parse_object(data: bytes, fields: Fields, hint: str = "") -> dict[str, Any]:
    """``data`` as one strict JSON object (:func:`loads_strict`), refused through ``fields``
    (so with its document's name and error type); ``hint`` says what to do."""
    try:
        return loads_strict(data)
    except JSONFormatError as exc:
        raise fields.fail("", f"is not strict JSON: {exc}" + (f"; {hint}" if hint else "")) from exc


def load_document(data: bytes, what: str, field: str, expected: str,
                  error: Callable[[str], Exception]) -> dict[str, Any]:
    """Parse ``data`` with :func:`loads_strict` and require ``doc[field] == expected``.

    ``what`` names the document in messages (e.g. ``"attestation"``); ``error`` builds the
    exception to raise (the caller's own error type).

    Raises:
        whatever ``error`` builds: not strict JSON, or the type/schema field is wrong.
    """
    try:
        doc = loads_strict(data)
    except JSONFormatError as exc:
        raise error(f"{what} is not strict JSON: {exc}") from exc
    if doc.get(field) != expected:
        raise error(f"{what} {field} must be {expected!r}, got {doc.get(field)!r}")
    return doc
