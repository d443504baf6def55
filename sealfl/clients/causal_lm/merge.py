"""Merge aggregated LoRA adapters into the base model (the fp32 model a release is built from).

For every adapted linear layer (see :mod:`sealfl.clients.causal_lm.lora` for the flat
layout): ``W' = W + (alpha / r) * B @ A`` with ``W`` (out, in), ``B`` (out, r), ``A`` (r, in)
(Hu et al. 2022, eq. 3: "we can explicitly compute and store W = W0 + BA"). Computed in
float64 and stored as float32. Layers that are not adapted -- among them the tied token
embedding / ``lm_head``, which stays one tensor -- are left bit-for-bit as they were.
"""

from __future__ import annotations

import numpy as np

from sealfl.clients.causal_lm.lora import AdapterError, LoraSpec, adapter_layout

__all__ = ["merge_adapters"]


def merge_adapters(model, spec: LoraSpec, vector: np.ndarray):
    """Add the adapters of ``vector`` into ``model``'s weights in place and return ``model``.

    Args:
        model: an un-wrapped float32 Llama model (``transformers``).
        spec: the LoRA settings of the campaign.
        vector: float (P,) flat adapter vector.

    Raises:
        AdapterError: the vector's length does not fit the model, or it is not finite.
    """
    import torch

    layout = adapter_layout(model, spec)
    vec = np.asarray(vector, dtype=np.float64)
    need = sum(a * b for _, (a, b) in layout)
    if vec.shape != (need,):
        raise AdapterError(f"adapter vector has shape {vec.shape}; the model needs ({need},)")
    if not np.all(np.isfinite(vec)):
        raise AdapterError("adapter vector holds values that are not finite")
    modules = dict(model.named_modules())
    pos = 0
    parts = {}
    for name, (rows, cols) in layout:
        parts[name] = vec[pos:pos + rows * cols].reshape(rows, cols)
        pos += rows * cols
    with torch.no_grad():
        for name in [n[:-2] for n, _ in layout if n.endswith(".A")]:
            a, b = parts[name + ".A"], parts[name + ".B"]
            lin = modules[name]
            w = lin.weight.detach().double().numpy() + spec.scale * (b @ a)
            lin.weight.copy_(torch.as_tensor(w, dtype=lin.weight.dtype))
    return model
