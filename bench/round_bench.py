"""Benchmark: encrypted vs plaintext FedAvg rounds, same task, data and run (P2.heart, P3).

Two consortia of the 4 Fed-Heart-Disease hospitals are created in one temporary
directory: one with the campaign codec (packed BFV, ``sealfl.common.bfv``) and one with
the benchmark-only plaintext baseline (``sealfl.common.plain``: the same ClientApp and
ServerApp, updates as float64 in clear; this script opts in for its own child processes
only). Each runs the same campaign (Flower simulation on a local Ray, ``--rounds``
rounds, all 4 partners required). Reported:

- **P2.heart** = median round wall time (train + evaluate, from ``rounds.jsonl``)
  encrypted / plaintext, rounds 2.. (round 1 includes Ray actor warm-up);
- **P3.encrypted / P3.plaintext** = pooled test accuracy after the last round, beside
  FLamby's published pooled 0.776 and FedAvg 0.654.

Run: ``.venv/bin/python bench/round_bench.py [--rounds 5]``. Writes ``bench/results/round.json``.
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


def run(rounds: int) -> dict:
    from sealfl.clients.data import HOSPITALS
    from sealfl.common import plain
    from sealfl.platform.campaign import CampaignSpec, run_campaign
    from sealfl.platform.consortium import create_consortium

    os.environ[plain.ENV] = plain.ENV_VALUE  # this process and its children only
    out: dict = {"rounds": rounds, "flamby": FLAMBY, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="sealfl-round-bench-") as d:
        for label, params in (("encrypted", None), ("plaintext", plain.PlainParams())):
            cons, _ = create_consortium(Path(d) / f"c-{label}", f"bench-{label}", list(HOSPITALS), params=params)
            t0 = time.perf_counter()
            res = run_campaign(CampaignSpec(str(cons.dir), str(Path(d) / f"camp-{label}"), rounds=rounds,
                                            min_partners=len(HOSPITALS)))
            recs = res.rounds
            out["runs"][label] = {
                "wall_seconds": time.perf_counter() - t0,
                "round_seconds": [r["round_seconds"] for r in recs],
                "aggregate_seconds": [r.get("aggregate_seconds") for r in recs],
                "bytes_in_per_round": [r.get("ciphertext_bytes_in") for r in recs],
                "pooled_test_accuracy": recs[-1]["pooled_test_accuracy"],
            }
    enc, pla = out["runs"]["encrypted"], out["runs"]["plaintext"]
    tail = slice(1, None) if rounds > 1 else slice(None)
    ratio = statistics.median(enc["round_seconds"][tail]) / statistics.median(pla["round_seconds"][tail])
    out["summary"] = {"P2.heart": ratio, "P3.encrypted": enc["pooled_test_accuracy"],
                      "P3.plaintext": pla["pooled_test_accuracy"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    res = run(args.rounds)
    for label, r in res["runs"].items():
        print(f"{label:10} rounds {['%.2f' % s for s in r['round_seconds']]} s, bytes in/round "
              f"{r['bytes_in_per_round'][-1]:,}, pooled test accuracy {r['pooled_test_accuracy']:.4f}")
    s = res["summary"]
    print(f"P2.heart = {s['P2.heart']:.3f}; P3 encrypted {s['P3.encrypted']:.4f} vs plaintext {s['P3.plaintext']:.4f} "
          f"(FLamby pooled {FLAMBY['pooled']}, FedAvg {FLAMBY['fedavg']})")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
