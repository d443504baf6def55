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


def test_kind_issue_24_figures_have_keys_and_targets_and_the_synthetic_lora_ratio_says_what_it_is():
    for k, target in (("P2.llm", ("<=", 1.05)), ("P4.boot_ratio", ("<=", 1.2)), ("P1.narrowest", ("<=", 0.5)),
                      ("P1.narrowest_ppl_ratio", ("<=", 1.01))):
        assert k in run_all.KEYS and run_all.TARGETS[k] == target
    assert "throughput.aggregate_lora_updates_per_s" in run_all.KEYS
    # partners that do not train: not a round ratio, so no round-ratio target
    assert "P2.lora" not in run_all.KEYS and "P2.lora8_update_cost" in run_all.KEYS
    assert "P2.lora8_update_cost" not in run_all.TARGETS


def test_kind_only_some_scripts_keep_the_other_figures_of_the_earlier_summary():
    earlier = {"P1.sealfl": 1.05, "P2.lora": 1.86, "P2.lora_ckks": 5.6, "P4.boot_ratio": 9.0, "gone.key": 3.0}
    now = {k: None for k in run_all.KEYS} | {"P4.boot_ratio": 1.1}
    kept = run_all.keep_earlier(now, earlier)
    assert list(kept) == run_all.KEYS  # exactly the keys: a dropped key does not come back
    assert kept["P4.boot_ratio"] == 1.1  # measured now wins over the earlier figure
    assert kept["P1.sealfl"] == 1.05 and kept["P2.lora8_update_cost"] == 1.86  # kept, under the new name
    assert kept["P2.lora8_update_cost_ckks"] == 5.6 and kept["P2.llm"] is None


def _pack_bench():
    spec = importlib.util.spec_from_file_location("pack_bench", Path(__file__).resolve().parents[2] / "bench" /
                                                  "pack_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kind_narrowest_packing_is_the_fewest_bytes_within_one_percent_of_the_27_bit_perplexity(tmp_path):
    pb = _pack_bench()
    sizes = {"27": {"bytes": 1000, "over_fp32": 1.05}, "13": {"bytes": 510, "over_fp32": 0.54},
             "10:1": {"bytes": 400, "over_fp32": 0.43}, "10": {"bytes": 399, "over_fp32": 0.42}}
    camps = {"27": {"perplexity": 20.0}, "13": {"perplexity": 20.1}, "10:1": {"perplexity": 20.19},
             "10": {"perplexity": 20.21}}  # 10 is 1.05 % worse: out; 10:1 is 0.95 % worse: in
    label, ratio, ppl = pb.narrowest(sizes, camps)
    assert (label, ratio) == ("10:1", 0.43) and abs(ppl - 20.19 / 20.0) < 1e-12
    assert pb.narrowest(sizes, {"13": {"perplexity": 1.0}}) == (None, None, None)  # no reference: no figure
    assert pb.narrowest(sizes, {"27": {"perplexity": 1.0}}) == (None, None, None)  # nothing narrower compared
    # a campaign shorter than the reference is not compared
    assert pb.narrowest(sizes, {**{k: {**c, "rounds": 3} for k, c in camps.items()},
                                "10:1": {"perplexity": 20.0, "rounds": 1}})[0] == "13"
    out = tmp_path / "pack.json"
    pb.write(sizes, {**camps, "27": {**camps["27"], "history": [{"round_ratio": 1.2}, {"round_ratio": 1.0},
                                                                 {"round_ratio": 1.1}]}}, out)
    summary = json.loads(out.read_text())["summary"]
    assert summary["P1.narrowest"] == 0.43 and summary["P2.llm"] == 1.1  # median over the rounds
