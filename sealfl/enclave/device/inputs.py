"""What a device accepts as model input: the release's signed per-feature ranges. Pure.

A release's signed metadata describes its input (written by the release pipeline from the
task, e.g. :data:`sealfl.clients.heart.data.FEATURE_SPEC`)::

    "input": {"name": "features", "dtype": "float32", "shape": ["batch", d],
              "features": [{"name": str, "unit": str, "min": num, "max": num,
                            "missing_code": num (optional)}           # continuous
                           | {"name": str, "unit": str, "values": [num, ...],
                              "group": str (optional)}, ...]}          # coded / one-hot

A row is accepted iff every value is finite and, per feature, lies in ``[min, max]`` or
equals ``missing_code``, or is one of ``values``; and within each one-hot ``group`` at most
one feature is 1. :func:`check_rows` refuses the first offending cell, naming the row
(1-based, as a user counts CSV data rows), the column and the allowed values, so an
implausible measurement (``chol = 100000``) never reaches the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sealfl.enclave.errors import InputRangeError, InputSpecError

__all__ = ["Feature", "InputSpec", "parse_input_spec", "check_rows"]

_MAX_FEATURES = 65536


@dataclass(frozen=True)
class Feature:
    """One input column: either a range (``lo``..``hi``, optional ``missing_code``) or a
    set of coded ``values``; ``group`` names a one-hot block."""

    name: str
    unit: str
    lo: float | None = None
    hi: float | None = None
    missing_code: float | None = None
    values: tuple[float, ...] | None = None
    group: str | None = None

    def describe(self) -> str:
        """Human-readable allowed values, e.g. ``"50..1000 mg/dl (or 0 = not recorded)"``."""
        if self.values is not None:
            return f"one of {list(self.values)} ({self.unit})"
        extra = f" (or {self.missing_code:g} = not recorded)" if self.missing_code is not None else ""
        return f"{self.lo:g}..{self.hi:g} {self.unit}{extra}"


@dataclass(frozen=True)
class InputSpec:
    """The parsed ``input`` metadata: input ``name`` and one :class:`Feature` per column."""

    name: str
    features: tuple[Feature, ...]


def _num(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputSpecError(f"input spec: {what} must be a finite number, got {value!r}")
    return float(value)


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InputSpecError(f"input spec: {what} must be a non-empty string, got {value!r}")
    return value


def _feature(i: int, f: Any) -> Feature:
    if not isinstance(f, dict):
        raise InputSpecError(f"input spec: feature {i} must be an object")
    name = _str(f.get("name"), f"feature {i} name")
    unit = f.get("unit", "")
    if not isinstance(unit, str):
        raise InputSpecError(f"input spec: feature {name!r} unit must be a string")
    group = f.get("group")
    if group is not None:
        group = _str(group, f"feature {name!r} group")
    if "values" in f:
        vals = f["values"]
        if not isinstance(vals, list) or not 1 <= len(vals) <= 1024:
            raise InputSpecError(f"input spec: feature {name!r} values must be a list of 1..1024 numbers")
        return Feature(name, unit, values=tuple(_num(v, f"feature {name!r} value") for v in vals), group=group)
    lo, hi = _num(f.get("min"), f"feature {name!r} min"), _num(f.get("max"), f"feature {name!r} max")
    if lo > hi:
        raise InputSpecError(f"input spec: feature {name!r} has min {lo} > max {hi}")
    missing = f.get("missing_code")
    return Feature(name, unit, lo, hi, None if missing is None else _num(missing, f"feature {name!r} missing_code"),
                   group=group)


def parse_input_spec(meta: Any) -> InputSpec | None:
    """Parse the release metadata's ``input`` object; None if it lists no ``features``
    (the release then states no ranges and rows are only checked for finiteness).

    Raises:
        InputSpecError: a field has the wrong type, a range is inverted, or a value is not finite.
    """
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise InputSpecError("input spec must be a JSON object")
    feats = meta.get("features")
    if feats is None:
        return None
    if not isinstance(feats, list) or not 1 <= len(feats) <= _MAX_FEATURES:
        raise InputSpecError(f"input spec: features must be a list of 1..{_MAX_FEATURES} objects")
    return InputSpec(_str(meta.get("name", "features"), "input name"), tuple(_feature(i, f) for i, f in enumerate(feats)))


def check_rows(spec: InputSpec | None, x: np.ndarray) -> None:
    """Refuse rows a device must not score.

    Args:
        spec: the release's input spec (None: only finiteness is checked).
        x: float (n, d) rows.

    Raises:
        InputRangeError: ``x`` is not 2-D with ``d`` columns, or a cell is not finite, out of
            range, not a coded value, or a one-hot group has more than one 1. The message
            names the row (1-based), the column and what is allowed.
    """
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 2 or (spec is not None and arr.shape[1] != len(spec.features)):
        want = f"(n, {len(spec.features)})" if spec is not None else "(n, d)"
        raise InputRangeError(f"input has shape {arr.shape}, the model takes {want}")
    bad = ~np.isfinite(arr)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        name = spec.features[c].name if spec is not None else f"column {c + 1}"
        raise InputRangeError(f"row {r + 1}, column {name!r}: {arr[r, c]} is not a finite number")
    if spec is None:
        return
    for c, f in enumerate(spec.features):
        col = arr[:, c]
        if f.values is not None:
            ok = np.isin(col, np.asarray(f.values))
        else:
            ok = (col >= f.lo) & (col <= f.hi)
            if f.missing_code is not None:
                ok |= col == f.missing_code
        if not ok.all():
            r = int(np.flatnonzero(~ok)[0])
            more = int((~ok).sum()) - 1
            raise InputRangeError(
                f"row {r + 1}, column {f.name!r}: {col[r]:g} is outside the documented range "
                f"{f.describe()}" + (f" ({more} more rows out of range)" if more else ""))
    groups: dict[str, list[int]] = {}
    for c, f in enumerate(spec.features):
        if f.group is not None:
            groups.setdefault(f.group, []).append(c)
    for g, cols in groups.items():
        total = arr[:, cols].sum(axis=1)
        if (total > 1).any():
            r = int(np.flatnonzero(total > 1)[0])
            raise InputRangeError(f"row {r + 1}: more than one of the one-hot columns "
                                  f"{[spec.features[c].name for c in cols]} is set (group {g!r})")
