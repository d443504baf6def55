"""Global feature scaling without pooling raw data.

Each partner encrypts ``[n, Σx_j (13), Σx_j² (13)]`` (27 float64 values) under the campaign's HE codec (wide layout);
the aggregator adds the ciphertexts; key holders decrypt the sums and derive the global
mean and (population) standard deviation: ``mean = Σx/n``,
``std = sqrt(max(Σx²/n - mean², 0))`` (a feature with std 0 gets std 1).
Only the four-hospital aggregate is ever decrypted.
"""

from __future__ import annotations

import numpy as np

from sealfl.clients.errors import TaskInputError


def local_sums(x: np.ndarray) -> np.ndarray:
    """``[n, Σx (d), Σx² (d)]`` of a float (n, d) array, as float64 (1 + 2d,)."""
    x = np.asarray(x, dtype=np.float64)
    return np.concatenate([[len(x)], x.sum(axis=0), (x**2).sum(axis=0)])


def mean_std(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global (mean, std), each float64 (d,), from summed :func:`local_sums`.

    Raises ValueError if the vector length is not odd or the count is not positive.
    """
    sums = np.asarray(sums, dtype=np.float64)
    if sums.ndim != 1 or len(sums) % 2 != 1:
        raise TaskInputError(f"expected [n, Σx, Σx²] of odd length, got shape {sums.shape}")
    d = (len(sums) - 1) // 2
    n = float(np.round(sums[0]))
    if n <= 0:
        raise TaskInputError("global sample count is not positive")
    mean = sums[1 : 1 + d] / n
    var = np.maximum(sums[1 + d :] / n - mean**2, 0.0)
    std = np.sqrt(var)
    std[std < 1e-12] = 1.0
    return mean, std
