"""The encrypted average of LoRA adapter vectors equals plaintext FedAvg of the adapters.

Each partner trains adapters (real LoRA training on the tiny model), multiplies them by its
share n / N of the blocks and encrypts; the aggregator validates and adds ciphertexts with the public
context only; the key holder decrypts, divides and rounds (:func:`open_model` with the
causal-LM task's bounds). The oracle is an independent NumPy weighted sum. The vector's
length is that of the real SmolLM2 adapters (460,800 values, 57 packed BFV ciphertexts)."""

import numpy as np

from sealfl.clients.causal_lm.lora import LMTrainConfig, LoraSpec, attach_lora, init_adapters, train_local
from sealfl.clients.causal_lm.task import CausalLMTask
from sealfl.clients.causal_lm.text import token_blocks
from sealfl.he.bfv import BFVCodec
from sealfl.he.decrypted import open_model, share_to_sum, update_share
from sealfl.server.aggregate import sum_chunks, validate_frames
from tests.support.llm_tiny import TEXTS, tiny_bundle, tokenizer_json


def test_kind_encrypted_adapter_average_equals_plaintext_fedavg():
    task = CausalLMTask()
    assert task.n_params == 460_800
    rng = np.random.default_rng(0)
    # real training for two partners on the tiny model, embedded in the full-length vector
    spec = LoraSpec(r=4, alpha=8)
    trained = []
    for k in range(2):
        b = tiny_bundle()
        pm = attach_lora(b.model, spec)
        blocks = token_blocks(tokenizer_json(), TEXTS[k::2] * 6, 12, eos_id=2)
        v, _ = train_local(pm, spec, init_adapters(b.model, spec, 0), blocks, LMTrainConfig(steps=2, lr=1e-2), seed=k)
        trained.append(v)
    updates = {}
    for i, name in enumerate(task.partners):
        v = rng.normal(scale=0.02, size=task.n_params)
        if i < 2:
            v[:len(trained[i])] = trained[i]
        updates[name] = (v, int(rng.integers(50, 700)))  # (adapters, training blocks n)
    secret = BFVCodec.generate()
    public = BFVCodec.from_bytes(secret.public_context_bytes(), secret.params, secret.context_id)
    assert not public.has_secret_key
    total = sum(n for _, n in updates.values())
    frames = {p: secret.encrypt(update_share(v, n, total, secret.WEIGHTING)) for p, (v, n) in updates.items()}
    valid = validate_frames(public, frames, task.n_params)
    assert not valid.rejected
    summed = sum_chunks(public, valid, task.n_params)
    got = open_model(share_to_sum(secret.decrypt(summed, task.n_params), total, secret.WEIGHTING), total, task.decrypt_bounds,
                     max_total=total)
    expected = np.zeros(task.n_params)
    for v, n in updates.values():
        expected += n * v
    expected /= total
    # shares on the 2^-23 grid (K partners: sum error <= K * 2^-24, times N), then the key
    # holder's grids (2^-12 on sums, 2^-20 on values)
    k = len(updates)
    assert np.abs(got - expected).max() <= k * 2.0**-24 + 2.0**-13 / total + 2.0**-21
    assert got.shape == (460_800,)
