"""Per-example clipping for DP local training, with Opacus (issue 23).

A DP round uploads one clipped gradient sum per partner (:mod:`sealfl.he.dp_account` says
why one step): the partner Poisson-samples its records with rate ``q`` (each record in or out
independently, :func:`poisson_batch`), Opacus computes the per-example gradients
(``GradSampleModule``) and clips each to L2 norm ``C`` and sums them
(``DPOptimizer.clip_and_accumulate`` with no noise of its own: the noise is added as
integers inside the encryption, :mod:`sealfl.he.dp`). One record therefore moves the sum by
at most ``C`` in L2 (add or remove). No per-example gradient is written by hand here.

Works for any torch module whose trainable layers Opacus supports (``nn.Linear``: the heart
model and LoRA adapters); frozen parameters get no gradient and are left out.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch
from torch import nn

from sealfl.clients.errors import TaskInputError

log = logging.getLogger(__name__)

__all__ = ["poisson_batch", "clipped_gradient_sum"]


def poisson_batch(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Indices (int64) of the records sampled this round: each of ``n`` independently with
    probability ``rate`` (Poisson sampling, what the accountant assumes). ``rng`` must be a
    secret generator in a real campaign (:func:`sealfl.he.dp.secure_rng`)."""
    return np.flatnonzero(rng.random(int(n)) < float(rate)).astype(np.int64)


def clipped_gradient_sum(module: nn.Module, loss_fn, inputs: torch.Tensor, targets: torch.Tensor,
                         clip: float, params: list | None = None) -> list[torch.Tensor]:
    """``Σ_j clip_C(∇ loss(module(x_j), y_j))`` over the rows of ``inputs``, per trainable
    parameter of ``module`` (float32 tensors shaped like the parameters, in the order of
    ``params`` when given -- every trainable parameter of ``module``, in any order -- else of
    ``module.parameters()``; zeros for an empty batch).

    ``loss_fn(outputs, targets)`` must return the *sum* of per-example losses. The module
    is wrapped by Opacus for the call and unwrapped afterwards (its parameters are not
    changed). Raises TaskInputError for a clip norm <= 0 or mismatched rows.
    """
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    if not clip > 0:
        raise TaskInputError(f"clip norm must be > 0, got {clip!r}")
    trainable = [p for p in module.parameters() if p.requires_grad]
    if params is None:
        params = trainable
    elif {id(p) for p in params} != {id(p) for p in trainable} or len(params) != len(trainable):
        raise TaskInputError("params must be exactly the module's trainable parameters")
    if len(inputs) != len(targets):
        raise TaskInputError(f"{len(inputs)} inputs but {len(targets)} targets")
    if len(inputs) == 0:
        return [torch.zeros_like(p) for p in params]
    gsm = GradSampleModule(module, loss_reduction="sum")
    try:
        opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, max_grad_norm=float(clip),
                          expected_batch_size=len(inputs), loss_reduction="sum")
        opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # Opacus's hooks fire on outputs when the inputs need no grad
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss_fn(gsm(inputs), targets).backward()
        opt.clip_and_accumulate()
        out = [p.summed_grad.detach().clone() for p in opt.params]
        opt.zero_grad(set_to_none=True)
    finally:
        gsm._close()
    return out
