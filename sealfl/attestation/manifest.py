"""Release manifests: per-file size + SHA-256 and one root digest.

A manifest (schema ``sealfl.manifest/v1``) is a JSON object::

    {"schema": "sealfl.manifest/v1", "name": str, "version": int in 0..2**31-1,
     "files": [{"path": str, "size": int (bytes), "sha256": hex}, ...],   # sorted by path
     "root_digest": hex, "metadata": {...}}   # free, except "model_file": a payload path

**Root digest (our definition).** ``SHA-256( concat over paths p in ascending
code-point order of  utf8(p) || 0x00 || sha256(file p) (32 raw bytes) )``, lowercase hex.
The NUL separator cannot occur in a valid path, and the digest part has a fixed length,
so the encoding is unambiguous. Sizes are not part of the root digest (the per-file
SHA-256 already fixes the size) but are checked before hashing so an oversized file is
refused early.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from sealfl.attestation.canonical import JSONFormatError, canonical_json, loads_strict
from sealfl.attestation.errors import ManifestError
from sealfl.common.fields import MAX_VERSION, Fields, is_sha256_hex

__all__ = [
    "SCHEMA",
    "MANIFEST_FILE",
    "MAX_NAME_LENGTH",
    "MAX_VERSION",
    "canonical_json",
    "validate_path",
    "root_digest",
    "build_manifest",
    "parse_manifest",
    "manifest_bytes",
    "is_sha256_hex",
    "check_file_entries",
    "check_name_version",
    "check_metadata",
]

SCHEMA = "sealfl.manifest/v1"
MANIFEST_FILE = "manifest.json"
#: Longest release name, in characters.
MAX_NAME_LENGTH = 256
_MAX_PATH_LENGTH = 255


def validate_path(path: Any) -> str:
    """Check one manifest path and return it.

    A valid path is a non-empty ``str`` of relative POSIX form of at most 255 characters:
    no absolute path (leading ``/``), no backslash, no NUL or other control character, no
    ``..``, ``.`` or empty segment.

    Raises:
        ManifestError: the path is invalid (the message names it).
    """
    if not isinstance(path, str) or not path:
        raise ManifestError(f"manifest path must be a non-empty string, got {path!r:.80}")
    if len(path) > _MAX_PATH_LENGTH:
        raise ManifestError(f"manifest path {path[:40]!r}... is longer than {_MAX_PATH_LENGTH} characters")
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


def check_name_version(name: Any, version: Any, fields: Fields | None = None, at: str = "") -> None:
    """Check a release name (non-empty str of at most :data:`MAX_NAME_LENGTH` characters) and
    version (int in ``0..MAX_VERSION``).

    Raises:
        ManifestError (or ``fields``' error): either is invalid; the message names the field.
    """
    fields = fields or Fields("release", ManifestError)
    fields.string(name, fields.join(at, "name"), max_len=MAX_NAME_LENGTH)
    fields.integer(version, fields.join(at, "version"), lo=0, hi=MAX_VERSION)


def check_metadata(metadata: Any, paths: set[str], fields: Fields, at: str = "metadata") -> dict:
    """Check signed free metadata: a JSON object whose only constrained field is
    ``model_file`` (optional; a string naming one of the payload ``paths``).

    Raises:
        the error of ``fields``: metadata is not an object, or ``model_file`` is not a string
            naming a payload file.
    """
    meta = fields.object(metadata, at)
    if "model_file" in meta:
        model = fields.string(meta["model_file"], fields.join(at, "model_file"))
        if model not in paths:
            raise fields.fail(fields.join(at, "model_file"),
                              f"names {model!r}, which is not a payload file of the release")
    return meta


def build_manifest(
    files: Mapping[str, bytes], name: str, version: int, metadata: dict | None = None
) -> dict:
    """Build a manifest dict for the payload ``files``.

    Args:
        files: ``{path: file bytes}`` of every payload file (not the metadata files).
        name: release name, e.g. ``"heart-mlp"``.
        version: release version, integer in ``0..2**31-1`` (monotonic; devices refuse older ones).
        metadata: free JSON-serialisable metadata (e.g. ``{"model_file": "model.int8.onnx"}``);
            ``model_file``, if present, must name one of ``files``.

    Returns:
        the manifest ``dict`` (schema ``sealfl.manifest/v1``), files sorted by path.

    Raises:
        ManifestError: no files, invalid path, invalid name/version, or metadata that is not
            a JSON object serialisable to canonical JSON.
    """
    check_name_version(name, version)
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
    check_metadata(meta, set(digests), Fields("metadata", ManifestError), at="")
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


def check_file_entries(entries: Any, fields: Fields | None = None, at: str = "files") -> list[dict]:
    """Validate a manifest/predicate ``files`` list and return it.

    Each entry must be exactly ``{"path", "size", "sha256"}`` with a valid path, an int
    size in ``0..2**63-1`` and a 64-hex digest; paths must be unique and sorted ascending.

    Raises:
        ManifestError (or ``fields``' error): on the first violation, naming the field.
    """
    fields = fields or Fields(MANIFEST_FILE, ManifestError)
    fields.array(entries, at, nonempty=True)
    previous = None
    for i, entry in enumerate(entries):
        here = fields.join(at, i)
        fields.object(entry, here)
        fields.only(entry, ("path", "size", "sha256"), here)
        path = fields.get(entry, "path", "string", here, max_len=_MAX_PATH_LENGTH)
        try:
            validate_path(path)
        except ManifestError as exc:
            raise fields.fail(fields.join(here, "path"), str(exc)) from exc
        fields.get(entry, "size", "integer", here, lo=0, hi=2**63 - 1)
        fields.get(entry, "sha256", "hex64", here)
        if previous is not None and path <= previous:
            raise fields.fail(fields.join(here, "path"),
                              f"entries must be sorted by path and unique ({previous!r} then {path!r})")
        previous = path
    return entries


def parse_manifest(data: bytes) -> dict:
    """Parse and validate ``manifest.json`` bytes; return the manifest dict.

    Checks schema, exact key set, the type and range of every field (name, version in
    ``0..2**31-1``, the file list -- see :func:`check_file_entries` --, metadata and its
    ``model_file``) and that ``root_digest`` equals the root digest recomputed from the
    listed digests.

    Raises:
        ManifestError: on any violation (the message names the field).
    """
    try:
        obj = loads_strict(data)
    except JSONFormatError as exc:
        raise ManifestError(f"{MANIFEST_FILE} is not strict JSON: {exc}") from exc
    fields = Fields(MANIFEST_FILE, ManifestError)
    expected_keys = ("schema", "name", "version", "files", "root_digest", "metadata")
    for key in expected_keys:
        if key not in obj:
            raise fields.fail(key, "is missing")
    fields.only(obj, expected_keys)
    if obj["schema"] != SCHEMA:
        raise fields.fail("schema", f"must be {SCHEMA!r}, got {obj['schema']!r:.80}")
    check_name_version(obj["name"], obj["version"], fields)
    entries = check_file_entries(obj["files"], fields)
    check_metadata(obj["metadata"], {e["path"] for e in entries}, fields)
    fields.get(obj, "root_digest", "hex64")
    recomputed = root_digest({e["path"]: e["sha256"] for e in entries})
    if obj["root_digest"] != recomputed:
        raise fields.fail("root_digest", f"is {obj['root_digest']!r}, but the listed digests give {recomputed!r}")
    return obj
