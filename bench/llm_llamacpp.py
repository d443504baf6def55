"""llama.cpp's side of ``bench/llm.py``; runs in the bench's own virtual environment
(``llama-cpp-python`` built from its PyPI sdist, numpy) -- never imports sealfl.

    llm_llamacpp.py quantize IN.gguf OUT.gguf {Q4_0,Q4_1,Q4_K_M}
    llm_llamacpp.py speed GGUF PROMPT.json THREADS DECODE   -> JSON: ttft_s, decode_tok_s, peak_rss_bytes
    llm_llamacpp.py quality GGUF BLOCKS.json THREADS        -> JSON: per block [top1 ids, nll]

Speed: one ``eval`` of the prompt (one batch) and an argmax -> time to first token; then
DECODE single-token ``eval`` calls, greedy -> tokens/s. Peak RSS: this process's
``VmHWM`` (the model is memory-mapped; mapped pages that were touched count).
Quality: ``logits_all``, each block in one ``eval``; the top-1 id and the negative
log-likelihood (nats, float64 log-softmax) of the true next token at every position.
"""

import ctypes
import json
import sys
import time

import numpy as np

FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15}  # llama.h enum llama_ftype


def _hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _llama(path: str, threads: int, logits_all: bool):
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                 logits_all=logits_all, verbose=False, use_mmap=True)


def _last_logits(llm) -> np.ndarray:
    return np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)


def quantize(src: str, dst: str, kind: str) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {kind} failed: {rc}")
    return {"ok": True}


def speed(path: str, prompt_file: str, threads: int, decode: int) -> dict:
    prompt = json.load(open(prompt_file))
    llm = _llama(path, threads, False)
    ttfts = []
    for _ in range(3):  # the first call pays one-time costs; report the median of three
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        tok = int(np.argmax(_last_logits(llm)))
        ttfts.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(decode):
        llm.eval([tok])
        tok = int(np.argmax(_last_logits(llm)))
    dt = time.perf_counter() - t
    return {"ttft_s": float(np.median(ttfts)), "ttft_all_s": ttfts, "decode_tok_s": decode / dt,
            "peak_rss_bytes": _hwm()}


def quality(path: str, blocks_file: str, threads: int) -> dict:
    blocks = json.load(open(blocks_file))
    llm = _llama(path, threads, True)
    out = []
    for b in blocks:
        llm.reset()
        llm.eval(b)
        logits = np.asarray(llm.scores[: len(b) - 1], dtype=np.float64)
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        nxt = np.asarray(b[1:])
        out.append([np.argmax(logits, axis=1).tolist(), (-logp[np.arange(len(nxt)), nxt]).tolist()])
    return {"blocks": out}


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "quantize":
        res = quantize(*args)
    elif cmd == "speed":
        res = speed(args[0], args[1], int(args[2]), int(args[3]))
    elif cmd == "quality":
        res = quality(args[0], args[1], int(args[2]))
    else:
        raise SystemExit(f"unknown command {cmd}")
    print(json.dumps(res))
