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

from dataclasses import dataclass
from typing import Any

import numpy as np

from sealfl.attestation.errors import CanaryError
from sealfl.common.fields import Fields

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


def _matrix(fields: Fields, value: Any, what: str, width_cap: int) -> list[list[float]]:
    fields.array(value, what, nonempty=True, max_len=MAX_ROWS)
    width = None
    for i, row in enumerate(value):
        fields.array(row, f"{what}[{i}]", nonempty=True, max_len=width_cap)
        if width is not None and len(row) != width:
            raise fields.fail(f"{what}[{i}]", f"has {len(row)} values, row 0 has {width}")
        width = len(row)
        for j, v in enumerate(row):
            fields.number(v, f"{what}[{i}][{j}]")
    return value


def parse_canary(doc: Any) -> Canary:
    """Validate the ``canary`` metadata object and return a :class:`Canary`.

    Raises:
        CanaryError: any field missing, unknown, of the wrong type, non-finite, ragged,
            over the caps, or ``inputs``/``expected`` with different row counts.
    """
    fields = Fields("canary", CanaryError)
    fields.object(doc, "")
    fields.only(doc, _KEYS)
    fields.get(doc, "schema", "choice", choices=(CANARY_SCHEMA,))
    for key in ("input", "output", "reference"):
        fields.get(doc, key, "string", max_len=256 if key != "reference" else 4096)
    tol = fields.get(doc, "tolerance", "number", lo=0.0, hi=1.0, lo_open=True)
    inputs = _matrix(fields, fields.get(doc, "inputs", "array"), "inputs", MAX_WIDTH)
    if any(abs(v) > _F32_MAX for row in inputs for v in row):
        raise fields.fail("inputs", "must be representable as float32 (|v| <= 3.4e38)", "out_of_range")
    expected = _matrix(fields, fields.get(doc, "expected", "array"), "expected", MAX_WIDTH)
    if len(inputs) != len(expected):
        raise CanaryError(f"canary has {len(inputs)} input rows but {len(expected)} expected rows")
    return Canary(doc["input"], doc["output"], np.asarray(inputs, dtype=np.float32),
                  np.asarray(expected, dtype=np.float64), tol, doc["reference"])


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
