"""Benchmark: bytes on the wire and throughput of sealfl's codecs vs NVFlare's CKKS defaults.

P1 = ciphertext bytes per parameter / 4 (expansion over fp32) of one partner's update,
for the default ``sealfl.he.bfv`` (N=4096, [32,32,40], t 54-bit, two 27-bit values
per slot; ``P1.sealfl``), for ``sealfl.he.ckks`` (``--he ckks``, NVFlare's
parameters in sealfl's frames; ``P1.sealfl_ckks``) and for CKKS with NVFlare's defaults
as NVFlare sends them (N=8192, [60,40,40], scale 2^40: 4096 values per ciphertext,
TenSEAL serialisation),
on the same update, at 14 (heart), 100,000 and 460,800 (LoRA) parameters. Throughput
(parameters per second, one process) of encryption, aggregation (parse + check + add
into the running sum, per partner update, as the aggregator does) and decryption at LoRA size with 8 partners, and the max error of the
encrypted weighted sum against NumPy next to the SecAgg+ quantisation step (16 / 2^22).

Run: ``.venv/bin/python bench/codec_bench.py [--sizes 14,100000,460800] [--partners 8]``.
Prints a table and writes ``bench/results/codec.json`` (its ``summary`` feeds
``bench/results/summary.json``, see ``bench/run_all.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from sealfl.he.bfv import BFVCodec
from sealfl.he.ckks import CKKSCodec
from sealfl.server.aggregate import RunningSum

OUT = Path(__file__).parent / "results" / "codec.json"
SECAGG_STEP = 16.0 / 2**22


def nvflare_ckks_bytes(update: np.ndarray) -> int:
    """Bytes of ``update`` as CKKS ciphertexts with NVFlare's HE defaults (TenSEAL):
    one CKKSVector per 4096 values, serialised, plus a 4-byte length each."""
    import tenseal as ts

    ctx = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=8192, coeff_mod_bit_sizes=[60, 40, 40])
    ctx.global_scale = 2.0**40
    return sum(4 + len(ts.ckks_vector(ctx, update[i:i + 4096].tolist()).serialize())
               for i in range(0, len(update), 4096))


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _aggregate(codec, frames: list[bytes], length: int) -> bytes:
    """What the aggregator does with a round's updates: split, parse and check each frame
    (``load_chunks``) and add its parsed chunks into the round's running sum
    (``sealfl.server.aggregate.RunningSum``), then frame the sum."""
    running = RunningSum(codec, length)
    for f in frames:
        n, chunks = codec.split(f, length)
        running.add(codec.load_chunks(chunks, n))
    return running.frame()


def bench(sizes: list[int], partners: int) -> dict:
    bfv = BFVCodec.generate()
    bfv_pub = BFVCodec.from_bytes(bfv.public_context_bytes(), bfv.params, bfv.context_id)
    ckks = CKKSCodec.generate()
    rows = []
    for p in sizes:
        rng = np.random.default_rng(p)
        update = rng.normal(0, 0.5, p)
        rows.append({"params": p, "sealfl_bytes": len(bfv.encrypt(update)),
                     "sealfl_ckks_bytes": len(ckks.encrypt(update)),
                     "nvflare_default_bytes": nvflare_ckks_bytes(update)})
        rows[-1]["sealfl_x"] = rows[-1]["sealfl_bytes"] / (4 * p)
        rows[-1]["sealfl_ckks_x"] = rows[-1]["sealfl_ckks_bytes"] / (4 * p)
        rows[-1]["nvflare_default_x"] = rows[-1]["nvflare_default_bytes"] / (4 * p)
    p = max(sizes)
    rng = np.random.default_rng(0)
    w = np.clip(rng.normal(0, 0.5, (partners, p)), -7.9, 7.9)
    n = rng.integers(50, 500, partners)
    scaled = w * (n / n.sum())[:, None]
    frames, enc_s = _timed(lambda: [bfv.encrypt(v) for v in scaled])
    agg, agg_s = _timed(lambda: _aggregate(bfv_pub, frames, p))
    dec, dec_s = _timed(lambda: bfv.decrypt(agg, p))
    err = float(np.max(np.abs(dec - scaled.sum(axis=0))))
    thr = {"params": p, "partners": partners, "encrypt_params_per_s": partners * p / enc_s,
           "aggregate_params_per_s": partners * p / agg_s, "aggregate_updates_per_s": partners / agg_s,
           "decrypt_params_per_s": p / dec_s,
           "max_abs_error": err, "secagg_step": SECAGG_STEP}
    lora = next(r for r in rows if r["params"] == p)
    return {"cpu_count": os.cpu_count(), "sealfl_params": bfv.params.to_dict(), "rows": rows, "throughput": thr,
            "summary": {"P1.sealfl": lora["sealfl_x"], "P1.nvflare_default": lora["nvflare_default_x"],
                        "P1.sealfl_ckks": lora["sealfl_ckks_x"],
                        "throughput.encrypt_params_per_s": thr["encrypt_params_per_s"],
                        "throughput.aggregate_params_per_s": thr["aggregate_params_per_s"],
                        "throughput.decrypt_params_per_s": thr["decrypt_params_per_s"],
                        # whole updates of this size the aggregator parses, checks and adds per second
                        **({"throughput.aggregate_lora_updates_per_s": thr["aggregate_updates_per_s"]}
                           if p == 460_800 else {})}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="14,100000,460800")
    ap.add_argument("--partners", type=int, default=8)
    args = ap.parse_args()
    res = bench([int(s) for s in args.sizes.split(",")], args.partners)
    t = Table(title="P1: bytes on the wire per parameter / 4 (one partner's update)")
    for col in ("params", "sealfl BFV bytes", "BFV x", "sealfl CKKS bytes", "CKKS x", "NVFlare CKKS bytes",
                "NVFlare x"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(f"{r['params']:,}", f"{r['sealfl_bytes']:,}", f"{r['sealfl_x']:.2f}", f"{r['sealfl_ckks_bytes']:,}",
                  f"{r['sealfl_ckks_x']:.2f}", f"{r['nvflare_default_bytes']:,}", f"{r['nvflare_default_x']:.2f}")
    Console(width=120).print(t)
    thr = res["throughput"]
    print(f"throughput at {thr['params']:,} params x {thr['partners']} partners: encrypt "
          f"{thr['encrypt_params_per_s']:,.0f}/s, aggregate {thr['aggregate_params_per_s']:,.0f}/s, decrypt "
          f"{thr['decrypt_params_per_s']:,.0f}/s; max error {thr['max_abs_error']:.2e} "
          f"(SecAgg+ step {SECAGG_STEP:.2e})")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
