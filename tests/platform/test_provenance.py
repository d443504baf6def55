"""The campaign's round log records each round's encrypted aggregate digest and the partners
that counted; a release's provenance takes them from there (and refuses a log without them)."""

from __future__ import annotations

import hashlib

import pytest

from sealfl.platform.errors import ReleaseError
from sealfl.platform.provenance import round_entries
from sealfl.server.bookkeeping import CampaignDir
from tests.support.releases import commit_round


def test_the_round_log_records_each_aggregate_digest_and_release_needs_them(tmp_path):
    cts = [b"ciphertext of round 1", b"ciphertext of round 2"]
    for r, ct in enumerate(cts, start=1):
        commit_round(tmp_path / "camp", r, ct, 10.0, b"stats", ["B", "A"])
    records = CampaignDir(tmp_path / "camp").rounds()
    assert [rec["aggregate_sha256"] for rec in records] == [hashlib.sha256(ct).hexdigest() for ct in cts]
    assert round_entries(records, "log") == [
        {"round": r, "aggregate_sha256": hashlib.sha256(ct).hexdigest(), "partners": ["A", "B"]}
        for r, ct in enumerate(cts, start=1)]
    old = [{k: v for k, v in rec.items() if k != "aggregate_sha256"} for rec in records]  # an older sealfl's log
    with pytest.raises(ReleaseError, match="round 1 records no aggregate_sha256"):
        round_entries(old, "log")
    with pytest.raises(ReleaseError, match="no finished round"):
        round_entries([], "log")
