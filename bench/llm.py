"""sealfl's INT4/INT8 LLM release vs llama.cpp on the same merged model, same prompts, same
machine, one run, interleaved. Writes ``bench/results/llm.json`` and prints a table.

    python bench/llm.py --demo llm-out            # the output of `make llm-demo`
    python bench/llm.py --demo llm-out --no-llama-cpp --no-load   # sealfl only

What it does:

1. the **merged fp32 model**: the campaign's final checkpoint opened by the consortium's
   release enclave (as ``release build`` does), the adapters merged into the pinned base;
2. **held-out text**: each partner's held-out blocks of 128 tokens (the gate's data);
3. **llama.cpp**: ``llama-cpp-python`` (pinned below) built from its PyPI sdist in the
   bench's own virtual environment ``bench/.llama-venv`` (nothing from a hub; no llama.cpp
   code in this repository); the merged model saved in Hugging Face form and converted by
   the sdist's vendored ``convert_hf_to_gguf.py`` (f32 GGUF), then quantised by
   ``llama_model_quantize`` to Q4_0, Q4_1 and Q4_K_M (:mod:`llm_llamacpp`);
4. **speed**, each engine in a fresh process, engines interleaved, ``--reps`` rounds
   (median reported): time to first token for a ~128-token prompt (median of 3 calls
   after loading), greedy decode tokens/s over 64 tokens, peak RSS (``VmHWM``; for sealfl
   the device process -- verification of the release included, keeping only the measured
   variant's bytes as ``device boot`` does -- plus its sandboxed
   child, also reported apart: ``parent_rss_bytes`` and ``child_rss_bytes`` are the two
   peaks, ``*_rss_after_decode_bytes`` the two ``VmRSS`` after the decode), file size;
   2 threads everywhere;
5. **quality** on the held-out blocks against the fp32 merged model (torch): top-1
   agreement and perplexity. sealfl is scored as its gate scores it (prefill over half a
   block, then token by token, :func:`sealfl.clients.causal_lm.scoring.candidate_scores`);
   llama.cpp evaluates each block in one batch with ``logits_all``;
6. **load**: ``sealfl device serve`` (INT4, ``--max-concurrent 2``) and ``--clients``
   streaming clients for ``--requests`` requests (a 429 is counted and retried after its
   ``Retry-After``): throughput, p50/p99 client-side first token latency (waits after a
   429 included), 429 count, peak RSS of the server's process tree (sampled every 50 ms).

``--quality-from-gate`` (sealfl only) takes agreement and perplexity from the release's
signed gate figures instead of rebuilding the merged model (which needs the consortium's
release enclave, sealed to the code that provisioned it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BENCH = Path(__file__).resolve().parent
VENV = BENCH / ".llama-venv"
CACHE = BENCH / ".cache"
LLAMA_CPP_PYTHON = "0.3.36"
# llama.cpp's own build: the shared library only (no server, tools, tests, llava)
CMAKE_ARGS = ("-DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF "
              "-DLLAMA_BUILD_SERVER=OFF")
GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K_M")
THREADS = 2
DECODE = 64
PROMPT_TOKENS = 128
RSS_PARTS = ("parent_rss_bytes", "child_rss_bytes", "parent_rss_after_decode_bytes", "child_rss_after_decode_bytes")


def log(msg: str) -> None:
    print(f"[bench/llm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- llama.cpp: its own venv and its sources ----------------------------------------------

def ensure_llama_venv() -> Path:
    py = VENV / "bin" / "python"
    if py.exists() and subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return py
    log(f"building llama-cpp-python {LLAMA_CPP_PYTHON} from its sdist in {VENV} (10-20 min on 2 cores)")
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-binary", "llama-cpp-python",
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True, env=env)
    return py


def llama_sources() -> Path:
    """The sdist's vendored llama.cpp (converter + gguf-py), unpacked under bench/.cache."""
    dest = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if (dest / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        return dest / "vendor" / "llama.cpp"
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(CACHE)], check=True)
    with tarfile.open(CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name and
                   any(k in m.name for k in ("convert_hf_to_gguf.py", "/conversion/", "/gguf-py/"))]
        tf.extractall(CACHE, members=members, filter="data")
    return dest / "vendor" / "llama.cpp"


