"""The device's parsers of untrusted update input, fuzzed with hypothesis: the release index,
a target's claim, the update choice, and python-tuf's metadata parsing as the updater runs
it (the trusted metadata set over mutated bytes of a real repository's timestamp)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tuf.api import exceptions as tuf_exc
from tuf.ngclient._internal.trusted_metadata_set import TrustedMetadataSet
from tuf.ngclient.config import EnvelopeType

from sealfl.attestation.repo_index import (
    INDEX_SCHEMA,
    IndexedRelease,
    RepoIndexError,
    check_claims,
    check_target_custom,
    choose_update,
    custom_of,
    index_bytes,
    parse_index,
)

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
                     max_leaves=20)
_names = st.from_regex(r"[a-z][a-z0-9._-]{0,10}", fullmatch=True)
_digest = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
_release = st.builds(IndexedRelease, _names, st.integers(0, 2**31 - 1), _digest,
                     st.lists(st.from_regex(r"[a-z][a-z0-9._-]{0,12}", fullmatch=True), min_size=1, max_size=5,
                              unique=True).map(tuple))

GOOD = {"schema": INDEX_SCHEMA, "releases": [{"name": "heart", "version": 3, "root_digest": "ab" * 32,
                                               "files": ["model.onnx", "manifest.json"]}]}


def test_good_index_parses_to_what_was_written():
    rel = parse_index(json.dumps(GOOD).encode())
    assert rel == (IndexedRelease("heart", 3, "ab" * 32, ("model.onnx", "manifest.json")),)
    assert rel[0].target("model.onnx") == "releases/heart/3/model.onnx"


@pytest.mark.parametrize("field,value,msg", [
    ("name", "../x", "name"), ("name", "", "name"), ("version", True, "version"), ("version", -1, "version"),
    ("version", 2**31, "version"), ("root_digest", "AB" * 32, "root_digest"), ("files", [], "files"),
    ("files", ["a/b"], "plain file name"), ("files", [".hidden"], "plain file name"),
    ("files", ["..", "a"], "plain file name"), ("files", ["a", "a"], "twice"), ("extra", 1, "exactly")])
def test_index_field_refusals_name_the_field(field, value, msg):
    doc = json.loads(json.dumps(GOOD))
    doc["releases"][0][field] = value
    with pytest.raises(RepoIndexError, match=msg):
        parse_index(json.dumps(doc).encode())


def test_index_refuses_duplicates_wrong_schema_and_oversize():
    doc = json.loads(json.dumps(GOOD))
    doc["releases"].append(doc["releases"][0])
    with pytest.raises(RepoIndexError, match="listed twice"):
        parse_index(json.dumps(doc).encode())
    with pytest.raises(RepoIndexError, match="schema"):
        parse_index(json.dumps({**GOOD, "schema": "x"}).encode())
    with pytest.raises(RepoIndexError, match="bytes, more than"):
        parse_index(b" " * ((1 << 20) + 1))
    with pytest.raises(RepoIndexError, match="UTF-8 JSON"):
        parse_index(b"[" * 100000)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_index_bytes_only_refuse_by_type(data):
    try:
        parse_index(data)
    except RepoIndexError:
        pass


@settings(max_examples=150, deadline=None)
@given(_json, st.sampled_from(["name", "version", "root_digest", "files", "schema", "releases"]))
def test_fuzz_index_fields_only_refuse_by_type(value, field):
    doc = json.loads(json.dumps(GOOD))
    if field in ("schema", "releases"):
        doc[field] = value
    else:
        doc["releases"][0][field] = value
    try:
        out = parse_index(json.dumps(doc).encode())
    except RepoIndexError:
        return
    # accepted only if every field is of the documented shape
    for r in out:
        assert isinstance(r.version, int) and 0 <= r.version < 2**31 and len(r.root_digest) == 64
        assert all("/" not in f and not f.startswith(".") for f in r.files)


@settings(max_examples=100, deadline=None)
@given(st.lists(_release, max_size=6))
def test_index_round_trip(releases):
    unique = {(r.name, r.version): r for r in releases}.values()
    want = sorted((IndexedRelease(r.name, r.version, r.root_digest, tuple(sorted(r.files))) for r in unique),
                  key=lambda r: (r.name, r.version))
    assert list(parse_index(index_bytes(unique))) == want


@settings(max_examples=150, deadline=None)
@given(st.lists(_release, max_size=6), st.one_of(st.none(), st.integers(0, 2**31 - 1)), _digest)
def test_choose_update_never_goes_back(releases, running, running_root):
    releases = [IndexedRelease("m", r.version, r.root_digest, r.files) for r in releases]
    try:
        choice = choose_update(releases, "m", running, running_root if running is not None else None)
    except RepoIndexError:
        newest = max(r.version for r in releases)
        assert running is not None and (newest < running or (newest == running and any(
            r.root_digest != running_root for r in releases if r.version == newest)))
        return
    if not releases:
        assert choice.action == "none"
    elif choice.action == "install":
        assert running is None or choice.release.version > running
        assert choice.release.version == max(r.version for r in releases)
    else:
        assert choice.action == "current" and choice.release.version == running
        assert choice.release.root_digest == running_root


@settings(max_examples=100, deadline=None)
@given(_json)
def test_fuzz_target_claim(custom):
    rel = IndexedRelease("m", 4, "cd" * 32, ("a",))
    try:
        check_target_custom(rel, "a", custom)
    except RepoIndexError:
        return
    assert custom == custom_of("m", 4, "cd" * 32)


def test_claims_must_match_the_verified_release():
    rel = IndexedRelease("m", 4, "cd" * 32, ("a",))
    check_claims(rel, "m", 4, "cd" * 32)
    for got in (("other", 4, "cd" * 32), ("m", 5, "cd" * 32), ("m", 4, "ef" * 32)):
        with pytest.raises(RepoIndexError, match="wrong software"):
            check_claims(rel, *got)


@pytest.fixture(scope="module")
def tuf_repo(tmp_path_factory):
    from tests.support.tufrepo import make_repo

    repo = make_repo(tmp_path_factory.mktemp("tuf"))
    return repo.root_bytes(1), (repo.metadata_dir / "timestamp.json").read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_timestamp_bytes_through_the_trusted_metadata_set(tuf_repo, data):
    """Mutated timestamp bytes: python-tuf's trusted set (what ``Updater.refresh`` runs) either
    accepts the original document or raises one of its RepositoryError types -- never
    anything else, never an accepted forgery."""
    root, ts = tuf_repo
    pos = data.draw(st.integers(0, len(ts) - 1))
    kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
    if kind == "flip":
        mutated = ts[:pos] + bytes([ts[pos] ^ data.draw(st.integers(1, 255))]) + ts[pos + 1:]
    elif kind == "cut":
        mutated = ts[:pos]
    else:
        mutated = ts[:pos] + data.draw(st.binary(min_size=1, max_size=8)) + ts[pos:]
    trusted = TrustedMetadataSet(root, EnvelopeType.METADATA)
    try:
        trusted.update_timestamp(mutated)
    except tuf_exc.RepositoryError:
        return
    # accepted: only a mutation that changed no signed byte (JSON whitespace) can pass
    assert json.loads(mutated)["signed"] == json.loads(ts)["signed"]
