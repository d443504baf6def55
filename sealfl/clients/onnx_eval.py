"""Partner-side evaluation of a candidate ONNX release on the partner's own test split.

The release gate asks each partner for ``{correct, n}`` of a candidate model (fp32 and
INT8) and pools the counts; the rows never leave the partner.
"""

from __future__ import annotations

import numpy as np

from .data import load_partition


def onnx_predict(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    """Run an ONNX model (input ``features`` float32 (n, 13)) -> float32 (n,) probabilities."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return np.asarray(sess.run(None, {name: np.asarray(x, dtype=np.float32)})[0]).reshape(-1)


def evaluate_onnx(partner: str, model_bytes: bytes, seed: int = 42) -> dict:
    """Accuracy of ``model_bytes`` on ``partner``'s test split.

    Returns ``{"correct": int, "n": int, "accuracy": float}`` (threshold 0.5).
    """
    part = load_partition(partner, seed=seed)
    p = onnx_predict(model_bytes, part.x_test)
    correct = int(np.sum((p >= 0.5) == (part.y_test >= 0.5)))
    n = int(len(part.y_test))
    return {"correct": correct, "n": n, "accuracy": correct / max(n, 1)}
