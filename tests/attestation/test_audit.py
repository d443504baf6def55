"""The audit's public round log parser: one strict JSON object per line, every field typed;
anything else is an AuditError naming the line (the full chain is tested on the release
pipeline's real release, tests/platform/test_release_pipeline.py::test_audit_*)."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sealfl.attestation.audit import parse_round_log
from sealfl.attestation.errors import AuditError

D1, D2 = hashlib.sha256(b"1").hexdigest(), hashlib.sha256(b"2").hexdigest()


def _log(*records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def test_round_log_keeps_each_rounds_last_record_and_sorts_partners():
    log = _log({"round": 1, "aggregate_sha256": D1, "accepted": ["B", "A"], "train_loss": 0.5},
               {"round": 2, "aggregate_sha256": D1, "accepted": ["A"]},
               {"round": 2, "aggregate_sha256": D2, "accepted": ["A", "C"]})  # resumed: round 2 again
    assert parse_round_log(log) == {1: {"aggregate_sha256": D1, "partners": ["A", "B"]},
                                    2: {"aggregate_sha256": D2, "partners": ["A", "C"]}}


@pytest.mark.parametrize("line,named", [
    (b'{"round": 1, "aggregate_sha256": "' + D1.encode() + b'", "accepted": ["A"]', "line 2"),
    (b'{"round": 0, "aggregate_sha256": "' + D1.encode() + b'", "accepted": ["A"]}', "round"),
    (b'{"round": 2, "accepted": ["A"]}', "aggregate_sha256"),
    (b'{"round": 2, "aggregate_sha256": "' + D1.encode() + b'", "accepted": []}', "accepted"),
    (b'{"round": 2, "aggregate_sha256": "' + D1.encode() + b'", "accepted": [3]}', "accepted[0]"),
    (b'{"round": 2, "round": 3, "aggregate_sha256": "' + D1.encode() + b'", "accepted": ["A"]}', "duplicate"),
])
def test_a_bad_round_log_line_is_refused_naming_it(line, named):
    good = _log({"round": 1, "aggregate_sha256": D1, "accepted": ["A"]})
    with pytest.raises(AuditError) as info:
        parse_round_log(good + line + b"\n")
    assert "line 2" in str(info.value) and named in str(info.value)


def test_an_empty_round_log_is_refused():
    with pytest.raises(AuditError, match="no round"):
        parse_round_log(b"\n\n")


@given(st.binary(max_size=200))
@settings(max_examples=100, deadline=None, derandomize=True)
def test_kind_any_bytes_raise_only_audit_error(data):
    try:
        parse_round_log(data)
    except AuditError:
        pass
