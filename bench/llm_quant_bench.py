"""Compare candidate ONNX exports of SmolLM2-135M with torch float32 (bench/llm_quant.md).

Usage (from a directory holding ``hf/`` -- the base model saved with save_pretrained -- and
``corpus/_sources`` -- the Python docs sources)::

    python llm_quant_bench.py torch            # writes ref_logits.npy (torch float32)
    python llm_quant_bench.py A.onnx B.onnx    # one JSON line per candidate

Measures size, top-1 agreement and perplexity against torch on 4 windows of 256 tokens,
time of a 128-token prefill, decode tokens/s over 64 teacher-forced steps with the KV
cache, and prefill-vs-decode differences of the same positions.
"""
import json
import os
import resource
import sys
import time

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

tok = Tokenizer.from_file("hf/tokenizer.json")
files = ["tutorial/controlflow.rst.txt", "faq/programming.rst.txt", "howto/logging.rst.txt", "reference/expressions.rst.txt"]
wins = []
for f in files:
    ids = tok.encode(open("corpus/_sources/" + f).read()).ids
    wins.append(ids[2000:2000 + 256])
wins = np.array(wins, np.int64)
if sys.argv[1] == "torch":
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained("hf", dtype=torch.float32).eval()
    with torch.no_grad():
        lg = m(torch.as_tensor(wins)).logits.numpy()
    np.save("ref_logits.npy", lg.astype(np.float32)); sys.exit()
ref = np.load("ref_logits.npy")
def nll(lg, ids):
    lg = lg[:-1].astype(np.float64); t = ids[1:]
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    return float(np.mean(lse - lg[np.arange(len(t)), t]))
print("ref ppl", np.exp(np.mean([nll(ref[i], wins[i]) for i in range(len(wins))])))
for path in sys.argv[1:]:
    o = ort.SessionOptions(); o.intra_op_num_threads = 2
    t0 = time.time(); s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"]); tload = time.time() - t0
    L = 30
    def empty(): return {f"past_key_values.{i}.{kv}": np.zeros((1, 3, 0, 64), np.float32) for i in range(L) for kv in ("key", "value")}
    def run(ids, past, total):
        feed = {"input_ids": np.asarray(ids, np.int64)[None], "attention_mask": np.ones((1, total), np.int64), **past}
        if "logits_start" in [x.name for x in s.get_inputs()]:  # releases since sealfl.platform.llm.head
            feed["logits_start"] = np.zeros(1, np.int64)
        out = s.run(None, feed)
        names = [x.name for x in s.get_outputs()]
        d = dict(zip(names, out))
        newpast = {f"past_key_values.{i}.{kv}": d[f"present.{i}.{kv}"] for i in range(L) for kv in ("key", "value")}
        return d["logits"][0], newpast
    agree, nl = [], []
    for i in range(len(wins)):
        lg, _ = run(wins[i], empty(), 256)
        agree.append(np.mean(lg.argmax(-1) == ref[i].argmax(-1))); nl.append(nll(lg, wins[i]))
        if i == 0: full = lg
    # prefill 128 then decode 64 with teacher forcing
    ids = wins[0]
    t0 = time.perf_counter(); lg, past = run(ids[:128], empty(), 128); ttft = time.perf_counter() - t0
    dec = []
    t0 = time.perf_counter()
    for k in range(128, 192):
        lg1, past = run(ids[k:k+1], past, k + 1); dec.append(lg1[0])
    tdec = time.perf_counter() - t0
    dec = np.array(dec)
    pd = np.abs(dec - full[128:192]).max()
    pd_top = np.mean(dec.argmax(-1) == full[128:192].argmax(-1))
    print(json.dumps({"model": path, "MB": round(os.path.getsize(path) / 1e6 + (os.path.getsize(path + ".data") / 1e6 if os.path.exists(path + ".data") else 0), 1),
        "load_s": round(tload, 2), "agree": [round(a, 3) for a in agree], "agree_mean": round(float(np.mean(agree)), 4),
        "ppl": round(float(np.exp(np.mean(nl))), 3), "ttft128_s": round(ttft, 3), "decode_tok_s": round(64 / tdec, 1),
        "prefill_vs_decode_maxabs": float(pd), "prefill_vs_decode_top1": float(pd_top),
        "maxrss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}), flush=True)
