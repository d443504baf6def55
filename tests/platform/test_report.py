"""``sealfl campaign report``: figures read from a hand-written campaign directory (hostile
values become gaps, never errors), PNGs that are PNGs, an HTML page that escapes what it
quotes, perplexity = exp(loss) for a language model, and the CLI's --json and errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from sealfl.platform.report.render import write_report
from sealfl.platform.report.series import series_of

PNG = b"\x89PNG\r\n\x1a\n"


def _rec(n, acc, loss, **kw):
    return {"round": n, "pooled_test_accuracy": acc, "train_loss": loss, "ciphertext_bytes_in": 2_000_000,
            "aggregate_bytes": 1_000_000, "round_seconds": 1.5, "aggregate_seconds": 0.25,
            "per_partner": {"A": {"accuracy": acc, "loss": loss}, "B": {"accuracy": 0.5, "loss": 0.7}}, **kw}


def _campaign(tmp_path, records, status=None):
    d = tmp_path / "camp"
    d.mkdir()
    (d / "status.json").write_text(json.dumps(status or {"status": "finished", "round": len(records),
                                                         "num_rounds": len(records), "started": 1.7e9,
                                                         "finished": 1.7e9 + 60, "server_has_secret_key": False}))
    (d / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def test_kind_figures_follow_the_records_round_by_round():
    s = series_of([_rec(2, 0.75, 0.5), _rec(1, 0.7, 0.6, rejected={"C": "bad signature"}), _rec(3, 0.8, 0.4)])
    assert s.rounds == [1, 2, 3]
    assert s.pooled_accuracy == [0.7, 0.75, 0.8] and s.train_loss == [0.6, 0.5, 0.4]
    assert s.ciphertext_mb == [2.0, 2.0, 2.0] and s.aggregate_mb == [1.0, 1.0, 1.0]
    assert s.partner_accuracy == {"A": [0.7, 0.75, 0.8], "B": [0.5, 0.5, 0.5]}
    assert s.refused == {"C": {"bad signature": 1}} and s.refused_per_round == [1, 0, 0]
    assert s.skipped == 0


def test_kind_hostile_values_become_gaps_and_are_counted():
    bad = [
        {"round": 1, "pooled_test_accuracy": 1.5, "train_loss": -1, "round_seconds": "2",
         "ciphertext_bytes_in": True, "per_partner": {"A": {"accuracy": float("nan"), "loss": 0.5},
                                                       "x" * 500: {"accuracy": 0.5}, "B": "nope"}},
        {"round": "2", "pooled_test_accuracy": 0.9},     # not an integer round: left out
        {"round": True, "pooled_test_accuracy": 0.9},    # a boolean is not a round
        {"round": 3, "pooled_test_accuracy": 0.8, "per_partner": [1, 2], "rejected": ["A"]},
    ]
    s = series_of(bad)
    assert s.rounds == [1, 3]
    assert s.pooled_accuracy == [None, 0.8] and s.train_loss == [None, None] and s.round_seconds == [None, None]
    assert s.ciphertext_mb == [None, None]
    assert s.partner_accuracy == {"A": [None, None]} and s.partner_loss == {"A": [0.5, None]}
    # 1.5, -1, "2", True, nan, the long name, "nope", the list per_partner, the list of refusals
    assert s.skipped == 9


def test_kind_the_page_escapes_names_and_the_pngs_are_pngs(tmp_path):
    rec = _rec(1, 0.7, 0.6, rejected={"<script>alert(1)</script>": "<b>bold</b>"})
    rep = write_report("campaign <x>", {"status": "finished", "num_rounds": 1}, series_of([rec]), tmp_path / "r")
    page = rep.html.read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;b&gt;bold" in page
    assert {p.name for p in rep.images} == {"accuracy.png", "loss.png", "traffic.png", "refused.png"}
    assert all(p.read_bytes().startswith(PNG) and p.stat().st_size > 5000 for p in rep.images)
    for p in rep.images:
        assert f'src="{p.name}"' in page


def test_kind_a_language_model_is_reported_by_perplexity(tmp_path):
    recs = [{"round": n, "per_partner": {"docs": {"loss": loss}}} for n, loss in ((1, 3.0), (2, 2.0))]
    rep = write_report("llm", {"status": "finished"}, series_of(recs), tmp_path / "r")
    page = rep.html.read_text()
    assert "accuracy.png" not in {p.name for p in rep.images}
    assert f"{math.e ** 3:.2f}" in page and f"{math.e ** 2:.2f}" in page  # 20.09 -> 7.39


def test_kind_the_command_writes_the_report_prints_json_and_refuses_a_non_campaign(tmp_path):
    camp = _campaign(tmp_path, [_rec(1, 0.7, 0.6), _rec(2, 0.8, 0.5)])
    cmd = [sys.executable, "-m", "sealfl.platform.cli", "campaign", "report", str(camp), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["rounds"] == [1, 2] and doc["pooled_accuracy"] == [0.7, 0.8]
    assert doc["html"] == str(camp / "report" / "report.html") and (camp / "report" / "report.html").exists()
    nowhere = subprocess.run([*cmd[:5], str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=300)
    assert nowhere.returncode == 1 and "nowhere" in nowhere.stderr and "Traceback" not in nowhere.stderr
