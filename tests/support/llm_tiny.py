"""A tiny randomly initialised Llama (same architecture as SmolLM2, seconds to build) with
a byte-level BPE tokenizer trained here on a few sentences, for the fast causal-LM tests.

Built once per test process (``functools.lru_cache``); callers get clones."""

from __future__ import annotations

import functools
import tempfile

import numpy as np

#: SmolLM2-135M-Instruct's chat template, as its GGUF carries it.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Python lists are mutable sequences.",
         "def f(x):\n    return x + 1\n", "Use a dict to map keys to values. Tuples are immutable.",
         "A for loop iterates over the items of any sequence, in order."]
HEAD_DIM = 16


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    return tok.to_str().encode("utf-8")


@functools.lru_cache(maxsize=1)
def _bundle():
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from sealfl.clients.causal_lm.base import bundle_from_model

    vocab = Tokenizer.from_str(tokenizer_json().decode()).get_vocab_size()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, rope_theta=10000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    return bundle_from_model(model, tokenizer_json(), SMOL_TEMPLATE, {"name": "tiny-llama", "licence": "test"})


def tiny_bundle():
    """A fresh :class:`LMBundle` of the tiny model (independent copy)."""
    return _bundle().clone()


@functools.lru_cache(maxsize=1)
def tiny_fp32_onnx() -> bytes:
    """The tiny model exported with the release's route (builder, float32, KV cache)."""
    from sealfl.platform.llm.export import export_fp32

    b = _bundle()
    with tempfile.TemporaryDirectory() as tmp:
        return export_fp32(b.model, b.tokenizer_json, b.chat_template, b.generation, tmp).SerializeToString()


def encode(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json().decode()).encode(text, add_special_tokens=False).ids


def torch_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor([list(ids)])).logits[0].numpy()


LOOSE_GATE = {"int4": {"min_top1_agreement": 0.5, "max_perplexity_ratio": 1.5},
              "int8": {"min_top1_agreement": 0.5, "max_perplexity_ratio": 1.5}}


@functools.lru_cache(maxsize=1)
def tiny_release_files() -> tuple:
    """``(payload, metadata)`` of a causal-LM release of the tiny model with random LoRA
    adapters merged (INT4/INT8, gate scored on TEXTS, canaries), as the release enclave
    signs it; built once per test process."""
    from sealfl.clients.causal_lm.lora import LoraSpec, n_adapter_params
    from sealfl.clients.causal_lm.text import token_blocks
    from sealfl.platform.llm.build import build_candidates, llm_release_files, score_candidates

    spec = LoraSpec(r=4, alpha=8)
    b = tiny_bundle()
    v = np.random.default_rng(0).normal(scale=0.05, size=n_adapter_params(b.model, spec))
    build = build_candidates(b, spec, v)
    counts = score_candidates(build, token_blocks(tokenizer_json(), TEXTS * 3, 24, eos_id=2))
    return llm_release_files(build, b, spec, counts, {"campaign": {"rounds": 1}}, thresholds=LOOSE_GATE)


def write_tiny_release(root) -> tuple:
    """A release enclave in ``root/enclave``, its trust anchors in ``root/trust`` and the
    tiny release (name ``tiny-llm``, version 1) in ``root/release``; returns
    ``(enclave, payload, metadata)``."""
    from sealfl.enclave.release.enclave import ReleaseEnclave

    enclave = ReleaseEnclave.create(root / "enclave")
    enclave.export_trust(root / "trust")
    payload, metadata = tiny_release_files()
    enclave.write_release(root / "release", payload, "tiny-llm", 1, metadata)
    return enclave, payload, metadata
