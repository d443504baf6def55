"""Type-check every field of every trusted document (property tests with hypothesis).

For each document -- policy.json, manifest.json, the in-toto statement, the DSSE envelope,
attestation.json and its quote, the device's state.json, enclave.json, SimTEE's tee.json and
pcrs.json -- any field at any depth is replaced by any JSON value or deleted. The reader must
then raise only the package's own error for that document (naming the file and field when
the value has the wrong type), or still accept the document where the field is genuinely
optional or free; never TypeError, KeyError, AttributeError, ValueError, ...

Signed documents are re-signed after the mutation (statement: DSSE with the release key;
quote: the AK), so the type checks behind the signature check are reached too.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sealfl.attestation import keys
from sealfl.attestation.canonical import canonical_json, json_type
from sealfl.attestation.device_state import DeviceState, LastGood
from sealfl.attestation.dsse import pae, sign_envelope, verify_envelope
from sealfl.attestation.errors import (
    DeviceStateError,
    ManifestError,
    PolicyError,
    QuoteError,
    SignatureError,
    StatementError,
    TrustAnchorError,
    VerificationError,
)
from sealfl.attestation.manifest import parse_manifest
from sealfl.attestation.model_sig import verify_model_signature
from sealfl.attestation.quote import quote_message, verify_quote
from sealfl.attestation.release import load_trust_anchors, read_release_dir, verify_release
from sealfl.attestation.statement import PAYLOAD_TYPE, parse_statement
from sealfl.attestation.trust import AK_FILE, POLICY_FILE, RELEASE_KEY_FILE, parse_trust_anchors
from sealfl.enclave.errors import TEEStateError
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.enclave.tee.sim import SimTEE
from tests.support.releases import MODEL_FILE, default_payload

Path_ = tuple  # a field path: keys and list indices from the document root
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
#: one value of every JSON type, so every type change of every field is tried at least once
REPRESENTATIVES = [None, True, 7, 2.5, "x", [["sim"]], {"k": 1}]


def _paths(doc: Any, at: Path_ = ()) -> list[Path_]:
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out.append(at + (key,))
        out.extend(_paths(value, at + (key,)))
    return out


def _get(doc: Any, path: Path_) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _mutate(doc: Any, path: Path_, op: str, value: Any) -> Any:
    out = copy.deepcopy(doc)
    parent = _get(out, path[:-1])
    if op == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def mutations(doc: dict) -> st.SearchStrategy:
    """(path, op, value): delete a field or replace it with any JSON value, or with one of
    every JSON type."""
    paths = _paths(doc)
    return st.tuples(st.sampled_from(paths), st.sampled_from(["delete", "replace", "retype"]),
                     JSON, st.sampled_from(REPRESENTATIVES))


def _wrong_type(original: Any, value: Any) -> bool:
    return json_type(original) != json_type(value)


def check_property(doc: dict, mutation, run: Callable[[Any], Any], errors: tuple[type, ...],
                   may_pass: Callable[[Path_, str], bool], name: str) -> None:
    """Apply ``mutation`` to ``doc``, call ``run(mutated)``; only ``errors`` may escape, and a
    wrong type or deletion must be refused unless ``may_pass(path, op)``."""
    path, op, any_value, representative = mutation
    value = representative if op == "retype" else any_value
    mutated = _mutate(doc, path, "delete" if op == "delete" else "replace", value)
    if mutated == doc:
        return
    must_fail = (op == "delete" or _wrong_type(_get(doc, path), value)) and not may_pass(path, op)
    try:
        run(mutated)
    except errors as exc:
        if op != "delete" and _wrong_type(_get(doc, path), value) and isinstance(path[-1], str):
            assert name in str(exc), f"{name} not named: {exc}"
        return
    assert not must_fail, f"{name}: {op} of field {path} with {value!r} was accepted"


# -- a release, trust anchors and an enclave, built once per module -------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("documents")
    enclave = ReleaseEnclave.create(root / "enclave")
    trust_dir = enclave.export_trust(root / "trust")
    enclave.write_release(root / "release", default_payload(), "heart-mlp", 3,
                          {"model_file": MODEL_FILE, "note": {"free": [1, 2]}})
    files = read_release_dir(root / "release")
    return {"root": root, "enclave": enclave, "trust_dir": trust_dir, "trust": load_trust_anchors(trust_dir),
            "files": files, "trust_files": {n: (trust_dir / n).read_bytes() for n in
                                           (RELEASE_KEY_FILE, AK_FILE, POLICY_FILE)}}


def _json(data: bytes) -> dict:
    return json.loads(data)


# -- the documents: how to read each one, which error it may raise, what may pass -------------


def _statement(world) -> dict:
    return _json(base64.b64decode(_json(world["files"]["manifest.dsse.json"])["payload"]))


def _resigned(world, statement_bytes: bytes) -> dict[str, bytes]:
    envelope = sign_envelope(statement_bytes, PAYLOAD_TYPE, world["enclave"]._key)
    return {**world["files"], "manifest.dsse.json": json.dumps(envelope).encode()}


def _with_file(src: Path, name: str, content: bytes, scratch: Path) -> Path:
    if scratch.exists():
        shutil.rmtree(scratch)
    shutil.copytree(src, scratch)
    (scratch / name).write_bytes(content)
    return scratch


def _never(path, op) -> bool:
    return False


_OPTIONAL_POLICY = {("allow_insecure_sim",), ("min_version",), ("max_version_step",), ("release_keyids",),
                    ("ak_keyid",)}


def _policy(world):
    tf = world["trust_files"]
    return (_json(tf[POLICY_FILE]),
            lambda d: parse_trust_anchors(tf[RELEASE_KEY_FILE], tf[AK_FILE], canonical_json(d)),
            (TrustAnchorError,), lambda path, op: op == "delete" and path in _OPTIONAL_POLICY, "policy.json")


def _free_metadata(prefix: Path_):
    def may_pass(path, op):  # metadata is free apart from model_file (optional: it may be deleted)
        n = len(prefix)
        return len(path) > n and path[:n] == prefix and (path[n] != "model_file" or (len(path) == n + 1
                                                                                      and op == "delete"))
    return may_pass


def _manifest(world):
    return (_json(world["files"]["manifest.json"]), lambda d: parse_manifest(canonical_json(d)),
            (ManifestError,), _free_metadata(("metadata",)), "manifest.json")


def _manifest_in_release(world):  # must equal the signed statement: every change is refused
    return (_json(world["files"]["manifest.json"]),
            lambda d: verify_release({**world["files"], "manifest.json": canonical_json(d)}, world["trust"]),
            (VerificationError,), _never, "manifest")


def _statement_doc(world):
    return (_statement(world), lambda d: parse_statement(canonical_json(d)), (StatementError,),
            _free_metadata(("predicate", "metadata")), "in-toto statement")


def _statement_in_release(world):  # re-signed, so the statement checks (not the signature) refuse it
    return (_statement(world), lambda d: verify_release(_resigned(world, canonical_json(d)), world["trust"]),
            (VerificationError,), _never, "statement")


_OPTIONAL_KEYID = lambda path, op: op == "delete" and path == ("signatures", 0, "keyid")  # noqa: E731


def _envelope(world):
    return (_json(world["files"]["manifest.dsse.json"]),
            lambda d: verify_envelope(d, world["trust"].release_public_keys, expected_payload_type=PAYLOAD_TYPE),
            (SignatureError,), _OPTIONAL_KEYID, "DSSE envelope")


def _envelope_in_release(world):
    return (_json(world["files"]["manifest.dsse.json"]),
            lambda d: verify_release({**world["files"], "manifest.dsse.json": canonical_json(d)}, world["trust"]),
            (VerificationError,), _OPTIONAL_KEYID, "DSSE envelope")


def _attestation(world):
    doc = _json(world["files"]["attestation.json"])
    ak = world["enclave"].tee._ak

    def run(d):
        quote = d.get("quote")
        if isinstance(quote, dict) and quote.get("signature") == doc["quote"]["signature"]:
            try:  # re-sign, so the checks behind the signature check are reached
                quote["signature"] = base64.b64encode(keys.sign(ak, quote_message(quote))).decode()
            except (TypeError, ValueError):
                pass
        verify_release({**world["files"], "attestation.json": canonical_json(d)}, world["trust"])

    return doc, run, (VerificationError,), _never, "attestation"


def _quote(world):
    quote = _json(world["files"]["attestation.json"])["quote"]
    ak = world["enclave"].tee._ak
    statement = hashlib.sha256(base64.b64decode(_json(world["files"]["manifest.dsse.json"])["payload"])).digest()

    def run(q):
        if q.get("signature") == quote["signature"]:
            q = dict(q, signature=base64.b64encode(keys.sign(ak, quote_message(q))).decode())
        verify_quote(q, world["trust"].ak_public_key, "release", statement, world["trust"].expected_pcrs,
                     allowed_backends={"sim"})

    return quote, run, (QuoteError, PolicyError), _never, "quote"


def _model_sig(world):
    def may_pass(path, op):  # not read: the transparency log entries, the keyids; the key hint is optional
        return (path[:2] == ("verificationMaterial", "tlogEntries") or path[-1] == "keyid"
                or (op == "delete" and path in {("verificationMaterial", "publicKey"),
                                                ("verificationMaterial", "publicKey", "hint")}))

    return (_json(world["files"]["model.sig"]),
            lambda d: verify_model_signature(canonical_json(d), world["trust"].release_public_keys),
            (SignatureError,), may_pass, "model.sig")


def _model_sig_statement(world):  # re-signed, so the statement checks (not the signature) refuse it
    bundle = _json(world["files"]["model.sig"])

    def run(d):
        payload = canonical_json(d)
        signed = copy.deepcopy(bundle)
        signed["dsseEnvelope"]["payload"] = base64.b64encode(payload).decode()
        signed["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(
            keys.sign(world["enclave"]._key, pae(PAYLOAD_TYPE, payload))).decode()
        verify_model_signature(canonical_json(signed), world["trust"].release_public_keys)

    def may_pass(path, op):  # model_signing's serialization settings beyond method and hash_type are not read
        return path[:2] == ("predicate", "serialization") and path[2:3] not in (("method",), ("hash_type",))

    return (_json(base64.b64decode(bundle["dsseEnvelope"]["payload"])), run, (SignatureError,), may_pass, "model.sig")


def _state(world):
    doc = _json(DeviceState(LastGood("heart-mlp", 3, "2" * 64, "1" * 64, "slots/v3-a", "/src", MODEL_FILE)).to_bytes())
    return doc, lambda d: DeviceState.from_bytes(canonical_json(d)), (DeviceStateError,), _never, "state.json"


def _enclave_json(world):
    src = world["root"] / "enclave"
    scratch = world["root"] / "enclave-scratch"
    return (_json((src / "enclave.json").read_bytes()),
            lambda d: ReleaseEnclave.open(_with_file(src, "enclave.json", canonical_json(d), scratch)),
            (TEEStateError,), _never, "enclave.json")


def _sim_file(name):
    def spec(world):
        src = world["root"] / "enclave" / "tee"
        scratch = world["root"] / f"tee-scratch-{name}"
        return (_json((src / name).read_bytes()),
                lambda d: SimTEE.load(_with_file(src, name, canonical_json(d), scratch), reset_pcrs=False),
                (TEEStateError,), _never, name)
    return spec


DOCUMENTS = {
    "policy.json": _policy,
    "manifest.json": _manifest,
    "manifest.json-in-release": _manifest_in_release,
    "statement": _statement_doc,
    "statement-in-release": _statement_in_release,
    "dsse-envelope": _envelope,
    "dsse-envelope-in-release": _envelope_in_release,
    "attestation.json-in-release": _attestation,
    "model.sig": _model_sig,
    "model.sig-statement": _model_sig_statement,
    "quote": _quote,
    "state.json": _state,
    "enclave.json": _enclave_json,
    "tee.json": _sim_file("tee.json"),
    "pcrs.json": _sim_file("pcrs.json"),
}


@pytest.mark.parametrize("document", sorted(DOCUMENTS))
def test_kind_every_field_retyped_or_deleted_is_refused_by_name(world, document):
    """Exhaustive: every field at every depth, deleted or replaced by one value of each JSON type."""
    doc, run, errors, may_pass, name = DOCUMENTS[document](world)
    for path in _paths(doc):
        check_property(doc, (path, "delete", None, None), run, errors, may_pass, name)
        for value in REPRESENTATIVES:
            check_property(doc, (path, "retype", None, value), run, errors, may_pass, name)


@pytest.mark.parametrize("document", sorted(DOCUMENTS))
@given(data=st.data())
@SETTINGS
def test_kind_any_value_anywhere_raises_only_the_package_error(world, document, data):
    """Hypothesis: any JSON value (including same-type values out of range) anywhere."""
    doc, run, errors, may_pass, name = DOCUMENTS[document](world)
    check_property(doc, data.draw(mutations(doc)), run, errors, may_pass, name)


def test_kind_policy_issue_input_names_file_and_field(world):
    """The issue's input: ``allowed_backends: [["sim"]]`` ended in a raw TypeError."""
    tf = world["trust_files"]
    cases = [("allowed_backends", [["sim"]], "allowed_backends[0]"), ("min_version", 2**31, "min_version"),
             ("max_version_step", 0, "max_version_step"), ("unknown", 1, "unknown"),
             ("expected_pcrs", {"²": "0" * 64}, "expected_pcrs.²"),
             ("expected_pcrs", {"9" * 5000: "0" * 64}, "expected_pcrs.")]
    for field, bad, named in cases:
        doc = _json(tf[POLICY_FILE])
        doc[field] = bad
        with pytest.raises(TrustAnchorError) as info:
            parse_trust_anchors(tf[RELEASE_KEY_FILE], tf[AK_FILE], canonical_json(doc))
        assert "policy.json" in str(info.value) and named in str(info.value), str(info.value)
