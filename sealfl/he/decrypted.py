"""What a key holder may do with a decryption before anything of it leaves: bound it
and round it (pure NumPy; no TenSEAL).

With the default packed BFV codec (:mod:`sealfl.he.bfv`) decryptions are exact: partners
encrypt their share ``(n_i / N) w_i`` and key holders multiply the decrypted sum by N
(:func:`update_share`, :func:`share_to_sum`, the codec's ``WEIGHTING``); the rounding below
costs nothing there and keeps every published value on the same grid. With the CKKS option
(:mod:`sealfl.he.ckks`) partners encrypt ``n_i w_i`` and decryptions carry noise, hence the
rounding.

Why round (CKKS): a CKKS decryption is the plaintext plus noise that depends on the secret key
and the encryption randomness. Publishing decryptions at full precision lets an observer
recover the secret key (Li and Micciancio, "On the Security of Homomorphic Encryption on
Approximate Numbers", EUROCRYPT 2021, ePrint 2020/1533; SEAL's maintainers give the
same warning in its issue tracker). Every key holder therefore rounds each decrypted
aggregate to a grid far coarser than the noise, *before* it computes anything from it:
all that leaves a key holder (global model parameters, the mean/std written into the
ONNX file, the loss and accuracy a partner reports) is a function of rounded values.

Grids (powers of two, so rounding is exact in float64):

- ``sum_grid_bits`` (default 12): the decrypted sums ``E(Σ n_i w_i)`` and
  ``E(Σ [n, Σx, Σx²])`` are rounded to multiples of ``2**-12`` (≈ 2.4e-4). The decryption
  error measured here (N=8192, scale 2^40, 4 partners, values up to 2.8e7) is at most
  1.1e-8, so the grid is about 2^14 times the noise. Residual: a value lying within the
  noise of a grid boundary (probability ≈ 2·1e-8 / 2.4e-4 ≈ 1e-4 per value) still reveals
  the sign of its noise; removing that too needs noise flooding, which at the precision
  FedAvg needs is not affordable (Li, Micciancio, Schultz, Sorrell, CRYPTO 2022).
- ``param_grid_bits`` (default 20): published parameters and mean/std are rounded again
  to multiples of ``2**-20`` (≈ 9.5e-7) after the division, so they carry no bits below
  that grid (float32 -- what the ONNX file holds -- resolves 2^-20 only below 8).
- ``metric_grid_bits`` (default 20): a partner's reported loss.

Bounds (declared by the task, :class:`DecryptBounds`): every parameter ``|w| <=
param_abs_max``; the statistics count equals the total the partners declared in plaintext
(to within ``count_tolerance``); every feature mean within ``feature_abs_max`` and
every variance non-negative (to within the noise) and at most ``feature_abs_max**2``.
A decryption outside its bounds is refused with :class:`DecryptedValueError`; nothing
derived from it is published.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from sealfl.he.errors import DecryptedValueError
from sealfl.he.framed import PACKED, Layout

log = logging.getLogger(__name__)

__all__ = ["DecryptBounds", "round_to_grid", "check_weight", "check_params", "WEIGHTINGS", "update_share", "upload_clip", "share_to_sum", "open_model", "open_stats",
           "round_metric"]


@dataclass(frozen=True)
class DecryptBounds:
    """Bounds and grids for decrypted aggregates (see module docstring).

    Attributes:
        param_abs_max: largest allowed ``|parameter|`` of the averaged model.
        feature_abs_max: largest allowed ``|mean|`` and standard deviation of a raw feature.
        max_total_examples: largest allowed statistics count (total training rows).
        count_tolerance: largest allowed ``|decrypted count - declared total|`` (the
            decryption noise is ~1e-8; 0.01 rows is a generous tolerance).
        sum_grid_bits: decrypted sums are rounded to multiples of ``2**-sum_grid_bits``.
        param_grid_bits: published parameters/mean/std to multiples of ``2**-param_grid_bits``.
        metric_grid_bits: reported losses to multiples of ``2**-metric_grid_bits``.
    """

    param_abs_max: float = 1e3
    feature_abs_max: float = 1e4
    max_total_examples: int = 10**8
    count_tolerance: float = 0.01
    sum_grid_bits: int = 12
    param_grid_bits: int = 20
    metric_grid_bits: int = 20


def round_to_grid(x, bits: int) -> np.ndarray:
    """Round ``x`` (float64 array-like) to the nearest multiple of ``2**-bits`` (ties to
    even, NumPy ``rint``). Exact in float64 for ``|x| < 2**(52 - bits)``.

    Raises DecryptedValueError if ``x`` holds NaN or infinity.
    """
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise DecryptedValueError("decrypted values are not finite")
    return np.ldexp(np.rint(np.ldexp(x, bits)), -bits)


def check_weight(weight, max_total: int) -> int:
    """The aggregate's total weight Σ n_i as an int: a finite whole number in
    ``[1, max_total]``. Raises DecryptedValueError otherwise."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)):
        raise DecryptedValueError(f"aggregate weight {weight!r} is not a number")
    w = float(weight)
    if not math.isfinite(w) or w != math.floor(w) or not 1 <= w <= max_total:
        raise DecryptedValueError(f"aggregate weight {weight!r} is not a whole number of examples in [1, {max_total}]")
    return int(w)


