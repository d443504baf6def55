"""Benchmark: encrypted vs plaintext FedAvg rounds, same task, data and run (P2, P3, P6).

For each configuration consortia are created in one temporary directory: with the default
packed BFV codec (``sealfl.he.bfv``), with the CKKS option (``--he ckks``,
``sealfl.he.ckks``; heart-4 and lora-8 only, to keep ``make bench`` under 20 min) and
with the benchmark-only plaintext baseline (``sealfl.he.plain``: the same ClientApp
and ServerApp, shares as float64 in clear; this script opts in for its own child
processes only). All run the same campaign (Flower simulation on a local Ray, every
partner required).

| config | task | partners | rounds | gives (BFV; ``_ckks`` keys for CKKS) |
|---|---|---|---|---|
| heart-4 | ``heart`` | 4 hospitals | 8 | P2.heart, P3.*, P6.ratio_4 |
| lora-8 | ``bench-lora-8`` (460,800 values) | 8 | 3 | P2.lora8_update_cost |
| heart-64 | ``bench-heart-64`` | 64 | 3 | P6.ratio_64 |
| heart-256 | ``bench-heart-256`` | 256 | 2 | P6.ratio_256 |
| heart-4-opt | ``heart`` | 4 hospitals | 8 | P3.fedavgm_*, P3.fedadam_* (BFV and plaintext only) |

- **P2** = median round wall time (train + evaluate, ``rounds.jsonl``) encrypted /
  plaintext, leaving out round 1 (Ray actor warm-up) when there are more rounds;
- **P3** = pooled test accuracy after the last round (heart-4), beside FLamby's
  published pooled 0.776 and FedAvg 0.654; heart-4-opt runs the same campaign with the
  server optimizers the key holders apply (:mod:`sealfl.he.server_opt`: FedAvgM with
  momentum 0.9, FedAdam with Flower's defaults), encrypted and in plaintext;
- **P2.<config>_aggregator_floor** = (plaintext round + the encrypted run's extra
  aggregation time after the last reply arrived) / plaintext round, medians: the lowest
  round ratio the encrypted run could reach even if partners encrypted and decrypted for
  free. Replies are checked and added as they arrive (:mod:`sealfl.server.streaming`);
  what is left after the last one runs between the train and evaluate phases with
  nothing to overlap it;
- **P2.<config>_cpu_estimate** = (plaintext round + the extra aggregation time + the
  partners' crypto CPU seconds / cores) / plaintext round, medians: the round ratio to
  expect on this machine if every partner's encryption (each partner, once) and
  decryption (once per worker process: the decoded global model is cached) ran in perfect
  parallel on all cores *in addition to* the plaintext round's work. Not a strict floor:
  some of that CPU time can hide in the plaintext round's idle waits (Flower's polling);
  crypto seconds are timed here with the same codec and length;
- **P6.ratio_N** = peak RSS of the coordinator (the worker process hosting the ServerApp
  and Flower's simulation driver) encrypted / plaintext at N partners; round times at
  each N are in ``round.json``.

Run: ``.venv/bin/python bench/round_bench.py [--only heart-4,lora-8]``. Writes
``bench/results/round.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "round.json"
FLAMBY = {"pooled": 0.776, "fedavg": 0.654}
CONFIGS = {"heart-4": ("heart", 8), "lora-8": ("bench-lora-8", 3), "heart-64": ("bench-heart-64", 3),
           "heart-256": ("bench-heart-256", 2), "heart-4-opt": ("heart", 8)}
WITH_CKKS = ("heart-4", "lora-8")
#: heart-4-opt's server optimizers (name -> ServerOpt keyword arguments)
OPTIMIZERS = {"fedavgm": {"name": "fedavgm", "momentum": 0.9}, "fedadam": {"name": "fedadam"}}


def _median_round(seconds: list[float]) -> float:
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def _aggregator_floor(enc: dict, plain: dict) -> float | None:
    """(plaintext round + extra aggregation seconds after the last reply) / plaintext
    round, from medians."""
    key = "aggregate_after_last_reply_seconds"
    a, b = [x for x in enc[key] if x is not None], [x for x in plain[key] if x is not None]
    if not a or not b:
        return None
    t = _median_round(plain["round_seconds"])
    return (t + max(0.0, _median_round(a) - _median_round(b))) / t


def _crypto_cpu_seconds(he: str, length: int, partners: int) -> float:
    """CPU seconds the partners of one round spend on HE: ``partners`` encryptions of a
    ``length``-value update and one decryption per worker process (min(partners, cores)),
    each the best of 3 with the campaign's codec."""
    import numpy as np

    from sealfl.he.codecs import generate, params_for

    codec = generate(params_for(he))
    v = np.random.default_rng(0).normal(0, 0.05, length)

    def best(fn):
        times = []
        for _ in range(3):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        return min(times)

    blob = codec.encrypt(v)
    enc, dec = best(lambda: codec.encrypt(v)), best(lambda: codec.decrypt(blob, length))
    return partners * enc + min(partners, os.cpu_count() or 1) * dec


