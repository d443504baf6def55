"""Build a release canary (see :mod:`sealfl.attestation.canary`) for a tabular model.

Canary rows are synthetic: they are derived from the global feature mean and standard
deviation (aggregates already inside the released model) and the documented feature
ranges, never from a partner's rows. They cover the centre of the data (mean +- k std,
clipped to the ranges), each range's ends, every coded value and every one-hot level, so
the integer kernels see small and large per-row scales.

Expected outputs come from :func:`sealfl.platform.onnx_ref.run_reference` (NumPy), so they
do not depend on the build machine's CPU; :func:`self_check` compares onnxruntime on the
build machine against them before anything is signed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sealfl.attestation.canary import CANARY_SCHEMA, check_canary, parse_canary
from sealfl.platform.errors import ReleaseError
from sealfl.platform.onnx_ref import run_reference

__all__ = ["CANARY_TOLERANCE", "canary_rows", "build_canary", "self_check"]

#: Absolute tolerance on a canary output. onnxruntime vs the NumPy reference differ by
#: <= 1.2e-7 here (float32 rounding of the scaling and ORT's approximate Sigmoid); INT8
#: quantisation error is ~7e-3 and the saturation this guards against was 0.3. 1e-4 leaves
#: ~800x headroom for other CPUs' float kernels and is ~70x below the quantisation error.
CANARY_TOLERANCE = 1e-4


def canary_rows(features: Sequence[dict], mean: np.ndarray, std: np.ndarray, n: int = 24,
                seed: int = 0) -> np.ndarray:
    """Synthetic canary rows, float32 (n, d) (see module docstring).

    Args:
        features: the task's feature spec (``min``/``max``/``missing_code`` or ``values``/``group``).
        mean, std: float (d,) global statistics.
        n: number of rows (>= 4).
        seed: seed of the (NumPy PCG64) generator; the same arguments give the same rows.
    """
    d = len(features)
    rng = np.random.default_rng(seed)
    mean, std = np.asarray(mean, np.float64).reshape(d), np.asarray(std, np.float64).reshape(d)
    x = np.zeros((n, d), dtype=np.float64)
    z = rng.normal(size=(n, d)) * 1.5
    groups: dict[str, list[int]] = {}
    for c, f in enumerate(features):
        if "values" in f:
            vals = list(f["values"])
            x[:, c] = [vals[(r + c) % len(vals)] for r in range(n)]
            if "group" in f:
                groups.setdefault(f["group"], []).append(c)
            continue
        lo, hi = float(f["min"]), float(f["max"])
        x[:, c] = np.clip(mean[c] + z[:, c] * std[c], lo, hi)
        x[0, c], x[1, c] = lo, hi  # the ends of every range
        if f.get("missing_code") is not None:
            x[2, c] = float(f["missing_code"])
    for cols in groups.values():  # one-hot: level r mod (k+1), where k+1 = "reference level"
        x[:, cols] = 0.0
        for r in range(n):
            level = r % (len(cols) + 1)
            if level < len(cols):
                x[r, cols[level]] = 1.0
    return x.astype(np.float32)


def build_canary(model_bytes: bytes, input_name: str, output_name: str, rows: np.ndarray,
                 tolerance: float = CANARY_TOLERANCE) -> dict:
    """The ``canary`` metadata object for ``model_bytes`` on ``rows`` (float32 (n, d)):
    expected outputs from the NumPy reference. Raises ValueError if the reference cannot
    evaluate the model."""
    rows = np.asarray(rows, dtype=np.float32)
    out = np.asarray(run_reference(model_bytes, {input_name: rows})[0], dtype=np.float64).reshape(len(rows), -1)
    return {
        "schema": CANARY_SCHEMA, "input": input_name, "output": output_name,
        "inputs": [[float(v) for v in r] for r in rows],
        "expected": [[float(v) for v in r] for r in out],
        "tolerance": float(tolerance),
        "reference": "NumPy re-implementation of the model's ONNX arithmetic (sealfl.platform.onnx_ref)",
    }


def self_check(model_bytes: bytes, canary: dict) -> None:
    """Run the canary through onnxruntime here, as a device will (batch and row by row).

    Raises:
        ReleaseError: onnxruntime on this machine disagrees with the canary.
    """
    import onnxruntime as ort

    from sealfl.attestation.errors import CanaryError

    parsed = parse_canary(canary)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    batch = sess.run([parsed.output], {parsed.input: parsed.inputs})[0]
    rows = [sess.run([parsed.output], {parsed.input: parsed.inputs[i:i + 1]})[0] for i in range(len(parsed.inputs))]
    try:
        check_canary(parsed, batch, rows)
    except CanaryError as exc:
        raise ReleaseError(f"the INT8 candidate fails its own canary on the build machine: {exc}; not releasing") from exc
