"""Server optimizers (FedAvgM, FedAdam) run at the key holders, on decrypted aggregates.

Why here: under HE the aggregator only adds ciphertexts and never sees the average, so
an aggregator-side optimizer (Flower's ``FedAvgM``/``FedAdam`` strategies) cannot run; NVIDIA
FLARE's HE mode drops them for that reason. In sealfl every partner is a key holder and
decrypts the aggregate anyway, so each applies the optimizer step itself. Every partner
decrypts the same ciphertext and rounds it to the same grid (:mod:`sealfl.he.decrypted`),
so the step is deterministic: all partners hold the same global model, and so does the
release enclave that opens the last checkpoint.

Where the optimizer's state lives: in the aggregate. A partner uploads not only its local
model ``w_i`` but also the state it started the round from, all encrypted and weighted
like ``w_i`` (:func:`sealfl.he.decrypted.update_share`)::

    wire vector = [ w_i (P) | x_t (P) | m_{t-1} (P) | u_{t-1} (P) | b1, b2 | tag (8) ]  (FedAdam)
    wire vector = [ w_i (P) | x_t (P) | m_{t-1} (P) | tag (8) ]                        (FedAvgM)
    wire vector = [ w_i (P) ]                                                          (FedAvg)

Every honest partner uploads the same state, so its weighted mean over the accepted
partners is that state again (to within the grid), whatever subset of partners replied.
Partners hold nothing between rounds (one absent for ten rounds comes back in step),
each round's checkpoint holds the optimizer's state with the model, and no state ever
exists in plaintext outside a key holder. The price is bytes: 3x the update for FedAvgM,
4x for FedAdam (still below the 14.4x of FLARE's CKKS defaults for FedAvg alone).

The ``tag`` binds the state to the settings it was made with: 64 bits of the SHA-256 of
the optimizer's name and settings (:meth:`ServerOpt.settings_tag`), eight values
``k / 256`` that survive the sum and the grids exactly. A key holder steps only an
aggregate whose tag is that of its own settings: a coordinator that changes the
learning rate between rounds, or edits ``server_config.json`` before the release, is
refused instead of publishing a model nobody trained.

Under packed BFV every uploaded value is clipped to ``±PACKED.clip`` (8 - 2^-10); the step
then clips the model and the state it publishes to that range itself (with a warning), so
the model partners train from, the state they carry and the released model are the same
values the next aggregate holds.

The steps follow Flower 1.42's strategies so that an encrypted campaign and a plaintext
Flower one agree (``flwr.serverapp.strategy.FedAvgM`` / ``FedAdam``, after Reddi et al.,
"Adaptive Federated Optimization", ICLR 2021, Algorithm 2, and Hsu et al. 2019 for server
momentum), with ``x̄_t`` the weighted average of the partners' models of round ``t``:

- FedAvgM: ``g = x_t - x̄_t``; ``m_t = momentum * m_{t-1} + g`` (``m_0 = 0``);
  ``x_{t+1} = x_t - lr * m_t``.
- FedAdam: ``Δ = x̄_t - x_t``; ``m_t = β1 m_{t-1} + (1-β1) Δ``; ``v_t = β2 v_{t-1} +
  (1-β2) Δ²``; ``x_{t+1} = x_t + lr * sqrt(1-β2^(t+1)) / (1-β1^(t+1)) * m_t / (sqrt(v_t) + τ)``
  (Flower's bias correction, exponent ``t+1`` for round ``t``). The state carries
  ``u = sqrt(v)`` (same scale as ``Δ``, so the grids keep its precision) and the powers
  ``b1 = β1^(t+1)``, ``b2 = β2^(t+1)``, so a key holder needs no round number.

Everything a step returns is rounded to the parameter grid, like any published value.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from sealfl.common.errors import short_repr
from sealfl.he.decrypted import round_to_grid
from sealfl.he.errors import DecryptedValueError, ServerOptError

__all__ = ["OPTIMIZERS", "ServerOpt", "ServerOptError"]

log = logging.getLogger(__name__)

#: the server optimizers a campaign may choose
OPTIMIZERS = ("fedavg", "fedavgm", "fedadam")

#: round-config keys (sent to partners with the training settings, kept in server_config.json)
KEYS = {"name": "server-opt", "lr": "server-lr", "momentum": "server-momentum",
        "beta_1": "server-beta1", "beta_2": "server-beta2", "tau": "server-tau"}

#: the settings each optimizer uses (a non-default value of any other is refused)
USES = {"fedavg": (), "fedavgm": ("lr", "momentum"), "fedadam": ("lr", "beta_1", "beta_2", "tau")}

#: ranges of the settings, (low, high, high included): below lr 1e-4 a step vanishes on the
#: 2^-20 parameter grid; below τ 1e-6 one grid step of m over u = 0 moves a weight by > lr;
#: β <= 0.9999 keeps 1 - β (the bias correction's divisor) far above the grids' error
RANGES = {"lr": (1e-4, 100.0, True), "momentum": (0.0, 1.0, False), "beta_1": (0.0, 0.9999, True),
          "beta_2": (0.0, 0.9999, True), "tau": (1e-6, 1.0, True)}

#: the settings tag: TAG_VALUES values of TAG_BITS bits each (64 bits of SHA-256)
TAG_VALUES, TAG_BITS = 8, 8


@dataclass(frozen=True)
class ServerOpt:
    """A server optimizer and its settings (defaults: Flower 1.42's).

    Attributes:
        name: one of :data:`OPTIMIZERS`.
        lr: server learning rate ``η`` (FedAvgM's ``server_learning_rate``, default 1.0;
            FedAdam's ``eta``, default 0.1 -- ``None`` picks the optimizer's default).
        momentum: FedAvgM's server momentum in [0, 1) (Flower's default 0: plain FedAvg
            with a learning rate; 0.9 is the usual choice, Hsu et al. 2019).
        beta_1, beta_2: FedAdam's moment decay rates in [0, 1) (0.9, 0.99).
        tau: FedAdam's adaptivity ``τ`` > 0 (1e-3).
    Raises:
        ServerOptError: an unknown name (not a string, or not one of :data:`OPTIMIZERS`;
            case and surrounding blanks do not matter), a setting that is not a real
            number, out of :data:`RANGES`, or not the default for an optimizer that does
            not use it (:data:`USES`).
    """

    name: str = "fedavg"
    lr: float | None = None
    momentum: float = 0.0
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self):
        name = self.name.strip().lower() if isinstance(self.name, str) else None
        if name not in OPTIMIZERS:
            raise ServerOptError(f"unknown server optimizer {short_repr(self.name)}; choose one of {', '.join(OPTIMIZERS)}")
        object.__setattr__(self, "name", name)
        if self.lr is None:
            object.__setattr__(self, "lr", 0.1 if name == "fedadam" else 1.0)
        for key, (lo, hi, hi_in) in RANGES.items():
            v = getattr(self, key)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
                raise ServerOptError(f"server optimizer setting {KEYS[key]} must be a number, got {short_repr(v)}")
            try:
                v = float(v) + 0.0  # + 0.0: -0.0 is 0.0 (one setting, one tag)
            except (OverflowError, ValueError, TypeError):
                raise ServerOptError(f"server optimizer setting {KEYS[key]} must be a finite number, "
                                     f"got {short_repr(v)}") from None
            if not math.isfinite(v):
                raise ServerOptError(f"server optimizer setting {KEYS[key]} must be a finite number, got {v!r}")
            if not (lo <= v <= hi if hi_in else lo <= v < hi):
                raise ServerOptError(f"{KEYS[key]} must be in [{lo!r}, {hi!r}{']' if hi_in else ')'}, got {v!r}")
            object.__setattr__(self, key, v)
        default = ServerOpt.__dataclass_fields__
        for key in RANGES:
            if key in USES[name]:
                continue
            dflt = 1.0 if key == "lr" else default[key].default
            if getattr(self, key) != dflt:
                users = [n for n in OPTIMIZERS if key in USES[n]]
                raise ServerOptError(f"{KEYS[key]} does not apply to {name} (only to {' and '.join(users)}); "
                                     f"leave it out or choose {users[0]}")

    # -- configuration -------------------------------------------------------------------

    @classmethod
    def from_config(cls, config) -> "ServerOpt":
        """The optimizer a round's config record (or any mapping) names; FedAvg if it names
        none. Raises ServerOptError for unknown names or out-of-range settings."""
        if not isinstance(config, Mapping):
            raise ServerOptError(f"the server optimizer settings must be a mapping, got {type(config).__name__}")
        kw = {}
        for attr, key in KEYS.items():
            if key in config:
                kw[attr] = config[key]
        if "name" in kw and not isinstance(kw["name"], str):
            raise ServerOptError(f"{KEYS['name']} must be a string, got {kw['name']!r}")
        return cls(**kw)

    def to_config(self) -> dict:
        """The round-config entries naming this optimizer (inverse of :meth:`from_config`)."""
        return {KEYS[a]: getattr(self, a) for a in KEYS}

    def describe(self) -> str:
        """The name and the settings it uses, for people: ``"fedadam (server-lr=0.1, ...)"``."""
        used = ", ".join(f"{KEYS[a]}={getattr(self, a)!r}" for a in USES[self.name])
        return f"{self.name} ({used})" if used else self.name

    def settings_tag(self) -> np.ndarray:
        """float64 (TAG_VALUES,): the first 64 bits of SHA-256 over the canonical JSON of the
        name and the settings it uses, as values ``k / 2**TAG_BITS`` in [0, 1); empty for
        FedAvg (no settings). Identical settings give identical tags on every machine."""
        if self.name == "fedavg":
            return np.zeros(0)
        canon = json.dumps({"name": self.name, **{k: getattr(self, k) for k in USES[self.name]}}, sort_keys=True)
        digest = hashlib.sha256(b"sealfl-server-opt\0" + canon.encode()).digest()
        return np.frombuffer(digest[:TAG_VALUES * TAG_BITS // 8], dtype=np.uint8).astype(np.float64) / 2.0 ** TAG_BITS

    # -- the wire layout -----------------------------------------------------------------

    @property
    def state_vectors(self) -> int:
        """Vectors of length P carried beside the local model: 0, 2 (x, m) or 3 (x, m, u)."""
        return {"fedavg": 0, "fedavgm": 2, "fedadam": 3}[self.name]

    @property
    def state_scalars(self) -> int:
        """Scalars carried after the vectors: FedAdam's ``b1, b2`` and the settings tag."""
        return {"fedavg": 0, "fedavgm": TAG_VALUES, "fedadam": 2 + TAG_VALUES}[self.name]

    def wire_length(self, n_params: int) -> int:
        """Length of the vector a partner encrypts for a model of ``n_params`` values."""
        return (1 + self.state_vectors) * int(n_params) + self.state_scalars

    def initial_state(self, x0) -> np.ndarray:
        """The state of round 1 for initial model ``x0`` (float64 (P,)): ``[x0, 0, tag]``
        (FedAvgM), ``[x0, 0, 0, β1, β2, tag]`` (FedAdam), empty (FedAvg); float64."""
        x0 = np.asarray(x0, dtype=np.float64).ravel()
        if self.name == "fedavg":
            return np.zeros(0)
        parts = [x0] + [np.zeros_like(x0)] * (self.state_vectors - 1)
        if self.name == "fedadam":
            parts.append(np.array([self.beta_1, self.beta_2]))
        return np.concatenate(parts + [self.settings_tag()])

    def pack(self, local, state) -> np.ndarray:
        """The wire vector ``[local, state]`` (float64) a partner weights and encrypts.
        Raises ServerOptError if the lengths do not fit this optimizer's layout."""
        local = np.asarray(local, dtype=np.float64).ravel()
        state = np.asarray(state, dtype=np.float64).ravel()
        if state.size != self.wire_length(local.size) - local.size:
            raise ServerOptError(f"{self.name}: a state of {state.size} values does not go with a model of "
                                 f"{local.size} ({self.wire_length(local.size) - local.size} expected)")
        return np.concatenate([local, state]) if state.size else local

    # -- the key holder's step -----------------------------------------------------------

    def step(self, mean, n_params: int, grid_bits: int = 20, *, clip: float | None = None,
             abs_max: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The key holder's step on the opened aggregate.

        Args:
            mean: float64 (wire_length(P),), the decrypted, rounded weighted mean of the
                partners' wire vectors (:func:`sealfl.he.decrypted.open_model`).
            n_params: P.
            grid_bits: the published values are rounded to multiples of ``2**-grid_bits``
                (the task's ``param_grid_bits``).
            clip: the codec's clipping range (packed BFV: ``PACKED.clip``; None for codecs
                that do not clip): the model and state are clipped to ``±clip`` (with a
                warning), as the next upload would clip them.
            abs_max: the largest ``|value|`` of the state (the task's ``param_abs_max``);
                a larger one is refused here rather than one round later.
        Returns:
            (x_next float64 (P,), state float64 (wire_length(P) - P,)): the next global
            model and the state partners upload beside their local models.
        Raises:
            DecryptedValueError: the length does not fit; a value is not finite; the
                settings tag is not this optimizer's (the state was made with other
                settings); the decrypted state is impossible (FedAdam's ``u < 0`` beyond
                the grid, ``b1, b2`` outside ``[0, β]``); or the new state exceeds
                ``abs_max``.
        """
        P, mean = _check_step_args(mean, n_params, grid_bits, clip, abs_max)
        if mean.size != self.wire_length(P):
            raise DecryptedValueError(f"{self.name}: the aggregate holds {mean.size} values, "
                                      f"{self.wire_length(P)} expected for a model of {P}")
        if not np.all(np.isfinite(mean)):
            raise DecryptedValueError(f"{self.name}: the aggregate holds a value that is not finite; "
                                      "it is corrupt or poisoned -- not using it")
        xbar = mean[:P]
        if self.name == "fedavg":
            x, _ = self._publish(xbar, [xbar], grid_bits, clip, abs_max)
            return x, np.zeros(0)
        self._check_tag(mean[mean.size - TAG_VALUES:])
        x, m = mean[P:2 * P], mean[2 * P:3 * P]
        if self.name == "fedavgm":
            m_new = self.momentum * m + (x - xbar)
            x_new = x - self.lr * m_new
            return self._publish(x_new, [x_new, m_new], grid_bits, clip, abs_max)
        u, (b1, b2) = mean[3 * P:4 * P], mean[4 * P:4 * P + 2]
        if np.any(u < -2.0 ** -(grid_bits - 2)):
            raise DecryptedValueError("FedAdam state: a decrypted second-moment root is negative; "
                                      "the aggregate is corrupt or poisoned -- not using it")
        for b, beta, label in ((b1, self.beta_1, "b1"), (b2, self.beta_2, "b2")):
            # b = β^(t+1) only shrinks, down to 0 once it is below the grid (then the bias
            # correction is 1 to within the grid); the grids move it by less than
            # 2^-(grid_bits-2). The bound keeps 1 - b >= 1 - β - 2^-(grid_bits-2) >= 1e-4 -
            # 2^-18 > 0 (β <= 0.9999, RANGES), so a poisoned b cannot blow up or flip the step.
            tol = 2.0 ** -(grid_bits - 2)
            if not -tol <= b <= beta + tol:
                raise DecryptedValueError(f"FedAdam state {label}={float(b)!r} is not a power of β={beta} in [0, β]; "
                                          "the aggregate is corrupt or poisoned -- not using it")
        b1, b2 = max(float(b1), 0.0) * self.beta_1, max(float(b2), 0.0) * self.beta_2
        delta = xbar - x
        m_new = self.beta_1 * m + (1 - self.beta_1) * delta
        v_new = self.beta_2 * u * u + (1 - self.beta_2) * delta * delta
        eta = self.lr * math.sqrt(1 - b2) / (1 - b1)
        u_new = np.sqrt(v_new)
        x_new = x + eta * m_new / (u_new + self.tau)
        return self._publish(x_new, [x_new, m_new, u_new, [b1, b2]], grid_bits, clip, abs_max)

    def _check_tag(self, got) -> None:
        want = self.settings_tag()
        k = np.ldexp(got, TAG_BITS)
        if np.any(np.abs(k - np.rint(k)) > 0.25) or not np.array_equal(np.rint(k), np.ldexp(want, TAG_BITS)):
            raise DecryptedValueError(
                f"the aggregate's {self.name} state was not made with this campaign's settings "
                f"({self.describe()}): the settings changed "
                "between rounds or after the campaign (server_config.json), or partners ran others -- not using it")

    def _publish(self, x_new, parts, grid_bits, clip, abs_max) -> tuple[np.ndarray, np.ndarray]:
        state = np.concatenate([np.ravel(p) for p in parts])
        if clip is not None:
            over = int(np.count_nonzero(np.abs(state) > clip))
            if over:
                log.warning("%s: clipped %d of %d values of the new model and state to ±%g (the packed BFV "
                            "layout's range; a smaller server-lr keeps them inside)", self.name, over, state.size, clip)
                state = np.clip(state, -clip, clip)
                x_new = state[:x_new.size]
        state = round_to_grid(state, grid_bits)
        if abs_max is not None and np.any(np.abs(state) > abs_max):
            i = int(np.argmax(np.abs(state)))
            raise DecryptedValueError(f"{self.name}: the new state holds {float(state[i]):g} at index {i}, beyond "
                                      f"±{abs_max:g}; the campaign diverged -- not using it")
        return round_to_grid(x_new, grid_bits), np.concatenate([state, self.settings_tag()])


def _check_step_args(mean, n_params, grid_bits, clip, abs_max) -> tuple[int, np.ndarray]:
    """(P, mean as float64 (n,)) for :meth:`ServerOpt.step`, or DecryptedValueError for
    arguments that cannot be a key holder's (the caller's bug or a corrupt decryption)."""
    def whole(v, lo, hi, label):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
            raise DecryptedValueError(f"server optimizer step: {label} must be a whole number in [{lo}, {hi}], "
                                      f"got {short_repr(v)}")
        return int(v)

    P = whole(n_params, 1, 1 << 40, "n_params")
    whole(grid_bits, 8, 52, "grid_bits")
    for label, v in (("clip", clip), ("abs_max", abs_max)):
        if v is not None and (isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real)
                              or not (math.isfinite(v) and v > 0)):
            raise DecryptedValueError(f"server optimizer step: {label} must be None or a positive finite number, "
                                      f"got {short_repr(v)}")
    arr = np.asarray(mean)
    if arr.dtype.kind not in "fiu":
        raise DecryptedValueError(f"server optimizer step: the aggregate must be real numbers, got dtype {arr.dtype}")
    return P, arr.astype(np.float64).ravel()