def _cpu_estimate(enc: dict, plain: dict, crypto_cpu_s: float) -> float | None:
    """_aggregator_floor plus the partners' crypto CPU seconds spread over every core (an
    estimate, see the module docstring)."""
    agg = _aggregator_floor(enc, plain)
    if agg is None:
        return None
    return agg + crypto_cpu_s / (os.cpu_count() or 1) / _median_round(plain["round_seconds"])


def run(only: list[str]) -> dict:
    from sealfl.clients.plugins import get_task
    from sealfl.he import plain
    from sealfl.he.codecs import params_for
    from sealfl.he.server_opt import ServerOpt
    from sealfl.platform.campaign import CampaignSpec, run_campaign
    from sealfl.platform.consortium import create_consortium

    os.environ[plain.ENV] = plain.ENV_VALUE  # this process and its children only
    out: dict = {"flamby": FLAMBY, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="sealfl-round-bench-") as d:
        for name in only:
            task_name, rounds = CONFIGS[name]
            partners = list(get_task(task_name).partners)
            cfg: dict = {"task": task_name, "partners": len(partners), "rounds": rounds}
            runs = [("encrypted", params_for("bfv"), None), ("plaintext", plain.PlainParams(), None)]
            if name in WITH_CKKS:
                runs.insert(1, ("ckks", params_for("ckks"), None))
            if name == "heart-4-opt":
                runs = [(f"{o}_{label}", params, ServerOpt(**kw)) for o, kw in OPTIMIZERS.items()
                        for label, params in (("encrypted", params_for("bfv")), ("plaintext", plain.PlainParams()))]
            for label, params, opt in runs:
                cons, _ = create_consortium(Path(d) / f"c-{name}-{label}", f"bench-{label}", partners, params=params,
                                            task=task_name)
                t0 = time.perf_counter()
                res = run_campaign(CampaignSpec(str(cons.dir), str(Path(d) / f"camp-{name}-{label}"), rounds=rounds,
                                                min_partners=len(partners), server_opt=opt or ServerOpt()))
                recs = res.rounds
                cfg[label] = {
                    "wall_seconds": time.perf_counter() - t0,
                    "round_seconds": [r["round_seconds"] for r in recs],
                    "aggregate_seconds": [r.get("aggregate_seconds") for r in recs],
                    "aggregate_after_last_reply_seconds": [r.get("aggregate_after_last_reply_seconds") for r in recs],
                    "bytes_in_per_round": recs[-1].get("ciphertext_bytes_in"),
                    "pooled_test_accuracy": recs[-1]["pooled_test_accuracy"],
                    "coordinator_peak_rss_bytes": res.coordinator_peak_rss_bytes,
                }
                print(f"[round_bench] {name} {label}: rounds {['%.2f' % x for x in cfg[label]['round_seconds']]} s, "
                      f"coordinator peak RSS {(res.coordinator_peak_rss_bytes or 0) / 2**20:.0f} MiB", flush=True)
            if name == "heart-4-opt":
                out["configs"][name] = cfg
                continue
            cfg["round_ratio"] = _median_round(cfg["encrypted"]["round_seconds"]) / \
                _median_round(cfg["plaintext"]["round_seconds"])
            for label in ("encrypted", "ckks"):
                if label in cfg:
                    cfg[f"aggregator_floor_{label}"] = _aggregator_floor(cfg[label], cfg["plaintext"])
                    if name == "lora-8":
                        crypto = _crypto_cpu_seconds("bfv" if label == "encrypted" else "ckks",
                                                     get_task(task_name).n_params, len(partners))
                        cfg[f"crypto_cpu_seconds_{label}"] = crypto
                        cfg[f"cpu_estimate_{label}"] = _cpu_estimate(cfg[label], cfg["plaintext"], crypto)
            e, p = cfg["encrypted"]["coordinator_peak_rss_bytes"], cfg["plaintext"]["coordinator_peak_rss_bytes"]
            cfg["rss_ratio"] = e / p if e and p else None
            if "ckks" in cfg:
                cfg["round_ratio_ckks"] = _median_round(cfg["ckks"]["round_seconds"]) / \
                    _median_round(cfg["plaintext"]["round_seconds"])
                k = cfg["ckks"]["coordinator_peak_rss_bytes"]
                cfg["rss_ratio_ckks"] = k / p if k and p else None
            out["configs"][name] = cfg
    c = out["configs"]
    summary = {}
    if "heart-4" in c:
        summary.update({"P2.heart": c["heart-4"]["round_ratio"], "P6.ratio_4": c["heart-4"]["rss_ratio"],
                        "P3.encrypted": c["heart-4"]["encrypted"]["pooled_test_accuracy"],
                        "P3.plaintext": c["heart-4"]["plaintext"]["pooled_test_accuracy"],
                        "P2.heart_ckks": c["heart-4"].get("round_ratio_ckks"),
                        "P3.encrypted_ckks": c["heart-4"].get("ckks", {}).get("pooled_test_accuracy"),
                        "P6.ratio_4_ckks": c["heart-4"].get("rss_ratio_ckks")})
    if "lora-8" in c:
        # partners that do not train: what encryption costs per update, not a round ratio a user meets
        # (the real LoRA round is P2.llm, bench/pack_bench.py)
        summary["P2.lora8_update_cost"] = c["lora-8"]["round_ratio"]
        summary["P2.lora8_update_cost_ckks"] = c["lora-8"].get("round_ratio_ckks")
        summary["P2.lora_aggregator_floor"] = c["lora-8"].get("aggregator_floor_encrypted")
        summary["P2.lora_aggregator_floor_ckks"] = c["lora-8"].get("aggregator_floor_ckks")
        summary["P2.lora_cpu_estimate"] = c["lora-8"].get("cpu_estimate_encrypted")
        summary["P2.lora_cpu_estimate_ckks"] = c["lora-8"].get("cpu_estimate_ckks")
    for o in OPTIMIZERS:
        for label in ("encrypted", "plaintext"):
            if f"{o}_{label}" in c.get("heart-4-opt", {}):
                summary[f"P3.{o}_{label}"] = c["heart-4-opt"][f"{o}_{label}"]["pooled_test_accuracy"]
    for n in (64, 256):
        if f"heart-{n}" in c:
            summary[f"P6.ratio_{n}"] = c[f"heart-{n}"]["rss_ratio"]
    out["summary"] = {k: v for k, v in summary.items() if v is not None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    args = ap.parse_args()
    res = run([x for x in args.only.split(",") if x])
    print(f"{'config':10} {'enc round s':>12} {'plain round s':>14} {'ratio':>6} {'enc RSS MiB':>12} "
          f"{'plain RSS MiB':>14} {'RSS ratio':>9} {'enc acc':>8} {'plain acc':>9}")
    for name, c in res["configs"].items():
        if name == "heart-4-opt":
            for o in OPTIMIZERS:
                e, p = c[f"{o}_encrypted"], c[f"{o}_plaintext"]
                print(f"{'heart ' + o:10} {_median_round(e['round_seconds']):12.2f} "
                      f"{_median_round(p['round_seconds']):14.2f} {'':>6} {'':>12} {'':>14} {'':>9} "
                      f"{e['pooled_test_accuracy']:8.4f} {p['pooled_test_accuracy']:9.4f}")
            continue
        e, p = c["encrypted"], c["plaintext"]
        print(f"{name:10} {_median_round(e['round_seconds']):12.2f} {_median_round(p['round_seconds']):14.2f} "
              f"{c['round_ratio']:6.3f} {(e['coordinator_peak_rss_bytes'] or 0) / 2**20:12.0f} "
              f"{(p['coordinator_peak_rss_bytes'] or 0) / 2**20:14.0f} {c['rss_ratio'] or float('nan'):9.3f} "
              f"{e['pooled_test_accuracy']:8.4f} {p['pooled_test_accuracy']:9.4f}")
        if "ckks" in c:
            k = c["ckks"]
            print(f"{name + ' ckks':10} {_median_round(k['round_seconds']):12.2f} {'':>14} {c['round_ratio_ckks']:6.3f} "
                  f"{(k['coordinator_peak_rss_bytes'] or 0) / 2**20:12.0f} {'':>14} "
                  f"{c['rss_ratio_ckks'] or float('nan'):9.3f} {k['pooled_test_accuracy']:8.4f}")
    print(f"FLamby: pooled {FLAMBY['pooled']}, FedAvg {FLAMBY['fedavg']}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
