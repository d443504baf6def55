"""A heart partner's own data: one hospital's CSV in the documented schema.

``sealfl partner start KIT --data PATH`` (and ``partner check``) point the partner at a CSV
with the columns of ``heart_disease_uci.csv`` (:mod:`sealfl.clients.heart.data`): ``age,
sex, cp, trestbps, chol, fbs, restecg, thalch, exang, oldpeak, num`` required, ``id``,
``dataset``, ``slope``, ``ca``, ``thal`` optional (the dropped ones are ignored; every row is
this partner's, whatever ``dataset`` says). Cells are checked as the bundled file's are
(documented codings and levels, finite numbers, ``num`` 0-4; rows with a missing cell --
empty, ``?``, ``NA`` -- are left out), plus what a stranger's file needs:

- the file is at most :data:`MAX_BYTES` and :data:`MAX_ROWS` rows, UTF-8 (a BOM allowed);
- every row has as many cells as the header, and no column name repeats;
- every value is inside the feature's plausibility range of
  :data:`sealfl.clients.heart.data.FEATURE_SPEC` (or its ``missing_code``), the ranges the
  signed release's devices enforce;
- at least :data:`MIN_ROWS` complete rows, both labels present.

The split is the bundled data's rule: a stratified 66 % / 34 % train/test split with the
data seed. Refusals raise DataError naming the file, row (spreadsheet line numbers: the
header is line 1), column and value.
"""

from __future__ import annotations

import csv
import hashlib
import io
import threading
from pathlib import Path

import numpy as np

from sealfl.clients.errors import DataError
from sealfl.clients.heart.data import (
    BINARY,
    DROPPED_COLUMNS,
    FEATURE_SPEC,
    FEATURES,
    NUMERIC,
    Partition,
    _complete,
    _features,
    _label,
    n_test_for,
)
from sealfl.common.fsutil import read_capped

__all__ = ["load_own_partition", "REQUIRED_COLUMNS", "MAX_BYTES", "MAX_ROWS", "MIN_ROWS"]

REQUIRED_COLUMNS = ("age", "sex", "cp", "trestbps", "chol", "fbs", "restecg", "thalch", "exang", "oldpeak", "num")
OPTIONAL_COLUMNS = ("id", "dataset", *DROPPED_COLUMNS)
#: largest accepted file (bytes) and row count; the bundled file is 120 KB, 920 rows
MAX_BYTES = 64 * 1024 * 1024
MAX_ROWS = 1_000_000
#: fewest complete rows (a test split per label needs a few of each)
MIN_ROWS = 10

_CACHE: dict[tuple[int, bytes], Partition] = {}
_LOCK = threading.Lock()


def _check_ranges(x: np.ndarray, lines: list[int], path: Path) -> None:
    for j, spec in enumerate(FEATURE_SPEC):
        if "min" not in spec:
            continue
        col = x[:, j]
        bad = (col < spec["min"]) | (col > spec["max"])
        if "missing_code" in spec:
            bad &= col != spec["missing_code"]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(f"{path}: row {lines[i]}, column {FEATURES[j]!r}: {float(col[i]):g} is outside "
                            f"[{spec['min']:g}, {spec['max']:g}] ({spec['unit']}); fix or remove the row")


def _parse(path: Path, data: bytes, seed: int, name: str) -> Partition:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise DataError(f"{path} is not UTF-8 text (line {line}, byte {exc.start}); save it as UTF-8 CSV") from exc
    try:
        reader = csv.reader(io.StringIO(text, newline=""))
        header = next(reader, None)
        if header is None:
            raise DataError(f"{path} is empty; give a CSV with the header {','.join(REQUIRED_COLUMNS)}")
        header = [h.strip() for h in header]
        dup = sorted({h if len(h) <= 40 else h[:40] + "…" for h in header if header.count(h) > 1})
        if dup:
            raise DataError(f"{path}: column(s) {dup} appear more than once in the header")
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; the heart task's columns are "
                            f"{list(REQUIRED_COLUMNS)} (optional: {list(OPTIONAL_COLUMNS)})")
        unknown = [c for c in header if c not in REQUIRED_COLUMNS and c not in OPTIONAL_COLUMNS]
        if unknown:
            unknown = [c if len(c) <= 40 else c[:40] + "…" for c in unknown[:8]]  # a header cell can be 100 KB
            raise DataError(f"{path}: unknown column(s) {unknown}; the heart task's columns are "
                            f"{list(REQUIRED_COLUMNS)} (optional: {list(OPTIONAL_COLUMNS)})")
        rows = []
        for line, cells in enumerate(reader, start=2):
            if not cells:
                continue  # a blank line
            if line - 1 > MAX_ROWS:
                raise DataError(f"{path} has more than {MAX_ROWS} rows; split it or sample it")
            if len(cells) != len(header):
                raise DataError(f"{path}: row {line} has {len(cells)} cells, the header {len(header)}")
            row = dict(zip(header, cells))
            if _complete(row):
                rows.append((line, row))
    except csv.Error as exc:
        raise DataError(f"{path}: not a readable CSV ({exc})") from exc
    if len(rows) < MIN_ROWS:
        raise DataError(f"{path} has {len(rows)} complete rows; at least {MIN_ROWS} are needed to train and test")
    lines = [line for line, _ in rows]
    x = np.asarray([_features(r, line) for line, r in rows], dtype=np.float64)  # 1e308 stays itself until checked
    y = np.asarray([_label(r, line) for line, r in rows], dtype=np.float32)
    _check_ranges(x, lines, path)
    x = x.astype(np.float32)  # every value is inside its feature's range now
    if len(set(y.tolist())) < 2:
        raise DataError(f"{path}: every complete row has the same label (num {'> 0' if y[0] else '= 0'}); "
                        "training needs patients with and without disease")
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for label in (0.0, 1.0):
        idx = np.flatnonzero(y == label)
        test[rng.permutation(idx)[: n_test_for(len(idx))]] = True
    return Partition(name, x[~test], y[~test], x[test], y[test])


def load_own_partition(path: str | Path, name: str, seed: int = 42) -> Partition:
    """The partner ``name``'s own CSV at ``path`` as a :class:`Partition` (see module doc).

    Parsed once per (seed, SHA-256 of the bytes) in a process; copies are returned.
    Raises DataError (file, row, column and value named) for anything not accepted.
    """
    p = Path(path)
    if p.is_dir():
        raise DataError(f"--data {p} is a directory; the heart task reads one CSV file")
    try:
        data = read_capped(p, MAX_BYTES)
    except OSError as exc:
        raise DataError(f"cannot read {p}: {exc.strerror or exc}") from exc
    if len(data) > MAX_BYTES:
        raise DataError(f"{p} is larger than {MAX_BYTES // (1024 * 1024)} MiB; split it or sample it")
    key = (int(seed), hashlib.sha256(data).digest() + name.encode())
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is None:
        hit = _parse(p, data, int(seed), name)
        with _LOCK:
            if len(_CACHE) >= 4:
                _CACHE.clear()
            _CACHE[key] = hit
    return Partition(hit.name, hit.x_train.copy(), hit.y_train.copy(), hit.x_test.copy(), hit.y_test.copy())


# the documented schema is the bundled loader's: keep the two lists in step
assert set(REQUIRED_COLUMNS) == {"num", *NUMERIC, *BINARY, "cp", "restecg"}
