"""Where a decode step's time goes in the sandboxed LLM child, and what the thread count does
(issue 24, item 1). Run by hand on a release's model file:

    python bench/llm_step_profile.py --model llm-out/release/model.int4.onnx [--threads 1 2] [--reps 3]

Each configuration runs in a fresh process, as the child does (spinning off, the shared KV
buffer, the last position's logits in one preallocated row): a 128-token prefill, then 64
steps. Per step it times the graph (``KVDecoder.feed``) apart from the token choice
(:func:`~sealfl.enclave.sandbox.decode.choose_token`) for greedy decoding, temperature 0.7,
and temperature 0.7 with top-p 0.9, and hashes the greedy run's logits (thread counts must
give the same). Thread counts alternate, ``--reps`` rounds; medians; the load average and
the busy cores seen by :func:`sealfl.enclave.sandbox.threads.busy_cpus` are printed with them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(model: str, threads: int) -> dict:
    import numpy as np
    import onnxruntime as ort

    from sealfl.enclave.sandbox.decode import KVDecoder, SamplingParams, choose_token

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    gen = json.loads((Path(model).parent / "generation_config.json").read_text())
    dec = KVDecoder(sess, max_context=gen["max_context"], head_dim=gen["head_dim"])
    prompt = [int(i) for i in np.random.default_rng(0).integers(100, 40000, 128)]
    out = {}
    for label, params in (("greedy", SamplingParams()), ("t0.7", SamplingParams(temperature=0.7)),
                          ("t0.7_p0.9", SamplingParams(temperature=0.7, top_p=0.9))):
        rng = np.random.default_rng(0)
        dec.reset()
        h = hashlib.sha256()
        t0 = time.perf_counter()
        logits = dec.feed(prompt, last_only=True, copy=False)[-1]
        prefill = time.perf_counter() - t0
        graph, choose = [], []
        for _ in range(64):
            t0 = time.perf_counter()
            tok = choose_token(logits, params, rng)
            t1 = time.perf_counter()
            logits = dec.feed([tok], last_only=True, copy=False)[-1]
            t2 = time.perf_counter()
            h.update(logits.tobytes())
            choose.append(t1 - t0)
            graph.append(t2 - t1)
        out[label] = {"prefill_s": prefill, "graph_ms": 1e3 * statistics.median(graph),
                      "choose_ms": 1e3 * statistics.median(choose), "sha256": h.hexdigest()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.model, a.one)))
        return 0
    sys.path.insert(0, str(REPO))
    from sealfl.enclave.sandbox.threads import busy_cpus

    env = {**os.environ, "PYTHONPATH": str(REPO), "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "OMP_NUM_THREADS": "1"}
    runs: dict[int, list] = {t: [] for t in a.threads}
    seen = []
    for _ in range(a.reps):
        for t in a.threads:
            seen.append((os.getloadavg()[0], busy_cpus(0.5)))
            r = subprocess.run([sys.executable, __file__, "--model", a.model, "--one", str(t)], capture_output=True,
                               text=True, env=env, check=True)
            runs[t].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"{a.model}, {a.reps} alternating rounds; load average {min(s[0] for s in seen):.2f}.."
          f"{max(s[0] for s in seen):.2f}, busy cores (other work) "
          f"{min(s[1] or 0 for s in seen):.2f}..{max(s[1] or 0 for s in seen):.2f} of {os.cpu_count()}")
    print("| threads | mode | prefill s | graph ms/step | choice ms/step | logits (greedy) |")
    print("|---|---|---|---|---|---|")
    table = {}
    ref = runs[a.threads[0]][0]["greedy"]["sha256"]
    for t, rs in runs.items():
        for mode in rs[0]:
            med = {k: statistics.median(r[mode][k] for r in rs) for k in ("prefill_s", "graph_ms", "choose_ms")}
            same = all(r["greedy"]["sha256"] == ref for r in rs)
            table[f"{t}/{mode}"] = med
            print(f"| {t} | {mode} | {med['prefill_s']:.3f} | {med['graph_ms']:.2f} | {med['choose_ms']:.3f} | "
                  f"{'same' if same else 'DIFFERENT'} |")
    if a.out:
        a.out.write_text(json.dumps({"seen": seen, "table": table, "runs": {str(k): v for k, v in runs.items()}},
                                    indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