# -- the merged model and the held-out text -----------------------------------------------

def merged_model(demo: Path):
    """``(bundle, merged torch model, head_dim)`` as ``release build`` computes them."""
    from sealfl.clients.causal_lm.merge import merge_adapters
    from sealfl.clients.plugins import get_task
    from sealfl.enclave.release.enclave import ReleaseEnclave
    from sealfl.enclave.release.keyholder import KeyHolder
    from sealfl.platform.campaign_outcome import finished_checkpoint
    from sealfl.platform.consortium import Consortium
    from sealfl.platform.release import enclave_dir, open_final_model

    cons = Consortium.load(demo / "consortium")
    task = get_task(cons.task)
    enclave = ReleaseEnclave.open(enclave_dir(cons))
    keys = KeyHolder(enclave, cons.he_params, bytes.fromhex(cons.context_id))
    params, _, _ = open_final_model(keys, finished_checkpoint(demo / "campaign"), task, demo / "campaign")
    bundle = task.bundle().clone()
    merged = merge_adapters(bundle.model, task.spec, params).eval()
    cfg = merged.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return task, bundle, merged, head_dim


def heldout(task, per_partner: int):
    import numpy as np

    blocks = [task.load_data(p, {"eval-blocks": per_partner}).heldout for p in task.partners]
    return np.concatenate(blocks, axis=0)


def save_hf(merged, bundle, out: Path) -> None:
    """The merged model in Hugging Face form for llama.cpp's converter."""
    merged.save_pretrained(out)
    (out / "tokenizer.json").write_bytes(bundle.tokenizer_json)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(bundle.tokenizer_json.decode())
    eos = bundle.generation["eos_token_ids"][0]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "chat_template": bundle.chat_template,
        "bos_token": tok.id_to_token(bundle.generation["bos_token_id"]), "eos_token": tok.id_to_token(eos),
        "pad_token": tok.id_to_token(bundle.generation["pad_token_id"]), "add_bos_token": False}))


# -- measurements ---------------------------------------------------------------------------

