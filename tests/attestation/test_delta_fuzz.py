"""Hypothesis fuzzing of the delta parsers a device runs on untrusted bytes: any input is
either accepted or refused with DeltaError, nothing else escapes."""

from __future__ import annotations

import hdiffpatch
from hypothesis import given, settings
from hypothesis import strategies as st

from sealfl.attestation.delta import check_patch_header, verify_delta_statement
from sealfl.attestation.errors import DeltaError
from sealfl.attestation.keys import generate_key

_KEY = generate_key()
_SETTINGS = settings(max_examples=200, deadline=None, derandomize=True)
_REAL = hdiffpatch.diff(b"abc" * 100, b"abd" * 120, hdiffpatch.COMPRESSION_ZSTD)


@_SETTINGS
@given(st.one_of(st.binary(max_size=64), st.binary(max_size=64).map(lambda b: b"HDIFF13&" + b),
                 st.integers(0, len(_REAL)).flatmap(lambda n: st.binary(max_size=8).map(lambda b: _REAL[:n] + b))))
def test_patch_header_never_raises_anything_but_delta_error(data):
    try:
        check_patch_header(data, new_length=360, old_length=300)
    except DeltaError:
        pass


@_SETTINGS
@given(st.one_of(st.binary(max_size=256),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                              lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                         max_size=4),
                              max_leaves=12).map(lambda v: repr(v).encode())))
def test_delta_statement_never_raises_anything_but_delta_error(data):
    try:
        verify_delta_statement(data, [_KEY.public_key()])
    except DeltaError:
        pass


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**41) | st.text(max_size=70),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
                     max_leaves=16)
_GOOD = {"algorithm": "hdiffpatch", "base": {"name": "m", "version": 1, "root_digest": "a" * 64},
         "result": {"name": "m", "version": 2, "root_digest": "b" * 64},
         "files": [{"name": "f", "length": 1, "sha256": "c" * 64, "from": None, "patch": "f.hdiff",
                    "patch_length": 9, "patch_sha256": "d" * 64}]}


@_SETTINGS
@given(st.dictionaries(st.sampled_from(sorted(_GOOD)), _JSON, max_size=4),
       st.dictionaries(st.sampled_from(sorted(_GOOD["files"][0])), _JSON, max_size=3))
def test_signed_statement_with_hostile_fields_raises_only_delta_error(top, file_fields):
    """Validly signed by the pinned key (a key compromise or a buggy writer), fields mutated:
    the field checks refuse with DeltaError, never a KeyError/TypeError."""
    from sealfl.attestation.canonical import canonical_json
    from sealfl.attestation.delta import PAYLOAD_TYPE, PREDICATE_TYPE, STATEMENT_TYPE
    from sealfl.attestation.dsse import sign_envelope

    pred = {**_GOOD, **top}
    if isinstance(pred.get("files"), list) and pred["files"] and isinstance(pred["files"][0], dict):
        pred["files"] = [{**pred["files"][0], **file_fields}]
    statement = {"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE, "predicate": pred,
                 "subject": [{"name": "m", "digest": {"sha256": "b" * 64}}]}
    try:
        data = canonical_json(sign_envelope(canonical_json(statement), PAYLOAD_TYPE, _KEY))
    except (TypeError, ValueError):
        return
    try:
        verify_delta_statement(data, [_KEY.public_key()])
    except DeltaError:
        pass