#: how partners weight their update before encrypting (the codec's ``WEIGHTING``):
#: ``"share"`` -- ``(n_i / N) w_i`` (BFV: the sum stays within the packed layout's ±8);
#: ``"count"`` -- ``n_i w_i`` (CKKS: the decryption noise is absolute, ~1e-8 here, so the
#: sum grid 2^-12 on ``Σ n_i w_i`` stays ~2^14 times the noise; multiplying a decrypted
#: share by N would multiply the noise by N too)
WEIGHTINGS = ("share", "count")


def update_share(params, n: int, declared_total: int, weighting: str, layout: Layout = PACKED) -> np.ndarray:
    """What a partner encrypts for weighted FedAvg (float64): ``(n / N) * params`` for the
    ``"share"`` weighting, ``n * params`` for ``"count"`` (:data:`WEIGHTINGS`), with ``n``
    its training rows and ``N`` the total the partners declared in the statistics round
    (known to every partner from the global record). Shares of all partners sum to the
    weighted average times ``W / N`` (W = rows of the accepted partners).

    For ``"share"`` (packed BFV) the parameters themselves are first clipped to
    ``±PACKED.clip`` (8 - 2^-10, Flower SecAgg+'s clipping range), with a warning: then
    ``|Σ (n_i/N) w_i| <= max|w_i| * Σ n_i/N < 8`` whatever the number of partners, so
    the packed sum cannot wrap (:mod:`sealfl.he.bfv`). Clipping each *share* to ±8
    would not do: four shares of 2.25 (w = 9) sum to 9 and wrap to -7. ``layout``: the
    campaign's update layout (``codec.params.update_layout``); a narrower packing clips to
    its own ``clip`` (:func:`sealfl.he.layouts.packed_layout`).

    Raises DecryptedValueError for counts out of range or an unknown weighting."""
    if not (isinstance(n, (int, np.integer)) and isinstance(declared_total, (int, np.integer))
            and 1 <= n <= declared_total):
        raise DecryptedValueError(f"cannot weight an update by {n!r} of {declared_total!r} rows")
    clip = upload_clip(weighting, layout)  # raises for an unknown weighting
    w = np.asarray(params, dtype=np.float64)
    if clip is None:
        return w * float(int(n))
    over = int(np.count_nonzero(np.abs(w) > clip))
    if over:
        log.warning("clipped %d of %d parameters to ±%g before weighting (the packed BFV layout's range)",
                    over, w.size, clip)
        w = np.clip(w, -clip, clip)
    return w * (int(n) / int(declared_total))


def upload_clip(weighting: str, layout: Layout = PACKED) -> float | None:
    """The range ``±clip`` every uploaded value is clipped to under ``weighting``
    (:func:`update_share`): ``layout.clip`` for ``"share"`` (packed BFV; ``PACKED.clip`` at the
    default 27-bit packing), None for ``"count"`` (no clipping). Raises DecryptedValueError
    for an unknown weighting."""
    if weighting not in WEIGHTINGS:
        raise DecryptedValueError(f"unknown update weighting {weighting!r}")
    return layout.clip if weighting == "share" else None


def share_to_sum(decrypted_share, declared_total: int, weighting: str) -> np.ndarray:
    """Key-holder side of :func:`update_share`: ``Σ n_i w_i`` (float64), the input of
    :func:`open_model` -- the decrypted ``Σ (n_i / N) w_i`` times ``N`` (exact for BFV: the
    values are multiples of 2^-23 below 2^3 and N < 2^27), or the decryption itself for
    ``"count"``. Raises DecryptedValueError for an unknown weighting."""
    if weighting not in WEIGHTINGS:
        raise DecryptedValueError(f"unknown update weighting {weighting!r}")
    s = np.asarray(decrypted_share, dtype=np.float64)
    return s * int(declared_total) if weighting == "share" else s


