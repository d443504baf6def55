"""Partner-side evaluation of a candidate ONNX release on the partner's own test split.

The release gate asks each partner for ``{correct, n}`` of a candidate model (fp32 and
INT8) and pools the counts; the rows never leave the partner.

Candidates are scored exactly the way a device runs a release: in the same sandboxed
onnxruntime child (:class:`sealfl.enclave.sandbox.runtime.SandboxedRuntime`: CPU execution
provider, one intra-op thread, default graph optimisations, float32 input, no network,
an address-space limit), so the accuracy the gate sees is the accuracy a device with this
partner's CPU computes. It also keeps the coordinator's bytes, which a partner has not
verified, out of the partner's own process.
"""

from __future__ import annotations

import numpy as np

from sealfl.clients.heart.data import load_partition
from sealfl.enclave.sandbox.runtime import SandboxedRuntime

__all__ = ["onnx_predict", "evaluate_onnx"]


def onnx_predict(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    """Run an ONNX model (first input, float32 (n, d)) in the sandbox; float32 (n,) output 0.

    Raises:
        RuntimeSandboxError: the model does not load or run in the sandbox.
    """
    with SandboxedRuntime(bytes(model_bytes)) as rt:
        out = rt.run({rt.input_names[0]: np.asarray(x, dtype=np.float32)})[0]
    return np.asarray(out, dtype=np.float32).reshape(-1)


def evaluate_onnx(partner: str, model_bytes: bytes, seed: int = 42) -> dict:
    """Accuracy of ``model_bytes`` on ``partner``'s test split (threshold 0.5).

    Returns ``{"correct": int, "n": int, "accuracy": float}``.

    Raises:
        DataError: unknown partner.
        RuntimeSandboxError: the candidate does not load or run in the sandbox.
    """
    part = load_partition(partner, seed=seed)
    p = onnx_predict(model_bytes, part.x_test)
    correct = int(np.sum((p >= 0.5) == (part.y_test >= 0.5)))
    n = int(len(part.y_test))
    return {"correct": correct, "n": n, "accuracy": correct / max(n, 1)}
