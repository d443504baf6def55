"""``--json`` output scripts read: one JSON object on stdout, for success and for failure,
with the exit code the plain output has (real CLI processes, real signed releases)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from tests.support.releases import direct_outputs, make_onnx_model, sample_inputs


def _cli(*args) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], capture_output=True,
                         text=True, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, (out.stdout, out.stderr)  # nothing but the one object on stdout
    return out.returncode, json.loads(lines[0])


def test_kind_verify_json_says_ok_or_names_the_failing_check(trust_dir, release_dir, tmp_path):
    code, doc = _cli("verify", "--trust", trust_dir, release_dir, "--json")
    assert code == 0 and doc["ok"] is True and doc["version"] == 3 and len(doc["root_digest"]) == 64
    model = next(p for p in release_dir.iterdir() if p.suffix == ".onnx")
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(bytes(data))
    code, doc = _cli("verify", "--trust", trust_dir, release_dir, "--json")
    assert code == 1 and doc["ok"] is False and doc["exit_code"] == 1 and model.name in doc["error"]


def test_kind_boot_json_reports_the_running_release_and_the_scores(trust_dir, release_dir, tmp_path):
    rows = sample_inputs(3)
    csv = tmp_path / "rows.csv"
    csv.write_text("".join(",".join(f"{v:.6f}" for v in r) + "\n" for r in rows))
    code, doc = _cli("device", "boot", "--trust", trust_dir, "--release", release_dir, "--state", tmp_path / "st",
                     "--tee", "sim", "--input", csv, "--json")
    assert code == 0 and doc["ok"] is True and doc["exit_code"] == 0 and doc["kept_last_good"] is False
    assert doc["release"]["version"] == 3 and doc["tee"] == {"backend": "sim", "insecure": True}
    parsed = [[float(f"{v:.6f}") for v in r] for r in rows]
    expected = direct_outputs(make_onnx_model(), np.array(parsed, dtype=np.float32)).reshape(-1)
    assert [round(s, 5) for s in doc["scores"]] == [round(float(e), 5) for e in expected]
    code, doc = _cli("device", "boot", "--trust", trust_dir, "--release", tmp_path / "nowhere", "--state",
                     tmp_path / "st", "--json")
    assert code == 3 and doc["kept_last_good"] is True and "nowhere" in doc["refused"] and doc["scores"] is None


def test_kind_boot_without_a_release_runs_the_last_good_one_or_says_how_to_get_one(trust_dir, release_dir, tmp_path):
    st = tmp_path / "st"
    code, _ = _cli("device", "boot", "--trust", trust_dir, "--release", release_dir, "--state", st, "--tee", "sim",
                   "--json")
    assert code == 0
    code, doc = _cli("device", "boot", "--trust", trust_dir, "--state", st, "--json")  # e.g. after 'device update'
    assert code == 0 and doc["release"]["version"] == 3 and doc["kept_last_good"] is False
    code, doc = _cli("device", "boot", "--trust", trust_dir, "--state", tmp_path / "empty", "--tee", "sim", "--json")
    assert code != 0 and doc["ok"] is False and "device update" in doc["error"]


def test_kind_campaign_status_and_report_json_refusals_are_one_json_object(tmp_path):
    for cmd in (["campaign", "status"], ["campaign", "report"]):
        code, doc = _cli(*cmd, tmp_path / "not-a-campaign", "--json")
        assert code == 1 and doc["ok"] is False and doc["exit_code"] == 1 and "not a campaign" in doc["error"]


def test_kind_campaign_status_json_is_strict_json_even_with_nan_in_the_round_log(tmp_path):
    from sealfl.clients.heart.data import HOSPITALS
    from sealfl.platform.consortium import create_consortium

    cons, _ = create_consortium(tmp_path / "c", "heart", list(HOSPITALS))
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "campaign", "run", "-c", str(cons.dir), "-o",
                          str(tmp_path / "camp"), "--rounds", "2", "--prepare-only"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    # Python's json writes NaN for a metric nobody could compute; JSON has no such token
    (tmp_path / "camp" / "rounds.jsonl").write_text('{"round": 1, "pooled_test_accuracy": NaN, "loss": Infinity}\n')
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "campaign", "status", str(tmp_path / "camp"),
                          "--json"], capture_output=True, text=True, timeout=300)

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    doc = json.loads(out.stdout, parse_constant=refuse)
    assert doc["rounds"] == [{"round": 1, "pooled_test_accuracy": None, "loss": None}]