def open_model(decrypted_sum, weight, bounds: DecryptBounds, max_total: int | None = None) -> np.ndarray:
    """Weighted FedAvg's last step at a key holder: ``round(round(Σ n_i w_i) / Σ n_i)``.

    Args:
        decrypted_sum: float64 (P,), the decryption of ``E(Σ n_i w_i)``.
        weight: Σ n_i from the aggregator (a whole number, at most ``max_total``; defaults
            to ``bounds.max_total_examples``).
        bounds: the task's bounds and grids.
    Returns:
        float64 (P,) on the ``param_grid_bits`` grid.
    Raises:
        DecryptedValueError: the weight is not a whole number in range, or a parameter
            is not finite or exceeds ``param_abs_max`` (names the first bad index).
    """
    w = check_weight(weight, bounds.max_total_examples if max_total is None else max_total)
    return check_params(round_to_grid(round_to_grid(decrypted_sum, bounds.sum_grid_bits) / w, bounds.param_grid_bits),
                        bounds)


def check_params(params, bounds: DecryptBounds) -> np.ndarray:
    """``params`` (float64 (P,)) if every value is finite and within ``±bounds.param_abs_max``
    (applied to the opened mean and again to a server optimizer's step,
    :mod:`sealfl.he.server_opt`). Raises DecryptedValueError naming the first bad index."""
    params = np.asarray(params, dtype=np.float64)
    bad = np.flatnonzero(~(np.abs(params) <= bounds.param_abs_max))
    if bad.size:
        i = int(bad[0])
        raise DecryptedValueError(f"decrypted model parameter {i} is {params[i]:.6g}, outside the task's bound "
                                  f"|w| <= {bounds.param_abs_max:g} ({bad.size} of {params.size} out of bounds); "
                                  "the aggregate is corrupt or poisoned -- not using it")
    return params


def open_stats(decrypted_sums, declared_total: int, bounds: DecryptBounds) -> tuple[np.ndarray, np.ndarray]:
    """Global (mean, std) from the decrypted ``[n, Σx (d), Σx² (d)]``, checked and rounded.

    ``n`` must equal ``declared_total`` (Σ of the counts partners declared in plaintext in
    the statistics round) to within ``count_tolerance``; the sums are rounded to the sum
    grid, then ``mean = Σx/n``, ``std = sqrt(max(Σx²/n - mean², 0))`` (a feature with
    std that rounds to 0 gets 1, like :func:`sealfl.clients.heart.stats.mean_std`), each rounded to the
    parameter grid.

    Returns:
        (mean, std), float64 (d,) each.
    Raises:
        DecryptedValueError: wrong shape, a count other than the declared total, or a
            mean/variance outside the task's bounds (names the feature index).
    """
    s = np.asarray(decrypted_sums, dtype=np.float64)
    if s.ndim != 1 or len(s) % 2 != 1 or len(s) < 3:
        raise DecryptedValueError(f"expected [n, Σx, Σx²] of odd length >= 3, got shape {s.shape}")
    if isinstance(declared_total, bool) or not isinstance(declared_total, (int, np.integer)) \
            or not 1 <= int(declared_total) <= bounds.max_total_examples:
        raise DecryptedValueError(f"declared statistics total {declared_total!r} is not a count in "
                                  f"[1, {bounds.max_total_examples}]")
    if not np.all(np.isfinite(s)):
        raise DecryptedValueError("decrypted statistics are not finite")
    if abs(s[0] - int(declared_total)) > bounds.count_tolerance:
        raise DecryptedValueError(f"decrypted statistics count {s[0]:.3f} differs from the {int(declared_total)} rows "
                                  "the partners declared: a partner encrypted another count than it declared")
    d = (len(s) - 1) // 2
    n = float(int(declared_total))
    r = round_to_grid(s, bounds.sum_grid_bits)
    mean = r[1:1 + d] / n
    var = r[1 + d:] / n - mean**2
    # the sum grid's rounding can push a zero variance slightly below 0
    slack = 2.0 ** -bounds.sum_grid_bits * (1 + 2 * np.abs(mean)) / n * 4
    limit = bounds.feature_abs_max
    for j in range(d):
        if abs(mean[j]) > limit:
            raise DecryptedValueError(f"decrypted mean of feature {j} is {mean[j]:.6g}, outside the bound "
                                      f"|mean| <= {limit:g}; not using these statistics")
        if var[j] < -slack[j] or var[j] > limit**2:
            raise DecryptedValueError(f"decrypted variance of feature {j} is {var[j]:.6g}, outside [0, {limit**2:g}]; "
                                      "not using these statistics")
    std = round_to_grid(np.sqrt(np.maximum(var, 0.0)), bounds.param_grid_bits)
    std[std == 0.0] = 1.0  # constant at this precision (mean_std uses std < 1e-12)
    return round_to_grid(mean, bounds.param_grid_bits), std


def round_metric(value: float, bounds: DecryptBounds) -> float:
    """A metric a partner reports (e.g. a loss), rounded to the metric grid. Raises
    DecryptedValueError if it is not finite."""
    return float(round_to_grid(np.asarray([value], dtype=np.float64), bounds.metric_grid_bits)[0])
