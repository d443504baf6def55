"""bench/run_all.py: summary.json holds exactly issue 9's keys, only from scripts that
succeeded in this run; unknown keys and non-numbers are dropped."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location("run_all", Path(__file__).resolve().parents[2] / "bench" / "run_all.py")
run_all = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_all)


def test_kind_summary_has_exactly_the_issue_keys(tmp_path):
    (tmp_path / "codec.json").write_text(json.dumps({"summary": {"P1.sealfl": 2.13, "P1.bogus": 1, "P2.heart": "1"}}))
    (tmp_path / "verify.json").write_text(json.dumps({"summary": {"P4.hash_fraction_of_openssl": 0.7}}))
    (tmp_path / "stale.json").write_text(json.dumps({"summary": {"P3.encrypted": 0.9}}))
    runs = [{"script": "codec_bench.py", "rc": 0}, {"script": "verify_bench.py", "rc": 1}]
    summary, source = run_all.merge(tmp_path, runs)
    assert list(summary) == run_all.KEYS
    assert summary["P1.sealfl"] == 2.13 and source["P1.sealfl"] == "codec.json"
    assert summary["P2.heart"] is None  # a string is not a figure
    assert summary["P4.hash_fraction_of_openssl"] is None  # its script failed in this run
    assert summary["P3.encrypted"] is None  # no script of this run wrote stale.json
    assert "not measured" in run_all.table(summary, source)
    assert "SHORT" in run_all.table(summary, source)  # 2.13 > the 2.0 target
