"""Build the signed canary of a causal-LM release (see :mod:`sealfl.attestation.llm_canary`).

Canary prompts are questions written here (:data:`CANARY_PROMPTS`), never partner text.
Each is rendered with the release's chat template and tokenizer; the candidate model
answers greedily (:data:`CANARY_NEW_TOKENS` tokens) on the build machine with the device's
decoding code (:class:`sealfl.enclave.sandbox.decode.KVDecoder`); the canary sequence is the
prompt plus that answer, scored position by position as a device scores it (prefill over
the prompt, then token by token). Thresholds: :data:`MIN_AGREEMENT`, :data:`MAX_MEAN_ABS_DIFF`.
"""

from __future__ import annotations

import numpy as np

from sealfl.attestation.llm_canary import LLM_CANARY_SCHEMA, parse_llm_canary
from sealfl.enclave.sandbox.decode import KVDecoder, SamplingParams, choose_token
from sealfl.enclave.sandbox.llm_runtime import ChatTemplate

__all__ = ["CANARY_PROMPTS", "CANARY_NEW_TOKENS", "MIN_AGREEMENT", "MAX_MEAN_ABS_DIFF", "build_llm_canary"]

CANARY_PROMPTS = ("What is a Python list?", "How do I read a file line by line?",
                  "Explain what a decorator does.", "What does the with statement do?")
CANARY_NEW_TOKENS = 16
#: Measured between two kernel paths on one CPU (prefill vs token by token, int8
#: activations): agreement 0.93, mean |Δ max logit| 0.29; a model 3 LoRA steps apart:
#: 0.84 / 0.72 (module docstring of sealfl.attestation.llm_canary).
MIN_AGREEMENT = 0.80
MAX_MEAN_ABS_DIFF = 0.6


def build_llm_canary(model_bytes: bytes, tokenizer_json: bytes, chat_template: str, generation: dict,
                     head_dim: int, prompts=CANARY_PROMPTS, new_tokens: int = CANARY_NEW_TOKENS,
                     min_agreement: float = MIN_AGREEMENT, max_mean_abs_diff: float = MAX_MEAN_ABS_DIFF) -> dict:
    """The ``canary`` object of one model variant (validated by ``parse_llm_canary``).

    Raises:
        ValueError: the model does not load or follow the decoding contract.
        CanaryError: the built object does not validate (a bug).
    """
    import onnxruntime as ort
    from tokenizers import Tokenizer

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    dec = KVDecoder(sess, head_dim=head_dim)
    tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    template = ChatTemplate(chat_template, generation.get("special_tokens"))
    eos = set(generation["eos_token_ids"])
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    rng = np.random.default_rng(0)
    seqs, pre, top1, maxl = [], [], [], []
    vocab = None
    for q in prompts:
        ids = tok.encode(template.render([{"role": "user", "content": q}]), add_special_tokens=False).ids
        dec.reset()
        logits = dec.feed(ids, last_only=True)[-1]
        out = []
        for _ in range(new_tokens):
            t = choose_token(logits, greedy, rng)
            out.append(t)
            if t in eos:
                break
            logits = dec.feed([t], last_only=True)[-1]
        seq = list(ids) + out
        scores = dec.teacher_forced(seq, len(ids))
        vocab = scores.shape[1]
        seqs.append(seq)
        pre.append(len(ids))
        top1.append([int(i) for i in scores.argmax(-1)])
        maxl.append([float(v) for v in scores.max(-1)])
    doc = {"schema": LLM_CANARY_SCHEMA, "sequences": seqs, "prefill": pre, "expected_top1": top1,
           "expected_max_logit": maxl, "vocab": int(vocab), "min_agreement": float(min_agreement),
           "max_mean_abs_diff": float(max_mean_abs_diff),
           "reference": "build machine's onnxruntime via sealfl.enclave.sandbox.decode (prefill, then token by token)"}
    parse_llm_canary(doc)
    return doc