def _vm(pid: int, field: str = "VmHWM") -> int:
    """``field`` of /proc/PID/status in bytes (``VmHWM``: peak resident, ``VmRSS``: now)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sealfl_speed_child(trust: str, release: str, variant: str, prompt_file: str) -> dict:
    """In its own process: verify the release as a device does, start the sandboxed runtime
    of ``variant``, time first tokens and the decode."""
    from sealfl.enclave.device.llm_boot import llm_files_to_keep, llm_spec
    from sealfl.enclave.device.verify import verify_dir
    from sealfl.enclave.sandbox.decode import SamplingParams
    from sealfl.enclave.sandbox.llm_runtime import LLMRuntime

    # as device boot does: only the chosen variant's bytes are kept, the other is hashed as it streams
    v = verify_dir(trust, release, keep=lambda s: llm_files_to_keep(s.metadata, [e.path for e in s.files], variant))
    spec = llm_spec(v.payload, v.metadata, variant)
    gen = {**spec.generation, "eos_token_ids": [10**7]}  # never met: decode runs its full length
    prompt = json.load(open(prompt_file))
    with LLMRuntime(v.payload[spec.model_file], v.payload[spec.files["tokenizer"]],
                    v.payload[spec.files["chat_template"]].decode(), gen, intra_op_threads=THREADS) as rt:
        del v
        rt.generate(prompt[:16], SamplingParams(max_tokens=2))  # as device serve's warm-up does
        ttfts = [rt.generate(prompt, SamplingParams(max_tokens=1)).seconds_to_first_token for _ in range(3)]
        r = rt.generate(prompt, SamplingParams(max_tokens=DECODE + 1))
        child = {"peak": _vm(rt.pid), "now": _vm(rt.pid, "VmRSS")}
    parent = {"peak": _vm(os.getpid()), "now": _vm(os.getpid(), "VmRSS")}
    return {"ttft_s": statistics.median(ttfts), "ttft_all_s": ttfts,
            "decode_tok_s": DECODE / (r.seconds - r.seconds_to_first_token),
            "peak_rss_bytes": parent["peak"] + child["peak"],
            "parent_rss_bytes": parent["peak"], "child_rss_bytes": child["peak"],
            "parent_rss_after_decode_bytes": parent["now"], "child_rss_after_decode_bytes": child["now"]}


def run_json(cmd: list, timeout: float = 1800) -> dict:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_figure(trust: Path, release: Path, clients: int, requests: int, prompt_text: str) -> dict:
    """``device serve`` with 2 slots under ``clients`` streaming clients (module docstring)."""
    import httpx

    from sealfl.platform.llm.demo import _tree_rss

    with tempfile.TemporaryDirectory(prefix="sealfl-bench-") as tmp:
        port_file = Path(tmp) / "port"
        # a device serves only from a provisioned state (its TEE); the bench's is the labelled simulation
        prov = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "device", "provision", "--state",
                               str(Path(tmp) / "state"), "--tee", "sim"], capture_output=True, text=True)
        if prov.returncode != 0:
            raise RuntimeError(f"device provision failed ({prov.returncode}): {prov.stderr[-2000:]}")
        proc = subprocess.Popen([sys.executable, "-m", "sealfl.platform.cli", "device", "serve", "--trust", str(trust),
                                 "--release", str(release), "--state", str(Path(tmp) / "state"), "--port", "0",
                                 "--port-file", str(port_file), "--max-concurrent", "2"],
                                stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "serve.log", "wb"))
        peak, stop = [0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _tree_rss(proc.pid))
                stop.wait(0.05)

        threading.Thread(target=sample, daemon=True).start()
        try:
            deadline = time.monotonic() + 900
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"device serve did not come up: {(Path(tmp) / 'serve.log').read_text()}")
                if port_file.exists() and port_file.read_text().strip():
                    url = f"http://127.0.0.1:{int(port_file.read_text())}"
                    try:
                        if httpx.get(url + "/health", timeout=10).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                time.sleep(0.2)
            todo, lock = list(range(requests)), threading.Lock()
            ttfts, tokens, rejected = [], [0], [0]

            def one(body: dict, t0: float) -> bool:
                """One attempt; False on 429 (retried by the caller after Retry-After)."""
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
                    if r.status_code == 429:
                        with lock:
                            rejected[0] += 1
                        return False
                    first = None
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if first is None and ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                            first = time.perf_counter() - t0
                        if ev.get("usage"):
                            with lock:
                                tokens[0] += ev["usage"]["completion_tokens"]
                    with lock:
                        ttfts.append(first if first is not None else time.perf_counter() - t0)
                return True

            def client():
                while True:
                    with lock:
                        if not todo:
                            return
                        todo.pop()
                    body = {"messages": [{"role": "user", "content": prompt_text}], "max_tokens": 32,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                    t0 = time.perf_counter()  # first-token latency includes the waits after 429s
                    while not one(body, t0):
                        time.sleep(1.0)  # the server's Retry-After

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client) for _ in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
        finally:
            stop.set()
            proc.terminate()
            proc.wait(timeout=60)
    q = statistics.quantiles(ttfts, n=100, method="inclusive") if len(ttfts) > 1 else ttfts * 99
    return {"clients": clients, "requests": requests, "max_concurrent": 2, "max_tokens": 32,
            "completed": len(ttfts), "rejected_429": rejected[0], "throughput_tok_s": tokens[0] / wall,
            "ttft_p50_s": q[49], "ttft_p99_s": q[98], "peak_rss_bytes": peak[0], "seconds": wall}


# -- main ---------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", type=Path, default=REPO / "llm-out", help="output directory of `make llm-demo`")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "llm.json")
    ap.add_argument("--reps", type=int, default=2, help="interleaved speed rounds (median reported)")
    ap.add_argument("--blocks-per-partner", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--quality-from-gate", action="store_true",
                    help="sealfl only: take agreement/perplexity from the release's signed gate figures (no "
                         "enclave, no merged model, no llama.cpp)")
    ap.add_argument("--no-load", action="store_true")
    ap.add_argument("--sealfl-speed-child", nargs=4, metavar=("TRUST", "RELEASE", "VARIANT", "PROMPT"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.sealfl_speed_child:
        print(json.dumps(sealfl_speed_child(*a.sealfl_speed_child)))
        return 0
    import numpy as np

    from sealfl.clients.causal_lm.scoring import candidate_scores, reference_scores
    from sealfl.platform.llm.gate import compare

    demo = a.demo.resolve()
    trust, release = demo / "consortium" / "trust", demo / "release"
    if not (release / "model.int4.onnx").is_file() or not (demo / "campaign").is_dir():
        print(f"bench/llm.py: {demo} holds no LLM demo output (release/, campaign/, consortium/); run "
              "`make llm-demo` first or pass --demo", file=sys.stderr)
        return 2
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="sealfl-bench-llm-"))
    engines: dict[str, dict] = {}
    from tokenizers import Tokenizer

    if a.quality_from_gate:
        # the release's signed gate figures: the partners scored each variant against the fp32
        # merged model on their held-out text (sealfl.platform.llm.gate); no enclave needed
        from sealfl.clients.causal_lm.corpus import load_partner_text
        from sealfl.enclave.device.verify import verify_dir

        v = verify_dir(trust, release)
        tok = Tokenizer.from_str(v.payload[v.metadata["files"]["tokenizer"]].decode())
        for name, var in v.metadata["variants"].items():
            g = var["gate"]
            engines[f"sealfl {name.upper()}"] = {
                "kind": "sealfl", "variant": name, "file_bytes": len(v.payload[var["file"]]),
                "quality_source": "release gate (partners' held-out text)", **{k: g[k] for k in (
                    "positions", "top1_agreement", "perplexity_fp32", "perplexity", "perplexity_ratio")}}
        del v
        blocks = None
        text = " ".join(load_partner_text("tutorial").heldout)[:4000]
        llama_py = None
    else:
        llama_py = None if a.no_llama_cpp else ensure_llama_venv()
        log("merged fp32 model (release enclave opens the final checkpoint)")
        task, bundle, merged, head_dim = merged_model(demo)
        blocks = heldout(task, a.blocks_per_partner)
        log(f"held-out: {blocks.shape[0]} blocks of {blocks.shape[1]} tokens; fp32 reference")
        ref = reference_scores(merged, blocks)
        tok = Tokenizer.from_str(bundle.tokenizer_json.decode())
        text = " ".join(tok.decode(list(b)) for b in blocks[:2])
        (work / "blocks.json").write_text(json.dumps(blocks.tolist()))
        for v in ("int4", "int8"):
            data = (release / f"model.{v}.onnx").read_bytes()
            c = compare(ref, candidate_scores(data, blocks, head_dim, blocks.shape[1] // 2))
            engines[f"sealfl {v.upper()}"] = {"kind": "sealfl", "variant": v, "file_bytes": len(data),
                                              "quality_source": "bench held-out blocks", **c.to_dict()}
            del data
    prompt = tok.encode(text, add_special_tokens=False).ids[:PROMPT_TOKENS]
    (work / "prompt.json").write_text(json.dumps(prompt))
    if llama_py is not None:
        src = llama_sources()
        hf = work / "hf"
        save_hf(merged, bundle, hf)
        log("llama.cpp: convert_hf_to_gguf.py (f32), then llama_model_quantize")
        subprocess.run([sys.executable, src / "convert_hf_to_gguf.py", hf, "--outtype", "f32", "--outfile",
                        work / "merged-f32.gguf"], check=True, capture_output=True)
        for q in GGUF_TYPES:
            g = work / f"merged-{q}.gguf"
            run_json([llama_py, BENCH / "llm_llamacpp.py", "quantize", work / "merged-f32.gguf", g, q])
            res = run_json([llama_py, BENCH / "llm_llamacpp.py", "quality", g, work / "blocks.json", THREADS])
            cand = [(np.asarray(t, dtype=np.int64), np.asarray(n)) for t, n in res["blocks"]]
            engines[f"llama.cpp {q}"] = {"kind": "llama.cpp", "gguf": q, "file_bytes": g.stat().st_size,
                                         "path": str(g), "quality_source": "bench held-out blocks",
                                         **compare(ref, cand).to_dict()}
        del merged
    speeds: dict[str, list] = {k: [] for k in engines}
    for rep in range(a.reps):
        for name, e in engines.items():
            log(f"speed round {rep + 1}/{a.reps}: {name}")
            if e["kind"] == "sealfl":
                cmd = [sys.executable, Path(__file__), "--sealfl-speed-child", trust, release, e["variant"],
                       work / "prompt.json"]
            else:
                cmd = [llama_py, BENCH / "llm_llamacpp.py", "speed", e["path"], work / "prompt.json", THREADS, DECODE]
            speeds[name].append(run_json(cmd))
    for name, runs in speeds.items():
        engines[name].update({"ttft_s": statistics.median(r["ttft_s"] for r in runs),
                              "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                              "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs), "runs": runs})
        for key in RSS_PARTS:  # sealfl: the device process and its sandboxed child, each at its peak
            if all(key in r for r in runs):
                engines[name][key] = max(r[key] for r in runs)
        engines[name].pop("path", None)
    load = None if a.no_load else load_figure(trust, release, a.clients, a.requests,
                                              "What is the difference between a list and a tuple in Python?")
    result = {"machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg(),
                          "cpu_flags": sorted({f for f in ("avx2", "avx512_vnni", "avx_vnni") if f in
                                               open("/proc/cpuinfo").read().split()})},
              "settings": {"threads": THREADS, "prompt_tokens": len(prompt), "decode_tokens": DECODE,
                           "reps": a.reps, "heldout_blocks": None if blocks is None else list(blocks.shape),
                           "llama_cpp_python": None if llama_py is None else LLAMA_CPP_PYTHON},
              "release": {"dir": str(release)}, "engines": engines, "load": load,
              "seconds": time.perf_counter() - t_all}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


def table(result: dict) -> str:
    rows = ["| engine | MB | TTFT 128 s | decode tok/s | peak RSS MiB (parent + child) | top-1 agree | ppl (fp32) |",
            "|---|---|---|---|---|---|---|"]
    for name, e in result["engines"].items():
        rss = f"{e.get('peak_rss_bytes', 0) / 2**20:.0f}"
        if "parent_rss_bytes" in e:
            rss += f" ({e['parent_rss_bytes'] / 2**20:.0f} + {e['child_rss_bytes'] / 2**20:.0f})"
        rows.append(f"| {name} | {e['file_bytes'] / 1e6:.1f} | {e.get('ttft_s', float('nan')):.3f} | "
                    f"{e.get('decode_tok_s', float('nan')):.1f} | {rss} | "
                    f"{e['top1_agreement']:.3f} | {e['perplexity']:.2f} ({e['perplexity_fp32']:.2f}) |")
    if result.get("load"):
        ld = result["load"]
        rows.append(f"\nload: {ld['clients']} streaming clients, {ld['requests']} requests, device serve INT4 "
                    f"--max-concurrent {ld['max_concurrent']}: {ld['throughput_tok_s']:.1f} tok/s, first token "
                    f"p50 {ld['ttft_p50_s']:.2f} s / p99 {ld['ttft_p99_s']:.2f} s, {ld['rejected_429']} x 429, "
                    f"peak RSS {ld['peak_rss_bytes'] / 2**20:.0f} MiB")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
