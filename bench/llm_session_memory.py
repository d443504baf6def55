"""The sandboxed LLM child's memory while it builds its onnxruntime session, per session option
(issue 24, item 2). Run by hand on a release's model file:

    python bench/llm_session_memory.py --model llm-out/release/model.int4.onnx [--reps 2]

Every configuration runs in a fresh process that does what the child does (``GLIBC_TUNABLES``
as the child's, onnxruntime imported, the model as one ``bytes`` object as it arrives from the
pipe -- or, for ``path``, a file name -- then ``InferenceSession``, the bytes dropped,
``malloc_trim``, :class:`~sealfl.enclave.sandbox.decode.KVDecoder`) and reports, in MiB:

``memfd``: the bytes are written into a memory file (``memfd_create``) and dropped, and the
session is built from its ``/proc/self/fd`` path -- what a child can do with the pipe's bytes.

* ``import``: resident memory after importing onnxruntime (before the model);
* ``build_peak``: the process's peak (``VmHWM``) once the session is built -- the figure the
  issue calls the construction peak (the model bytes included, as in the child);
* ``settled``: ``VmRSS`` after the bytes are dropped and the heap trimmed;
* ``decode_peak`` / ``after_decode``: ``VmHWM`` / ``VmRSS`` after a 128-token prefill and 64
  greedy steps;

plus ms per decode step and the SHA-256 of every step's float32 logits row, which must equal
the baseline's for an option to be acceptable (outputs unchanged). Configurations run
interleaved, ``--reps`` rounds, medians printed; the load average is printed with them.
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

#: name -> (load from "bytes" or "path", SessionOptions attributes, session config entries)
CONFIGS: dict[str, tuple[str, dict, dict]] = {
    "baseline": ("bytes", {}, {}),
    "path": ("path", {}, {}),
    "memfd": ("memfd", {}, {}),
    "no_arena": ("bytes", {"enable_cpu_mem_arena": False}, {}),
    "no_mem_pattern": ("bytes", {"enable_mem_pattern": False}, {}),
    "init_device_alloc": ("bytes", {}, {"session.use_device_allocator_for_initializers": "1"}),
    "no_prepack": ("bytes", {}, {"session.disable_prepacking": "1"}),
    "opt_extended": ("bytes", {"graph_optimization_level": "ORT_ENABLE_EXTENDED"}, {}),
    "opt_basic": ("bytes", {"graph_optimization_level": "ORT_ENABLE_BASIC"}, {}),
    "no_arena+init_device_alloc": ("bytes", {"enable_cpu_mem_arena": False},
                                   {"session.use_device_allocator_for_initializers": "1"}),
    "path+no_arena+init_device_alloc": ("path", {"enable_cpu_mem_arena": False},
                                        {"session.use_device_allocator_for_initializers": "1"}),
}


def _vm(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def one(model: str, name: str, threads: int) -> dict:
    """In a fresh process: build the session as configured and decode (module docstring)."""
    import numpy as np
    import onnxruntime as ort

    from sealfl.enclave.sandbox import child as rc
    from sealfl.enclave.sandbox.decode import KVDecoder

    mode, attrs, entries = CONFIGS[name]
    out = {"import": _vm("VmRSS")}
    data = Path(model).read_bytes() if mode != "path" else model
    if mode == "memfd":  # as a child would: the bytes into a sealed memory file, then its path
        fd = os.memfd_create("model", os.MFD_ALLOW_SEALING)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        del view, data
        data = f"/proc/self/fd/{fd}"
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for k, v in attrs.items():
        setattr(opts, k, getattr(ort.GraphOptimizationLevel, v) if k == "graph_optimization_level" else v)
    for k, v in entries.items():
        opts.add_session_config_entry(k, v)
    t0 = time.perf_counter()
    sess = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    out["build_s"] = time.perf_counter() - t0
    out["build_peak"] = _vm("VmHWM")
    del data
    rc.release_model_bytes(sess)
    out["settled"] = _vm("VmRSS")
    gen = json.loads((Path(model).parent / "generation_config.json").read_text())
    dec = KVDecoder(sess, max_context=gen["max_context"], head_dim=gen["head_dim"])
    prompt = [int(i) for i in np.random.default_rng(0).integers(100, 40000, 128)]
    h = hashlib.sha256()
    logits = dec.feed(prompt, last_only=True, copy=False)[-1]
    h.update(logits.tobytes())
    steps = []
    for _ in range(64):
        tok = int(np.argmax(logits))
        t0 = time.perf_counter()
        logits = dec.feed([tok], last_only=True, copy=False)[-1]
        steps.append(time.perf_counter() - t0)
        h.update(logits.tobytes())
    out.update({"decode_peak": _vm("VmHWM"), "after_decode": _vm("VmRSS"), "ms_per_step": 1e3 * statistics.median(steps),
                "logits_sha256": h.hexdigest(), "shared_kv_buffer": dec.shared_buffer})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="configuration names (default: all)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="write the medians as JSON here")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.model, a.one, a.threads)))
        return 0
    names = a.only or list(CONFIGS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "OMP_NUM_THREADS": "1"}
    runs: dict[str, list] = {n: [] for n in names}
    loads = [os.getloadavg()[0]]
    for _ in range(a.reps):
        for n in names:
            r = subprocess.run([sys.executable, __file__, "--model", a.model, "--one", n, "--threads", str(a.threads)],
                               capture_output=True, text=True, env=env)
            if r.returncode:
                print(f"{n}: failed: {r.stderr[-1500:]}", file=sys.stderr)
                continue
            runs[n].append(json.loads(r.stdout.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])
    base = runs.get("baseline", [{}])[0].get("logits_sha256") if runs.get("baseline") else None
    mib = 2 ** 20
    print(f"model {a.model} ({os.path.getsize(a.model) / 1e6:.1f} MB), {a.threads} threads, {a.reps} reps; "
          f"load average {min(loads):.2f}..{max(loads):.2f}")
    print("| config | import | build peak | settled | decode peak | after decode (MiB) | build s | ms/step | logits |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = {}
    for n, rs in runs.items():
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in ("import", "build_peak", "settled", "decode_peak",
                                                                 "after_decode", "build_s", "ms_per_step")}
        same = all(r["logits_sha256"] == base for r in rs) if base else None
        table[n] = {**med, "logits_equal_baseline": same, "runs": rs}
        print(f"| {n} | {med['import'] / mib:.0f} | {med['build_peak'] / mib:.0f} | {med['settled'] / mib:.0f} | "
              f"{med['decode_peak'] / mib:.0f} | {med['after_decode'] / mib:.0f} | {med['build_s']:.2f} | "
              f"{med['ms_per_step']:.1f} | {'same' if same else 'DIFFERENT' if same is False else '?'} |")
    if a.out:
        a.out.write_text(json.dumps({"model": a.model, "threads": a.threads, "load": loads, "configs": table},
                                    indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
