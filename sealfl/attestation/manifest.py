"""Release manifests: per-file size + SHA-256 and one root digest.

A manifest (schema ``sealfl.manifest/v1``) is a JSON object::

    {"schema": "sealfl.manifest/v1", "name": str, "version": int >= 0,
     "files": [{"path": str, "size": int (bytes), "sha256": hex}, ...],   # sorted by path
     "root_digest": hex, "metadata": {...}}

**Root digest (our definition).** ``SHA-256( concat over paths p in ascending
code-point order of  utf8(p) || 0x00 || sha256(file p) (32 raw bytes) )``, lowercase hex.
The NUL separator cannot occur in a valid path, and the digest part has a fixed length,
so the encoding is unambiguous. Sizes are not part of the root digest (the per-file
SHA-256 already fixes the size) but are checked before hashing so an oversized file is
refused early.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from .canonical import JSONFormatError, canonical_json, loads_strict
from .errors import ManifestError

__all__ = [
    "SCHEMA",
    "canonical_json",
    "validate_path",
    "root_digest",
    "build_manifest",
    "parse_manifest",
    "manifest_bytes",
    "is_sha256_hex",
    "check_file_entries",
]

SCHEMA = "sealfl.manifest/v1"
_HEX64 = re.compile(r"\A[0-9a-f]{64}\Z")


def is_sha256_hex(value: Any) -> bool:
    """True iff ``value`` is a ``str`` of exactly 64 lowercase hex digits."""
    return isinstance(value, str) and _HEX64.match(value) is not None


def validate_path(path: Any) -> str:
    """Check one manifest path and return it.

    A valid path is a non-empty ``str`` of relative POSIX form: no absolute path
    (leading ``/``), no backslash, no NUL or other control character, no ``..``, ``.`` or
    empty segment.

    Raises:
        ManifestError: the path is invalid (the message names it).
    """
    if not isinstance(path, str) or not path:
        raise ManifestError(f"manifest path must be a non-empty string, got {path!r}")
    if path.startswith("/"):
        raise ManifestError(f"manifest path {path!r} is absolute; use a path relative to the release dir")
    if "\\" in path:
        raise ManifestError(f"manifest path {path!r} contains a backslash; use '/' separators")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise ManifestError(f"manifest path {path!r} contains a control character")
    for segment in path.split("/"):
        if segment in ("", ".", ".."):
            raise ManifestError(f"manifest path {path!r} has an empty, '.' or '..' segment")
    return path


def root_digest(digests: Mapping[str, str]) -> str:
    """Compute the root digest over ``{path: sha256 hex}`` (see module docstring).

    Args:
        digests: mapping from manifest path to lowercase hex SHA-256 of the file bytes.

    Returns:
        lowercase hex SHA-256 (64 chars).

    Raises:
        ManifestError: a path is invalid or a digest is not 64 lowercase hex digits.
    """
    h = hashlib.sha256()
    for path in sorted(digests):
        validate_path(path)
        digest = digests[path]
        if not is_sha256_hex(digest):
            raise ManifestError(f"digest of {path!r} is not 64 lowercase hex digits: {digest!r}")
        h.update(path.encode("utf-8") + b"\0" + bytes.fromhex(digest))
    return h.hexdigest()


def _check_name_version(name: Any, version: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ManifestError(f"release name must be a non-empty string, got {name!r}")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ManifestError(f"release version must be an integer >= 0, got {version!r}")


def build_manifest(
    files: Mapping[str, bytes], name: str, version: int, metadata: dict | None = None
) -> dict:
    """Build a manifest dict for the payload ``files``.

    Args:
        files: ``{path: file bytes}`` of every payload file (not the metadata files).
        name: release name, e.g. ``"heart-mlp"``.
        version: release version, integer >= 0 (monotonic; devices refuse older ones).
        metadata: free JSON-serialisable metadata (e.g. ``{"model_file": "model.int8.onnx"}``).

    Returns:
        the manifest ``dict`` (schema ``sealfl.manifest/v1``), files sorted by path.

    Raises:
        ManifestError: no files, invalid path, invalid name/version, or metadata that is not
            a JSON object serialisable to canonical JSON.
    """
    _check_name_version(name, version)
    if not files:
        raise ManifestError("a release needs at least one payload file")
    entries = []
    digests: dict[str, str] = {}
    for path in sorted(files):
        validate_path(path)
        data = files[path]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ManifestError(f"content of {path!r} must be bytes, got {type(data).__name__}")
        digest = hashlib.sha256(data).hexdigest()
        digests[path] = digest
        entries.append({"path": path, "size": len(data), "sha256": digest})
    meta = {} if metadata is None else metadata
    if not isinstance(meta, dict):
        raise ManifestError(f"metadata must be a dict, got {type(meta).__name__}")
    try:
        canonical_json(meta)
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"metadata is not JSON-serialisable: {exc}") from exc
    return {
        "schema": SCHEMA,
        "name": name,
        "version": version,
        "files": entries,
        "root_digest": root_digest(digests),
        "metadata": dict(meta),
    }


def manifest_bytes(manifest: dict) -> bytes:
    """Serialise a manifest to the bytes written as ``manifest.json`` (canonical JSON + ``\\n``)."""
    return canonical_json(manifest) + b"\n"


def check_file_entries(entries: Any) -> list[dict]:
    """Validate a manifest/predicate ``files`` list and return it.

    Each entry must be exactly ``{"path", "size", "sha256"}`` with a valid path, an int
    size >= 0 and a 64-hex digest; paths must be unique and sorted ascending.

    Raises:
        ManifestError: on the first violation.
    """
    if not isinstance(entries, list) or not entries:
        raise ManifestError("'files' must be a non-empty list")
    previous = None
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"path", "size", "sha256"}:
            raise ManifestError(f"file entry must have exactly path/size/sha256, got {entry!r}")
        path = validate_path(entry["path"])
        size = entry["size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"size of {path!r} must be an integer >= 0, got {size!r}")
        if not is_sha256_hex(entry["sha256"]):
            raise ManifestError(f"sha256 of {path!r} is not 64 lowercase hex digits")
        if previous is not None and path <= previous:
            raise ManifestError(f"file entries must be sorted by path and unique ({previous!r} then {path!r})")
        previous = path
    return entries


def parse_manifest(data: bytes) -> dict:
    """Parse and validate ``manifest.json`` bytes; return the manifest dict.

    Checks schema, exact key set, name/version types, the file list (see
    :func:`check_file_entries`) and that ``root_digest`` equals the root digest recomputed
    from the listed digests.

    Raises:
        ManifestError: on any violation (message says which).
    """
    try:
        obj = loads_strict(data)
    except JSONFormatError as exc:
        raise ManifestError(f"manifest is not strict JSON: {exc}") from exc
    expected_keys = {"schema", "name", "version", "files", "root_digest", "metadata"}
    if set(obj) != expected_keys:
        raise ManifestError(f"manifest keys must be {sorted(expected_keys)}, got {sorted(obj)}")
    if obj["schema"] != SCHEMA:
        raise ManifestError(f"manifest schema must be {SCHEMA!r}, got {obj['schema']!r}")
    _check_name_version(obj["name"], obj["version"])
    if not isinstance(obj["metadata"], dict):
        raise ManifestError("manifest metadata must be an object")
    entries = check_file_entries(obj["files"])
    recomputed = root_digest({e["path"]: e["sha256"] for e in entries})
    if obj["root_digest"] != recomputed:
        raise ManifestError(
            f"manifest root_digest {obj['root_digest']!r} != recomputed {recomputed!r}"
        )
    return obj
