"""Record keys and (de)serialisation of the messages partners and the aggregator exchange.

All ciphertexts travel as uint8 ``Array`` entries of an ``ArrayRecord`` (Flower chunks
those; it does not chunk ``bytes`` in a ``ConfigRecord``).

Server -> partner (train / evaluate), ArrayRecord ``"global"``:
    ``model_plain`` float64 (P,)   -- round 1 only: the public initial model, or
    ``model_ct`` uint8 (frame) + ``model_weight`` float64 (1,) -- E(Σ n_i w_i) and Σ n_i
    ``stats_ct`` uint8 (frame)     -- E(Σ [n, Σx, Σx²]) for global scaling
Partner -> server (train reply): ArrayRecord ``"update"`` with ``update_ct`` uint8 =
    E(n_i · w_i) (the locally trained weights times the sample count), MetricRecord
    ``"metrics"`` with ``num-examples`` (n_i) and ``train_loss``, ConfigRecord
    ``"partner"`` with ``name``.
Server -> partner (query ``stats``): ConfigRecord ``"config"`` ``{"query": "stats"}``;
    reply ArrayRecord ``"stats"`` with ``stats_ct`` = E([n, Σx, Σx²]).

Server -> partner (query ``evaluate-onnx``): ArrayRecord ``"candidates"`` (name -> ONNX
    bytes as uint8); reply MetricRecord ``"metrics"`` with ``<name>.correct``, ``<name>.n``.

FedAvg on weights equals FedAvg on deltas (w + Σ n_i Δ_i / N = Σ n_i w_i / N), and lets
a partner that missed a round rejoin from the next aggregate without local state.
"""

from __future__ import annotations

import numpy as np

GLOBAL = "global"
UPDATE = "update"
STATS = "stats"
METRICS = "metrics"
PARTNER = "partner"
CONFIG = "config"
NUM_EXAMPLES = "num-examples"
QUERY_STATS = "stats"
QUERY_EVAL_ONNX = "evaluate-onnx"
CANDIDATES = "candidates"


def to_u8(blob: bytes) -> np.ndarray:
    """Bytes -> uint8 array (a copy Flower can own)."""
    return np.frombuffer(blob, dtype=np.uint8).copy()


def from_u8(arr: np.ndarray) -> bytes:
    """uint8 array -> bytes. Raises ValueError if ``arr`` is not a 1-D uint8 array."""
    arr = np.asarray(arr)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise ValueError(f"expected a 1-D uint8 array of ciphertext bytes, got {arr.dtype} {arr.shape}")
    return arr.tobytes()
