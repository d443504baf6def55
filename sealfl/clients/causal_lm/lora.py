"""LoRA adapters: the only trainable and the only transmitted tensors of the causal-LM task.

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022; peft's
``LoraConfig``/``get_peft_model``): each target linear layer ``y = x W^T`` becomes
``y = x W^T + (alpha / r) * x A^T B^T`` with ``A`` (r, in) and ``B`` (out, r); ``W`` is frozen.

Flat vector (float64, what a partner multiplies by its example count and encrypts (packed BFV)):
for each adapted module in model order (layer 0 ``q_proj``, layer 0 ``v_proj``, layer 1 ...),
``A`` row-major then ``B`` row-major. SmolLM2-135M, r=8 on q_proj/v_proj: per layer
8*576 + 576*8 + 8*576 + 192*8 = 15,360 values, 460,800 in all (1.84 MB as float32).

Initial adapters (:func:`init_adapters`, public, the same for every partner): ``A`` uniform
in ``±1/sqrt(in)`` (the bound of peft's default ``kaiming_uniform_(a=sqrt(5))``), ``B`` zero
-- so the initial model equals the base model. Drawn with NumPy's PCG64 from ``seed``, so
they do not depend on torch's generator or version.

FedAvg over LoRA averages ``A`` and ``B`` separately (as FedIT, Zhang et al. 2024, and
Flower's FlowerTune LLM baselines do); the product of the averages is not the average of
the products, which is the usual approximation of federated LoRA.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from sealfl.clients.errors import ClientError

__all__ = ["LoraSpec", "AdapterError", "attach_lora", "adapter_layout", "n_adapter_params", "init_adapters",
           "flatten_adapters", "load_adapters", "trainable_names", "LMTrainConfig", "train_local"]

log = logging.getLogger(__name__)


class AdapterError(ClientError):
    """An adapter vector has the wrong length or non-finite values, or the model has
    trainable tensors other than the adapters."""


@dataclass(frozen=True)
class LoraSpec:
    """LoRA settings shared by every partner and the release enclave.

    Attributes:
        r: adapter rank.
        alpha: LoRA alpha; the update is scaled by ``alpha / r``.
        targets: names of the adapted linear layers (the last component of the module name).
    """

    r: int = 8
    alpha: int = 16
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    @property
    def scale(self) -> float:
        """``alpha / r``."""
        return self.alpha / self.r

    def to_dict(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "targets": list(self.targets)}


def _target_linears(model, spec: LoraSpec) -> list[tuple[str, object]]:
    """(name, nn.Linear) of every target layer of an un-wrapped Llama model, in model order."""
    out = []
    for name, mod in model.named_modules():
        if name.split(".")[-1] in spec.targets and hasattr(mod, "weight") and mod.weight.dim() == 2:
            out.append((name, mod))
    if not out:
        raise AdapterError(f"the model has no layers named {list(spec.targets)}")
    return out


def adapter_layout(model, spec: LoraSpec) -> list[tuple[str, tuple[int, int]]]:
    """``[(module name + ".A"/".B", shape), ...]`` in flat-vector order, for the base
    (un-wrapped) model. Shapes: ``A`` (r, in_features), ``B`` (out_features, r)."""
    layout = []
    for name, lin in _target_linears(model, spec):
        out_f, in_f = lin.weight.shape
        layout += [(f"{name}.A", (spec.r, int(in_f))), (f"{name}.B", (int(out_f), spec.r))]
    return layout


def n_adapter_params(model, spec: LoraSpec) -> int:
    """Length of the flat adapter vector."""
    return sum(a * b for _, (a, b) in adapter_layout(model, spec))


def init_adapters(model, spec: LoraSpec, seed: int = 0) -> np.ndarray:
    """The public initial adapter vector, float64 (P,) (see module docstring)."""
    rng = np.random.default_rng(seed)
    parts = []
    for name, (rows, cols) in adapter_layout(model, spec):
        if name.endswith(".A"):
            bound = 1.0 / math.sqrt(cols)
            parts.append(rng.uniform(-bound, bound, size=rows * cols))
        else:
            parts.append(np.zeros(rows * cols))
    return np.concatenate(parts).astype(np.float64)


def attach_lora(model, spec: LoraSpec):
    """Wrap ``model`` with peft LoRA adapters (dropout 0, no bias); only the adapters are
    trainable. Returns the ``PeftModel``."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    names = trainable_names(peft_model)
    if not names or any("lora_" not in n for n in names):
        raise AdapterError(f"after attaching LoRA the trainable tensors are {names}; only adapters may train")
    return peft_model


