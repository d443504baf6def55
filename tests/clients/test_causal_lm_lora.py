"""LoRA adapters are the only trainable and the only transmitted tensors; merging adds B.A.scale."""

import numpy as np
import pytest
import torch

from sealfl.clients.causal_lm.lora import (
    AdapterError,
    LMTrainConfig,
    LoraSpec,
    adapter_layout,
    attach_lora,
    flatten_adapters,
    init_adapters,
    load_adapters,
    n_adapter_params,
    train_local,
    trainable_names,
)
from sealfl.clients.causal_lm.merge import merge_adapters
from sealfl.clients.causal_lm.text import token_blocks
from tests.support.llm_tiny import TEXTS, tiny_bundle, tokenizer_json

SPEC = LoraSpec(r=4, alpha=8, targets=("q_proj", "v_proj"))


def _blocks():
    return token_blocks(tokenizer_json(), TEXTS * 4, 16, eos_id=2)


def test_kind_only_adapters_train_and_only_adapters_travel():
    b = tiny_bundle()
    base_state = {k: v.clone() for k, v in b.model.state_dict().items()}
    start = init_adapters(b.model, SPEC, seed=1)
    pm = attach_lora(b.model, SPEC)
    names = trainable_names(pm)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    new, metrics = train_local(pm, SPEC, start, _blocks(), LMTrainConfig(steps=3, batch_size=2, lr=1e-2), seed=0)
    # what a partner encrypts is exactly the adapter vector: its length is the adapters' size
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    assert new.shape == (trainable,) == start.shape and np.isfinite(metrics["train_loss"])
    assert not np.allclose(new, start)
    # every base weight is bit-for-bit unchanged after training
    after = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
             for k, v in pm.state_dict().items() if "lora_" not in k}
    assert set(after) == set(base_state)
    for k, v in base_state.items():
        assert torch.equal(after[k], v), k


def test_kind_adapter_vector_layout_matches_the_formula():
    from transformers import LlamaConfig, LlamaForCausalLM

    # SmolLM2-135M's shapes (no weights needed): 30 x (8*576 + 576*8 + 8*576 + 192*8)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert n_adapter_params(model, LoraSpec()) == 30 * (8 * 576 + 576 * 8 + 8 * 576 + 192 * 8) == 460_800
    layout = adapter_layout(model, LoraSpec())
    assert layout[0] == ("model.layers.0.self_attn.q_proj.A", (8, 576))
    assert layout[3] == ("model.layers.0.self_attn.v_proj.B", (192, 8))


def test_kind_flat_vector_round_trips_and_bad_vectors_are_refused():
    b = tiny_bundle()
    pm = attach_lora(b.model, SPEC)
    v = np.random.default_rng(0).normal(size=n_adapter_params(pm.base_model.model, SPEC))
    load_adapters(pm, SPEC, v)
    np.testing.assert_allclose(flatten_adapters(pm, SPEC), v.astype(np.float32), rtol=0, atol=0)
    with pytest.raises(AdapterError, match="shape"):
        load_adapters(pm, SPEC, v[:-1])
    bad = v.copy()
    bad[5] = np.nan
    with pytest.raises(AdapterError, match="finite"):
        load_adapters(pm, SPEC, bad)


def test_kind_initial_adapters_leave_the_base_model_unchanged():
    b = tiny_bundle()
    ids = torch.as_tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        ref = b.model(ids).logits
    v0 = init_adapters(b.model, SPEC, seed=0)
    pm = attach_lora(b.model, SPEC)
    load_adapters(pm, SPEC, v0)
    with torch.no_grad():
        assert torch.equal(pm(input_ids=ids).logits, ref)  # B = 0
    np.testing.assert_array_equal(v0, init_adapters(tiny_bundle().model, SPEC, seed=0))


def test_kind_merged_weight_is_base_plus_b_a_scale():
    b = tiny_bundle()
    n = n_adapter_params(b.model, SPEC)
    v = np.random.default_rng(7).normal(scale=0.05, size=n)
    w0 = b.model.model.layers[1].self_attn.v_proj.weight.detach().double().numpy().copy()
    other = b.model.model.layers[1].mlp.down_proj.weight.detach().clone()
    # independent offsets: layer 0 q (A r x 64, B 64 x r), layer 0 v (A r x 64, B 32 x r), layer 1 q, then layer 1 v
    r, hidden, kv = SPEC.r, 64, 2 * 16
    q_size, v_size = r * hidden + hidden * r, r * hidden + kv * r
    off = q_size + v_size + q_size
    a = v[off:off + r * hidden].reshape(r, hidden)
    bb = v[off + r * hidden:off + r * hidden + kv * r].reshape(kv, r)
    expected = w0 + (SPEC.alpha / SPEC.r) * bb @ a
    # second oracle: the peft model with these adapters computes what the merged model computes
    ids = torch.as_tensor([[3, 9, 4, 12, 7, 1]])
    pm = attach_lora(tiny_bundle().model, SPEC)
    load_adapters(pm, SPEC, v)
    with torch.no_grad():
        peft_logits = pm(input_ids=ids).logits.numpy()
    merged = merge_adapters(b.model, SPEC, v)
    got = merged.model.layers[1].self_attn.v_proj.weight.detach().double().numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(merged.model.layers[1].mlp.down_proj.weight, other)
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        np.testing.assert_allclose(merged(ids).logits.numpy(), peft_logits, atol=1e-4)
    with pytest.raises(AdapterError):
        merge_adapters(tiny_bundle().model, SPEC, v[:10])
