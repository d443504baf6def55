"""The release canary: signed inputs, expected outputs and a tolerance a device checks
before it accepts a release. Pure; no I/O.

A release's signed metadata may carry (schema ``sealfl.canary/v1``)::

    "canary": {"schema": "sealfl.canary/v1",
               "input": <model input name>, "output": <model output name>,
               "inputs":   [[float, ...], ...],      # n rows x d features (n <= 256)
               "expected": [[float, ...], ...],      # n rows x m outputs
               "tolerance": float,                   # absolute, 0 < tol <= 1
               "reference": str}                     # where "expected" came from

At boot the device runs the canary rows through the verified model twice -- as one batch
and one row at a time -- and accepts the release only if (:func:`check_canary`)

1. every batch output is within ``tolerance`` of ``expected`` (the model computes on THIS
   CPU what the release says it computes: catches integer kernels that saturate on one
   instruction set, a runtime that loads something else, a corrupted install), and
2. every row alone is within ``tolerance`` of the same row in the batch (a row's answer
   does not depend on the other rows of the batch).

``expected`` is computed by the release pipeline with a NumPy re-implementation of the
model's arithmetic (:mod:`sealfl.platform.onnx_ref`), not by onnxruntime on the build
machine, so it does not depend on the builder's CPU either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CanaryError

__all__ = ["CANARY_SCHEMA", "MAX_ROWS", "MAX_WIDTH", "Canary", "parse_canary", "check_canary"]

CANARY_SCHEMA = "sealfl.canary/v1"
#: Caps on a canary's size (rows, values per row): a canary is a handful of probe rows.
MAX_ROWS = 256
MAX_WIDTH = 65536
_F32_MAX = float(np.finfo(np.float32).max)
_KEYS = {"schema", "input", "output", "inputs", "expected", "tolerance", "reference"}


@dataclass(frozen=True)
class Canary:
    """A parsed canary.

    Attributes:
        input: model input name the rows are fed to.
        output: model output name compared.
        inputs: float32 (n, d).
        expected: float64 (n, m).
        tolerance: absolute tolerance (float, 0 < tol <= 1).
        reference: free text naming the source of ``expected``.
    """

    input: str
    output: str
    inputs: np.ndarray
    expected: np.ndarray
    tolerance: float
    reference: str


def _matrix(value: Any, what: str, width_cap: int) -> list[list[float]]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ROWS:
        raise CanaryError(f"canary {what!r} must be a list of 1..{MAX_ROWS} rows")
    width = None
    for i, row in enumerate(value):
        if not isinstance(row, list) or not 1 <= len(row) <= width_cap:
            raise CanaryError(f"canary {what!r} row {i} must be a list of 1..{width_cap} numbers")
        if width is not None and len(row) != width:
            raise CanaryError(f"canary {what!r} row {i} has {len(row)} values, row 0 has {width}")
        width = len(row)
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise CanaryError(f"canary {what!r}[{i}][{j}] must be a finite number, got {v!r}")
    return value


def parse_canary(doc: Any) -> Canary:
    """Validate the ``canary`` metadata object and return a :class:`Canary`.

    Raises:
        CanaryError: any field missing, of the wrong type, non-finite, ragged, over the
            caps, or ``inputs``/``expected`` with different row counts.
    """
    if not isinstance(doc, dict):
        raise CanaryError(f"canary must be a JSON object, got {type(doc).__name__}")
    if set(doc) != _KEYS:
        raise CanaryError(f"canary keys must be {sorted(_KEYS)}, got {sorted(doc)}")
    if doc["schema"] != CANARY_SCHEMA:
        raise CanaryError(f"canary schema must be {CANARY_SCHEMA!r}, got {doc['schema']!r}")
    for key in ("input", "output", "reference"):
        if not isinstance(doc[key], str) or not doc[key]:
            raise CanaryError(f"canary {key!r} must be a non-empty string")
    tol = doc["tolerance"]
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (0 < tol <= 1):
        raise CanaryError(f"canary tolerance must be a number in (0, 1], got {tol!r}")
    inputs = _matrix(doc["inputs"], "inputs", MAX_WIDTH)
    if any(abs(v) > _F32_MAX for row in inputs for v in row):
        raise CanaryError("canary inputs must be representable as float32 (|v| <= 3.4e38)")
    expected = _matrix(doc["expected"], "expected", MAX_WIDTH)
    if len(inputs) != len(expected):
        raise CanaryError(f"canary has {len(inputs)} input rows but {len(expected)} expected rows")
    return Canary(doc["input"], doc["output"], np.asarray(inputs, dtype=np.float32),
                  np.asarray(expected, dtype=np.float64), float(tol), doc["reference"])


def check_canary(canary: Canary, batch_output: np.ndarray, row_outputs: list[np.ndarray]) -> None:
    """Decide whether the model's canary answers are acceptable (see module docstring).

    Args:
        canary: the parsed canary.
        batch_output: the model's output for ``canary.inputs`` as one batch, shape (n, m)
            (or anything that reshapes to it).
        row_outputs: the output for each row fed alone, n arrays each reshapeable to (1, m).

    Raises:
        CanaryError: a shape differs, an output is not finite, a batch output is further
            than ``tolerance`` from ``expected``, or a row alone differs from its batch
            answer by more than ``tolerance``. The message names the row and column.
    """
    n, m = canary.expected.shape
    try:
        batch = np.asarray(batch_output, dtype=np.float64).reshape(n, m)
        rows = [np.asarray(r, dtype=np.float64).reshape(m) for r in row_outputs]
    except ValueError as exc:
        raise CanaryError(f"model output does not have the canary's shape ({n}, {m}): {exc}") from exc
    if len(rows) != n:
        raise CanaryError(f"{len(rows)} single-row outputs for {n} canary rows")
    if not (np.all(np.isfinite(batch)) and all(np.all(np.isfinite(r)) for r in rows)):
        raise CanaryError("the model's canary output is not finite")
    dev = np.abs(batch - canary.expected)
    i, j = np.unravel_index(int(np.argmax(dev)), dev.shape)
    if dev[i, j] > canary.tolerance:
        raise CanaryError(
            f"canary row {i}, output {j}: the model computes {batch[i, j]:.6g} on this device, the release "
            f"expects {canary.expected[i, j]:.6g} (|diff| {dev[i, j]:.3g} > tolerance {canary.tolerance:g}); "
            "this device does not compute what was released")
    for i, r in enumerate(rows):
        d = np.abs(r - batch[i])
        j = int(np.argmax(d))
        if d[j] > canary.tolerance:
            raise CanaryError(
                f"canary row {i}, output {j}: alone it gives {r[j]:.6g}, in the batch {batch[i, j]:.6g} "
                f"(|diff| {d[j]:.3g} > tolerance {canary.tolerance:g}); the model's answer for a row depends "
                "on the other rows of the batch")
