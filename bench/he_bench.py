"""Benchmark: CKKS cost of one encrypted FedAvg round vs model size.

For each model size P (float64 parameters) and 4 partners: time to encrypt one update,
ciphertext bytes per update and expansion over fp32, time to validate + add 4 updates
on the aggregator (in-process; and in 2 Ray tasks for the larger sizes), time to decrypt
and the max abs error of the weighted average against numpy.

Run: ``.venv/bin/python bench/he_bench.py [--sizes 14,10000,100000] [--ray]``.
Prints a table and writes ``bench/results/he.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from sealfl.common.he import CKKSCodec
from sealfl.server.aggregate import sum_chunks, validate_frames

OUT = Path(__file__).parent / "results" / "he.json"


def bench_size(secret: CKKSCodec, public: CKKSCodec, p: int, partners: int, use_ray: bool) -> dict:
    rng = np.random.default_rng(p)
    models = [rng.normal(0, 1, p) for _ in range(partners)]
    counts = rng.integers(30, 300, partners).astype(np.float64)
    t0 = time.perf_counter()
    frames = {f"p{i}": secret.encrypt(m * n) for i, (m, n) in enumerate(zip(models, counts))}
    enc_s = (time.perf_counter() - t0) / partners
    nbytes = len(frames["p0"])
    t0 = time.perf_counter()
    valid = validate_frames(public, frames, p)
    agg = sum_chunks(public, valid, p, shards=1)
    agg_s = time.perf_counter() - t0
    ray_s = None
    if use_ray:
        t0 = time.perf_counter()
        sum_chunks(public, valid, p, shards=2, shard_min_chunks=2)
        ray_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    avg = secret.decrypt(agg, p) / counts.sum()
    dec_s = time.perf_counter() - t0
    err = float(np.max(np.abs(avg - np.average(np.stack(models), axis=0, weights=counts))))
    return {"params": p, "partners": partners, "encrypt_s_per_update": enc_s, "ciphertext_bytes_per_update": nbytes,
            "expansion_vs_fp32": nbytes / (4 * p), "aggregate_s": agg_s, "aggregate_ray_2_tasks_s": ray_s,
            "decrypt_s": dec_s, "max_abs_error": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="14,4096,100000,1000000")
    ap.add_argument("--partners", type=int, default=4)
    ap.add_argument("--ray", action="store_true", help="also time the 2-task Ray-sharded sum")
    args = ap.parse_args()
    if args.ray:
        import ray

        ray.init(include_dashboard=False, log_to_driver=False)
    secret = CKKSCodec.generate()
    public = CKKSCodec.from_bytes(secret.public_context_bytes(), secret.params, secret.context_id)
    rows = [bench_size(secret, public, int(s), args.partners, args.ray) for s in args.sizes.split(",")]
    t = Table(title=f"CKKS FedAvg round, N={secret.params.poly_modulus_degree}, {args.partners} partners")
    for col in ("params", "encrypt s/update", "MB/update", "expansion", "aggregate s", "aggregate s (Ray x2)",
                "decrypt s", "max abs err"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r['params']:,}", f"{r['encrypt_s_per_update']:.3f}", f"{r['ciphertext_bytes_per_update'] / 1e6:.2f}",
                  f"{r['expansion_vs_fp32']:.1f}x", f"{r['aggregate_s']:.3f}",
                  "-" if r["aggregate_ray_2_tasks_s"] is None else f"{r['aggregate_ray_2_tasks_s']:.3f}",
                  f"{r['decrypt_s']:.3f}", f"{r['max_abs_error']:.1e}")
    Console(width=140).print(t)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": {"cpu_count": __import__("os").cpu_count(), "python": platform.python_version()},
                               "ckks": secret.params.to_dict(), "rows": rows}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
