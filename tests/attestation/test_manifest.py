"""Manifests, root digest, canonical JSON and the in-toto statement."""

from __future__ import annotations

import hashlib
import json

import pytest

from sealfl.attestation.canonical import JSONFormatError, canonical_json, loads_strict
from sealfl.attestation.errors import ManifestError, StatementError
from sealfl.attestation.manifest import build_manifest, manifest_bytes, parse_manifest, root_digest
from sealfl.attestation.statement import (
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    build_statement,
    parse_statement,
    statement_bytes,
)

FILES = {"model.int8.onnx": b"\x08\x09onnx-bytes", "b/labels.json": b"{}", "a.txt": b""}


def _independent_root(files: dict[str, bytes]) -> str:
    """Root digest recomputed here from its written definition, with hashlib only."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\x00" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()


def test_root_digest_equals_independent_recomputation():
    manifest = build_manifest(FILES, "heart", 7, {"model_file": "model.int8.onnx"})
    assert manifest["root_digest"] == _independent_root(FILES)
    assert root_digest({p: hashlib.sha256(d).hexdigest() for p, d in FILES.items()}) == _independent_root(FILES)
    assert [f["path"] for f in manifest["files"]] == ["a.txt", "b/labels.json", "model.int8.onnx"]
    entry = manifest["files"][2]
    assert entry == {"path": "model.int8.onnx", "size": len(FILES["model.int8.onnx"]),
                     "sha256": hashlib.sha256(FILES["model.int8.onnx"]).hexdigest()}
    assert manifest["schema"] == "sealfl.manifest/v1" and manifest["version"] == 7


def test_root_digest_changes_with_any_byte_or_name():
    base = _independent_root(FILES)
    assert build_manifest({**FILES, "a.txt": b"x"}, "n", 1)["root_digest"] != base
    renamed = {("c.txt" if k == "a.txt" else k): v for k, v in FILES.items()}
    assert build_manifest(renamed, "n", 1)["root_digest"] != base


@pytest.mark.parametrize("bad", ["../x", "a/../b", "/etc/passwd", "a\\b", "", "a//b", "./a", "a\x00b"])
def test_bad_paths_rejected(bad):
    with pytest.raises(ManifestError):
        build_manifest({bad: b"x"}, "n", 1)


@pytest.mark.parametrize("version", [-1, True, 1.5, "3"])
def test_bad_versions_rejected(version):
    with pytest.raises(ManifestError):
        build_manifest(FILES, "n", version)


def test_canonical_json_and_strict_parsing():
    assert canonical_json({"b": 1, "a": [1, "é"]}) == '{"a":[1,"é"],"b":1}'.encode("utf-8")
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    with pytest.raises(JSONFormatError, match="duplicate"):
        loads_strict(b'{"a":1,"a":2}')
    with pytest.raises(JSONFormatError):
        loads_strict(b'{"a":NaN}')
    with pytest.raises(JSONFormatError):
        loads_strict(b"[1]")
    with pytest.raises(JSONFormatError):
        loads_strict(b'{"a":"\xff"}')


def test_parse_manifest_round_trip_and_tamper():
    manifest = build_manifest(FILES, "heart", 2, {"k": "v"})
    assert parse_manifest(manifest_bytes(manifest)) == manifest
    edited = json.loads(manifest_bytes(manifest))
    edited["files"][0]["sha256"] = "0" * 64
    with pytest.raises(ManifestError, match="root_digest"):
        parse_manifest(json.dumps(edited).encode())
    unsorted = json.loads(manifest_bytes(manifest))
    unsorted["files"].reverse()
    with pytest.raises(ManifestError, match="sorted"):
        parse_manifest(json.dumps(unsorted).encode())
    extra_key = dict(manifest, surprise=1)
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(extra_key).encode())


def test_statement_build_and_parse():
    manifest = build_manifest(FILES, "heart", 2, {"k": "v"})
    statement = build_statement(manifest)
    assert statement["_type"] == "https://in-toto.io/Statement/v1" == STATEMENT_TYPE
    assert statement["predicateType"] == PREDICATE_TYPE
    assert statement["subject"] == [{"name": "heart", "digest": {"sha256": _independent_root(FILES)}}]
    parsed = parse_statement(statement_bytes(statement))
    assert (parsed.name, parsed.version, parsed.root_digest) == ("heart", 2, manifest["root_digest"])
    assert parsed.files == manifest["files"] and parsed.metadata == {"k": "v"}
    for mutate in (lambda s: s.update(_type="https://in-toto.io/Statement/v0.1"),
                   lambda s: s.update(predicateType="https://slsa.dev/provenance/v1"),
                   lambda s: s["subject"].append(s["subject"][0]),
                   lambda s: s["subject"][0].update(name="other"),
                   lambda s: s["predicate"].update(version=-1)):
        bad = json.loads(statement_bytes(statement))
        mutate(bad)
        with pytest.raises(StatementError):
            parse_statement(json.dumps(bad).encode())
