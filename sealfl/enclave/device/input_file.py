"""Rows to score from a CSV file (``sealfl device boot --input``): bytes in, float32 out.

:func:`parse_feature_rows` is pure over the file's bytes; :func:`read_feature_rows` reads at
most :data:`MAX_INPUT_BYTES` of the file and parses them. The values are then checked
against the release's signed ranges (:func:`sealfl.enclave.device.inputs.check_rows`).

Format: UTF-8 (a byte-order mark is tolerated), comma-separated, one row per line, exactly
``n_features`` columns (``None``: as many as the first row has -- ``device boot`` parses the
file so before it boots anything, and checks the width against the release after); blank
lines are skipped; a first row with no numeric cell is a header (it must have that many
columns too). Every cell must parse as a float, and be finite in float32.
"""

from __future__ import annotations

import csv
import io
import os

import numpy as np

from sealfl.common.fsutil import read_capped
from sealfl.enclave.errors import InputFileError

__all__ = ["MAX_INPUT_BYTES", "parse_feature_rows", "read_feature_rows"]

#: Largest input file read (bytes); a bigger one is refused before it is parsed.
MAX_INPUT_BYTES = 64 * 1024 * 1024


def _number(cell: str) -> bool:
    try:
        float(cell)
        return True
    except ValueError:
        return False


def parse_feature_rows(data: bytes, n_features: int | None, source: str) -> np.ndarray:
    """Parse CSV bytes into float32 ``(n, n_features)`` (format in the module docstring;
    ``n_features=None``: the first row's width).

    Raises:
        InputFileError: the message starts with ``source`` and names the row and problem.
    """
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{source}: not a UTF-8 text CSV ({exc.reason})") from exc
    try:
        rows = [r for r in csv.reader(io.StringIO(text, newline="")) if r and any(c.strip() for c in r)]
    except csv.Error as exc:
        raise InputFileError(f"{source}: not a CSV file ({exc})") from exc
    header = rows[0] if rows and not any(_number(c) for c in rows[0]) else None  # every cell non-numeric
    if header is not None:
        rows = rows[1:]
    if not rows:
        raise InputFileError(f"{source}: no data rows")
    want = "the model takes"
    if n_features is None:
        n_features, want = len(rows[0]), "the first data row has"
    if header is not None and len(header) != n_features:
        raise InputFileError(f"{source}: the header has {len(header)} columns, {want} {n_features}")
    out = np.zeros((len(rows), n_features), dtype=np.float32)
    for i, row in enumerate(rows):
        if len(row) != n_features:
            raise InputFileError(f"{source}: data row {i + 1} has {len(row)} columns, {want} {n_features}")
        bad = [c for c in row if not _number(c)]
        if bad:
            raise InputFileError(f"{source}: data row {i + 1} has a non-numeric value {bad[0][:40]!r}")
        with np.errstate(over="ignore"):
            out[i] = np.asarray([float(c) for c in row], dtype=np.float64).astype(np.float32)
        if not np.all(np.isfinite(out[i])):
            raise InputFileError(f"{source}: data row {i + 1} has a NaN, infinite or out-of-float32-range value")
    return out


def read_feature_rows(path: str | os.PathLike, n_features: int | None) -> np.ndarray:
    """Read and parse the CSV file ``path`` (see :func:`parse_feature_rows`).

    Raises:
        InputFileError: unreadable, larger than :data:`MAX_INPUT_BYTES`, or malformed.
    """
    try:
        data = read_capped(path, MAX_INPUT_BYTES, regular_only=False)  # --input <(...) is a pipe
    except OSError as exc:
        raise InputFileError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    if len(data) > MAX_INPUT_BYTES:
        raise InputFileError(f"{path}: larger than {MAX_INPUT_BYTES} bytes; split it")
    return parse_feature_rows(data, n_features, str(path))
