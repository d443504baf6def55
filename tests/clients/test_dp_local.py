"""Per-example clipping with Opacus (sealfl.clients.dp_local; issue 23, item 3: one outlier
example's contribution is bounded by the clip norm)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from sealfl.clients.dp_local import clipped_gradient_sum, poisson_batch
from sealfl.clients.heart.data import load_partition
from sealfl.clients.heart.task import HeartTask
from sealfl.he import dp


def test_one_outlier_example_moves_the_clipped_sum_by_at_most_c():
    task = HeartTask()
    data = load_partition(task.partners[0], seed=42)
    x, y = data.x_train[:60].copy(), data.y_train[:60].copy()
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    params = np.linspace(-0.3, 0.3, task.n_params)
    outlier = x[:1] * 50.0  # a record far outside the data: its raw gradient is huge
    wrong = np.float32(task.predict_proba(params, outlier, mean, std)[0] < 0.5)  # a label the model gets wrong
    xo, yo = np.concatenate([x, outlier]), np.concatenate([y, np.asarray([wrong], dtype=y.dtype)])
    clip = 0.7
    base = task.clipped_gradient_sum(params, x, y, mean, std, clip)
    with_outlier = task.clipped_gradient_sum(params, xo, yo, mean, std, clip)
    assert np.linalg.norm(with_outlier - base) <= clip * (1 + 1e-5)
    # without clipping (a clip norm no gradient reaches) the same record moves the sum far more
    raw = task.clipped_gradient_sum(params, xo, yo, mean, std, 1e9) - task.clipped_gradient_sum(params, x, y, mean, std, 1e9)
    assert np.linalg.norm(raw) > 20 * clip


def test_clipped_sum_equals_per_example_clipping_done_one_row_at_a_time():
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    x, y = torch.randn(9, 4) * torch.tensor([1.0, 10.0, 0.1, 3.0]), torch.rand(9, 1)
    loss = nn.BCEWithLogitsLoss(reduction="sum")
    got = clipped_gradient_sum(m, loss, x, y, 0.5)
    want = [torch.zeros_like(p) for p in m.parameters()]
    for j in range(len(x)):  # the reference: one backward pass per row (torch autograd), clipped
        m.zero_grad()
        loss(m(x[j:j + 1]), y[j:j + 1]).backward()
        g = [p.grad.clone() for p in m.parameters()]
        scale = min(1.0, 0.5 / float(torch.sqrt(sum((a**2).sum() for a in g))))
        want = [w + a * scale for w, a in zip(want, g)]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)
    assert all(p.grad is None or not hasattr(p, "grad_sample") for p in m.parameters())
    assert [tuple(t.shape) for t in clipped_gradient_sum(m, loss, x[:0], y[:0], 0.5)] == [(1, 4), (1,)]


def test_poisson_batch_includes_each_record_at_the_rate():
    idx = poisson_batch(100_000, 0.05, dp.seeded_rng(5))
    assert abs(len(idx) - 5000) < 5 * np.sqrt(100_000 * 0.05 * 0.95)
    assert len(np.unique(idx)) == len(idx)


def test_lora_adapters_clipped_sum_matches_per_block_clipping_on_a_tiny_llama():
    from sealfl.clients.causal_lm.lora import (
        LoraSpec,
        _adapter_tensors,
        attach_lora,
        dp_gradient_sum,
        load_adapters,
        n_adapter_params,
    )
    from sealfl.clients.causal_lm.text import token_blocks
    from tests.support.llm_tiny import TEXTS, tiny_bundle, tokenizer_json

    spec = LoraSpec(r=4, alpha=8)
    model = attach_lora(tiny_bundle().model, spec)
    start = np.random.default_rng(1).normal(scale=0.05, size=n_adapter_params(model, spec))
    blocks = token_blocks(tokenizer_json(), TEXTS * 2, 12, eos_id=2)[:5]
    clip = 0.05
    got = dp_gradient_sum(model, spec, start, blocks, clip)
    assert got.shape == start.shape
    # the oracle: one backward pass per block (torch autograd), each gradient clipped, summed
    load_adapters(model, spec, start)
    params = [t for _, t in _adapter_tensors(model, spec)]
    want = np.zeros_like(start)
    norms = []
    for b in blocks:
        ids = torch.as_tensor(b[None], dtype=torch.long)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        g = np.concatenate([p.grad.detach().numpy().reshape(-1) for p in params]).astype(np.float64)
        norms.append(np.linalg.norm(g))
        want += g * min(1.0, clip / norms[-1])
    assert max(norms) > clip  # clipping is active: the test compares clipped sums
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    # one block's contribution is at most C, however far out it is
    without = dp_gradient_sum(model, spec, start, blocks[:-1], clip)
    assert np.linalg.norm(got - without) <= clip * (1 + 1e-5)