def trainable_names(model) -> list[str]:
    """Names of the parameters with ``requires_grad``."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _adapter_tensors(peft_model, spec: LoraSpec) -> list[tuple[str, object]]:
    """(flat-layout name, torch parameter) pairs of a peft-wrapped model, in flat order."""
    from peft.tuners.lora import LoraLayer

    out = []
    for name, mod in peft_model.named_modules():
        if isinstance(mod, LoraLayer) and name.split(".")[-1] in spec.targets:
            base_name = name.split("base_model.model.", 1)[-1]
            out += [(f"{base_name}.A", mod.lora_A["default"].weight), (f"{base_name}.B", mod.lora_B["default"].weight)]
    return out


def flatten_adapters(peft_model, spec: LoraSpec) -> np.ndarray:
    """The adapters of a peft-wrapped model as the flat float64 vector."""
    return np.concatenate([t.detach().cpu().double().numpy().reshape(-1)
                           for _, t in _adapter_tensors(peft_model, spec)])


def load_adapters(peft_model, spec: LoraSpec, vector: np.ndarray) -> None:
    """Copy a flat adapter vector into the adapters of a peft-wrapped model.

    Raises:
        AdapterError: wrong length or a value that is not finite.
    """
    import torch

    vec = np.asarray(vector, dtype=np.float64)
    tensors = _adapter_tensors(peft_model, spec)
    need = sum(t.numel() for _, t in tensors)
    if vec.ndim != 1 or vec.shape[0] != need:
        raise AdapterError(f"adapter vector has shape {vec.shape}; this model needs ({need},)")
    if not np.all(np.isfinite(vec)):
        raise AdapterError("adapter vector holds values that are not finite")
    pos = 0
    with torch.no_grad():
        for _, t in tensors:
            n = t.numel()
            t.copy_(torch.as_tensor(vec[pos:pos + n], dtype=t.dtype).reshape(t.shape))
            pos += n


@dataclass(frozen=True)
class LMTrainConfig:
    """Local LoRA training settings.

    Attributes:
        steps: optimiser steps per round.
        batch_size: blocks per step.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        seed: base seed of batch sampling.
    """

    steps: int = 8
    batch_size: int = 4
    lr: float = 2e-3
    weight_decay: float = 0.0
    seed: int = 0


def train_local(peft_model, spec: LoraSpec, start: np.ndarray, blocks: np.ndarray, cfg: LMTrainConfig,
                seed: int) -> tuple[np.ndarray, dict]:
    """Train the adapters from ``start`` on token blocks (int64 (n, L)); only adapters change.

    Batches are drawn without replacement from a NumPy PCG64 permutation seeded with
    ``seed`` (re-drawn when exhausted). Loss: mean next-token cross entropy.

    Returns:
        ``(new flat adapter vector float64 (P,), {"train_loss": mean loss of the steps})``.

    Raises:
        AdapterError: ``start`` does not fit the model, or ``blocks`` is empty / not 2-D.
    """
    import torch

    blocks = np.asarray(blocks)
    if blocks.ndim != 2 or blocks.shape[0] < 1 or blocks.shape[1] < 2:
        raise AdapterError(f"training blocks must be a non-empty (n, L>=2) array, got shape {blocks.shape}")
    load_adapters(peft_model, spec, start)
    params = [t for _, t in _adapter_tensors(peft_model, spec)]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(seed)
    order: list[int] = []
    losses = []
    peft_model.train()
    for _ in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += rng.permutation(len(blocks)).tolist()
        idx, order = order[:cfg.batch_size], order[cfg.batch_size:]
        ids = torch.as_tensor(blocks[idx], dtype=torch.long)
        opt.zero_grad()
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    peft_model.eval()
    return flatten_adapters(peft_model, spec), {"train_loss": float(np.mean(losses))}


def dp_gradient_sum(peft_model, spec: LoraSpec, start: np.ndarray, blocks: np.ndarray, clip: float) -> np.ndarray:
    """Σ over the token blocks (int64 (n, L); one block = one example) of each block's
    gradient of its mean next-token cross entropy with respect to the adapters, clipped to
    L2 norm ``clip`` (Opacus, :func:`sealfl.clients.dp_local.clipped_gradient_sum`), flat in
    :func:`flatten_adapters`' order: float64 (P,). The adapters are loaded from ``start``
    and left so; nothing else changes. Raises AdapterError for bad ``start`` or ``blocks``."""
    import torch

    from sealfl.clients.dp_local import clipped_gradient_sum

    blocks = np.asarray(blocks)
    if blocks.ndim != 2 or blocks.shape[1] < 2:
        raise AdapterError(f"training blocks must be an (n, L>=2) array, got shape {blocks.shape}")
    load_adapters(peft_model, spec, start)
    params = [t for _, t in _adapter_tensors(peft_model, spec)]

    def loss_sum(out, ids):  # Σ over blocks of each block's mean next-token NLL
        logits = out.logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").reshape(ids.shape[0], -1)
        return nll.mean(dim=1).sum()

    ids = torch.as_tensor(blocks, dtype=torch.long)
    peft_model.train()
    try:
        grads = clipped_gradient_sum(peft_model, loss_sum, ids, ids, clip, params=params)
    finally:
        peft_model.eval()
    return np.concatenate([g.detach().numpy().reshape(-1) for g in grads]).astype(np.float64)
