"""Scoring held-out text for the release gate (partner side): the torch reference and a
candidate ONNX model run the way a device runs it (see :mod:`sealfl.platform.llm.gate`)."""

from __future__ import annotations

import numpy as np

from sealfl.enclave.sandbox.decode import KVDecoder

__all__ = ["reference_scores", "candidate_scores"]


def _nll_rows(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=-1)) + m[:, 0]
    return lse - x[np.arange(len(targets)), targets]


def reference_scores(model, blocks: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per block: (top-1 ids int64 (L-1,), NLL float64 (L-1,)) of the torch reference."""
    import torch

    out = []
    model.eval()
    with torch.no_grad():
        for b in np.asarray(blocks):
            logits = model(input_ids=torch.as_tensor(b[None], dtype=torch.long)).logits[0, :-1].double().numpy()
            out.append((logits.argmax(-1), _nll_rows(logits, b[1:])))
    return out


def candidate_scores(model_bytes: bytes, blocks: np.ndarray, head_dim: int, prefill: int,
                     threads: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per block: (top-1 ids, NLL) of a candidate ONNX model run as the device runs it.

    Raises:
        ValueError: the model does not follow the decoding contract, or ``prefill`` is not
            in ``[1, L]``.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    dec = KVDecoder(ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"]),
                    max_context=int(np.asarray(blocks).shape[1]) + 1, head_dim=head_dim)
    out = []
    for b in np.asarray(blocks):
        logits = dec.teacher_forced(b.tolist(), prefill)[:-1]
        out.append((logits.argmax(-1), _nll_rows(logits, b[1:])))
    return out
