"""``make bench``: run every ``bench/*.py``, print one table, write ``bench/results/summary.json``.

Protocol for a bench script: it runs with no arguments, writes
``bench/results/<name>.json``, and may put a ``"summary"`` object in it whose keys are
among :data:`KEYS` (figures of issue 9). This driver runs each script in its own
process (one after another: the box has 2 cores and the figures are timings), with a
per-script deadline, then merges the summaries. summary.json holds exactly :data:`KEYS` (issue 9's, then the CKKS ones);
a key no script measured is ``null`` and the printed table says "not measured".
A script that needs arguments or inputs this driver cannot give is listed in
:data:`MANUAL` with the reason and skipped.

Run: ``.venv/bin/python bench/run_all.py [--timeout 900] [--only SCRIPT ...]`` (``--only``:
run just those scripts and keep every other figure of the existing summary.json, e.g. after
measuring one issue's figures on a loaded box; ``--collect SCRIPT``: take the figures a
standalone run of that script left in its results file, without running it again).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
KEYS = ["P1.sealfl", "P1.nvflare_default", "P2.heart", "P2.lora8_update_cost", "P3.encrypted", "P3.plaintext",
        "P4.boot_seconds_100mb", "P4.hash_fraction_of_openssl", "P6.ratio_4", "P6.ratio_64", "P6.ratio_256",
        "throughput.encrypt_params_per_s", "throughput.aggregate_params_per_s", "throughput.decrypt_params_per_s",
        # the headline figures are those of the default packed BFV codec (ARCHITECTURE.md); the
        # same for the CKKS option (``--he ckks``) where measured
        "P1.sealfl_ckks", "P2.heart_ckks", "P2.lora8_update_cost_ckks", "P3.encrypted_ckks", "P6.ratio_4_ckks",
        # the least P2.lora8_update_cost could be with free partner-side encryption, and what to expect with
        # the partners' measured crypto CPU time spread perfectly over every core (bench/round_bench.py)
        "P2.lora_aggregator_floor", "P2.lora_aggregator_floor_ckks", "P2.lora_cpu_estimate", "P2.lora_cpu_estimate_ckks",
        # server optimizers at the key holders (sealfl.he.server_opt), BFV and plaintext
        "P3.fedavgm_encrypted", "P3.fedavgm_plaintext", "P3.fedadam_encrypted", "P3.fedadam_plaintext",
        # the key broker: one challenge with 10,000 outstanding over one with 10 (O(1); bench/kbs_bench.py)
        "kbs.challenge_cost_ratio_10000",
        # device serve --repo: switching releases under 4 streaming clients (bench/serve_switch_bench.py, issue 21)
        "serve.switch_failed_requests", "serve.switch_ttft_p99_ratio",
        # signed deltas (bench/delta_bench.py, issue 21): patch / full release bytes and delta / full update time,
        # heart releases and (``delta_bench.py --llm llm-out``, the target's own case) the LLM demo's
        "delta.patch_over_full", "delta.update_time_ratio", "delta.llm_patch_over_full", "delta.llm_update_time_ratio",
        "delta.llm_update_time_ratio_100mbit",
        # differential privacy (bench/dp.py): heart pooled test accuracy, and (nodp - distributed) /
        # (nodp - local) at ε = 3 (issue 23's target: at most 0.5)
        "dp.heart_nodp", "dp.heart_distributed_3", "dp.heart_local_3", "dp.heart_distributed_8", "dp.eps3_lost_ratio",
        # issue 24: the real causal-LM LoRA round encrypted / plaintext (4 partners, the demo's local steps;
        # bench/pack_bench.py), the aggregator's whole LoRA-size updates per second (bench/codec_bench.py),
        # device boot of the 100 MB release over openssl + a bare onnxruntime session (bench/verify_bench.py),
        # and the narrowest BFV packing within 1 % of the 27-bit campaign's held-out perplexity:
        # its bytes / fp32 and its perplexity / the 27-bit one (bench/pack_bench.py)
        "P2.llm", "throughput.aggregate_lora_updates_per_s", "P4.boot_ratio", "P1.narrowest",
        "P1.narrowest_ppl_ratio"]
#: keys of earlier runs under their new names (summary.json written before the rename reads as these)
RENAMED = {"P2.lora": "P2.lora8_update_cost", "P2.lora_ckks": "P2.lora8_update_cost_ckks"}
#: targets of issue 9 (key -> (comparison, value)); shown beside each figure
TARGETS = {"P1.sealfl": ("<=", 2.0), "P2.heart": ("<=", 1.05), "P2.llm": ("<=", 1.05),
           "P3.encrypted": (">=", 0.80), "P4.boot_seconds_100mb": ("<=", 0.5),
           "P4.hash_fraction_of_openssl": (">=", 0.90), "P6.ratio_4": ("<=", 1.5), "P6.ratio_64": ("<=", 1.5),
           "P6.ratio_256": ("<=", 1.5), "P1.sealfl_ckks": ("<=", 2.0), "P2.heart_ckks": ("<=", 1.05),
           "P3.encrypted_ckks": (">=", 0.80), "P6.ratio_4_ckks": ("<=", 1.5),
           "P3.fedavgm_encrypted": (">=", 0.80), "P3.fedadam_encrypted": (">=", 0.80),
           "kbs.challenge_cost_ratio_10000": ("<=", 2.0), "serve.switch_failed_requests": ("<=", 0),
           "serve.switch_ttft_p99_ratio": ("<=", 2.0), "delta.patch_over_full": ("<=", 0.15),
           "delta.update_time_ratio": ("<=", 0.5), "delta.llm_patch_over_full": ("<=", 0.15),
           "delta.llm_update_time_ratio": ("<=", 0.5), "dp.eps3_lost_ratio": ("<=", 0.5),
           "P4.boot_ratio": ("<=", 1.2), "P1.narrowest": ("<=", 0.5), "P1.narrowest_ppl_ratio": ("<=", 1.01)}
#: scripts that are tools with arguments, not part of ``make bench``
MANUAL = {"llm_quant_bench.py": "needs hf/ and corpus/ in its working directory and candidate ONNX paths",
          "run_all.py": "this driver",
          "llm.py": "needs llm-out/ from `make llm-demo` and builds llama.cpp: `make bench-llm`",
          "llm_llamacpp.py": "a module of llm.py",
          "flower_fedavg.py": "a module of scale.py (its Flower FedAvg baseline, run with arguments)",
          "device_boot_tee.py": "the TPM/sim boot-time study behind device_boot_tee.md (swtpm; run by hand)",
          "device_footprint.py": "a before/after comparison of source trees given by --tree (run by hand)",
          "deploy_bench.py": "starts a SuperLink and 4 SuperNodes and runs two campaigns (~4 min): `make bench-deploy`",
          "llm_session_memory.py": "the LLM child's session-build memory per onnxruntime option (--model a release's ONNX)",
          "llm_step_profile.py": "an LLM decode step's graph vs token-choice time per thread count (--model ...)"}


#: scripts that need longer than ``--timeout`` (seconds): four LoRA campaigns of 3 rounds
LONGER = {"pack_bench.py": 3600.0}


def run_scripts(timeout: float, only: list[str] | None = None) -> list[dict]:
    """Run each bench script (or only those named in ``only``); returns one record per
    script (name, rc, seconds, result file)."""
    runs = []
    for script in sorted(HERE.glob("*.py")):
        if script.name in MANUAL or script.name.startswith("_") or (only is not None and script.name not in only):
            continue
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, str(script)], cwd=HERE.parent,
                                  timeout=max(timeout, LONGER.get(script.name, 0.0)), capture_output=True, text=True)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            rc, tail = None, f"timed out after {max(timeout, LONGER.get(script.name, 0.0)):.0f} s"
        runs.append({"script": script.name, "rc": rc, "seconds": time.perf_counter() - t0, "tail": tail})
        print(f"[bench] {script.name}: rc={rc} in {runs[-1]['seconds']:.0f} s", flush=True)
        if rc != 0:
            print(tail, file=sys.stderr)
    return runs


def merge(results_dir: Path, runs: list[dict]) -> tuple[dict, dict]:
    """summary.json content (exactly KEYS) and the source script of each figure."""
    summary: dict = {k: None for k in KEYS}
    source: dict = {}
    ok = {r["script"].removesuffix(".py").removesuffix("_bench") for r in runs if r["rc"] == 0}
    for f in sorted(results_dir.glob("*.json")):
        if f.name == "summary.json" or f.stem not in ok:
            continue  # only figures measured in this run
        try:
            data = json.loads(f.read_text())
        except json.JSONDecodeError:
            continue
        for k, v in (data.get("summary") or {}).items() if isinstance(data, dict) else ():
            if k in summary and isinstance(v, (int, float)) and not isinstance(v, bool):
                summary[k], source[k] = float(v), f.name
    return summary, source


def keep_earlier(summary: dict, earlier: dict) -> dict:
    """``summary`` with every figure it lacks taken from ``earlier`` (an older summary.json,
    its renamed keys read under their new names, :data:`RENAMED`); exactly :data:`KEYS`."""
    old = {RENAMED.get(k, k): v for k, v in earlier.items()}
    return {k: summary[k] if summary.get(k) is not None else old.get(k) for k in KEYS}


def table(summary: dict, source: dict) -> str:
    lines = [f"{'figure':36} {'value':>14} {'target':>10}  source", "-" * 80]
    for k in KEYS:
        v = summary[k]
        tgt = TARGETS.get(k)
        mark = ""
        if v is not None and tgt:
            mark = " ok" if (v <= tgt[1] if tgt[0] == "<=" else v >= tgt[1]) else " SHORT"
        val = "not measured" if v is None else (f"{v:,.0f}" if v >= 1000 else f"{v:.4g}")
        lines.append(f"{k:36} {val:>14} {(tgt[0] + ' ' + str(tgt[1])) if tgt else '':>10}{mark:6} "
                     f"{source.get(k, '')}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per script")
    ap.add_argument("--only", action="append", metavar="SCRIPT",
                    help="run only this script (repeat); the other figures are kept from the existing summary.json")
    ap.add_argument("--collect", action="append", metavar="SCRIPT", default=[],
                    help="take this script's figures from its results file as a standalone run left it, without "
                         "running it (repeat; implies --only for the rest)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.collect and not args.only:
        args.only = []
    runs = run_scripts(args.timeout, args.only) + [{"script": c, "rc": 0, "seconds": 0.0, "tail": "collected"}
                                                   for c in args.collect]
    summary, source = merge(RESULTS, runs)
    if args.only is not None and (RESULTS / "summary.json").exists():
        summary = keep_earlier(summary, json.loads((RESULTS / "summary.json").read_text()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary, source))
    print(f"wrote {RESULTS / 'summary.json'} in {time.perf_counter() - t0:.0f} s")
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
