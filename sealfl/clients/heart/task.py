"""Local training task: logistic regression on Fed-Heart-Disease (torch, CPU).

The model is FLamby's Fed-Heart-Disease baseline (a logistic regression, 13 inputs).
Standardisation is part of the model (fixed buffers ``mean``/``std`` from the encrypted
global statistics), so the exported ONNX file takes raw features.

Flat parameter vector (float64, shape (14,)): ``[w_0 .. w_12, b]``.

The task is a plug-in (:mod:`sealfl.clients.plugins`, registered as ``heart``): the
partner app, campaign and release pipeline reach it through the :class:`~sealfl.clients.plugins.Task`
methods (``load_data``, ``local_stats``, ``train_round``, ``evaluate_round``,
``score_candidates``).
"""

from __future__ import annotations

import io
import logging
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from sealfl.clients.errors import TaskInputError
from sealfl.clients.heart.data import FEATURE_SPEC, HOSPITALS, N_FEATURES, load_partition
from sealfl.he.decrypted import DecryptBounds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Local training settings.

    Attributes:
        local_epochs: passes over the partner's training split per round.
        lr: SGD learning rate.
        batch_size: mini-batch size (rows).
        seed: base seed; the effective seed is ``seed + 1000*round + partner_index``.
        proximal_mu: FedProx proximal term weight (0 = plain FedAvg).
    """

    local_epochs: int = 5
    lr: float = 0.05
    batch_size: int = 16
    seed: int = 0
    proximal_mu: float = 0.0


class HeartModel(nn.Module):
    """``sigmoid(((x - mean) / std) @ w + b)``; input float32 (n, 13), output float32 (n, 1)."""

    def __init__(self, mean: np.ndarray, std: np.ndarray):
        super().__init__()
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).reshape(1, -1))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).reshape(1, -1))
        self.linear = nn.Linear(N_FEATURES, 1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear((x - self.mean) / self.std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D401
        return torch.sigmoid(self.logits(x))


class HeartTask:
    """Logistic regression on the 13 Fed-Heart-Disease features.

    ``decrypt_bounds`` (:class:`sealfl.he.decrypted.DecryptBounds`) is what a key
    holder accepts as a decrypted aggregate of this task: ``|w| <= 1000`` (weights on
    standardised features; a logit beyond ~40 already saturates float32's sigmoid, and
    honest training here stays below 10) and ``|mean|, std <= 10,000`` for raw features
    (the largest, cholesterol in mg/dl, stays below 700 in the data).
    """

    name = "heart"
    release_kind = "tabular"
    release_name = "heart-risk"
    partners = HOSPITALS
    partners_doc = "the FLamby hospitals"
    #: the release gate's query: each candidate ONNX gets {correct, n}; no float sums
    candidate_sums: tuple[str, ...] = ()
    reference_candidates: tuple[str, ...] = ()
    n_features = N_FEATURES
    n_params = N_FEATURES + 1
    stats_length = 1 + 2 * N_FEATURES
    decrypt_bounds = DecryptBounds(param_abs_max=1e3, feature_abs_max=1e4)
    #: ONNX input/output names and the documented per-feature ranges a device enforces.
    input_name = "features"
    output_name = "probability"
    input_features = FEATURE_SPEC

    def init_params(self, seed: int = 0) -> np.ndarray:
        """Initial global model: all zeros (float64, (14,)); public, so sent in plaintext."""
        return np.zeros(self.n_params, dtype=np.float64)

    # -- the Task plug-in interface (sealfl.clients.plugins) -------------------------------

    def train_defaults(self) -> dict:
        """Training settings sent to partners unless the campaign overrides them."""
        d = TrainConfig()
        return {"local-epochs": d.local_epochs, "lr": d.lr, "batch-size": d.batch_size, "seed": d.seed,
                "proximal-mu": d.proximal_mu}

    def load_data(self, partner: str, config) -> object:
        """The partner's own CSV if ``config["data-path"]`` names one
        (:func:`sealfl.clients.heart.own_data.load_own_partition`), else its bundled FLamby
        split (:func:`sealfl.clients.heart.data.load_partition`)."""
        if config.get("data-path"):
            from sealfl.clients.heart.own_data import load_own_partition

            return load_own_partition(str(config["data-path"]), partner, seed=int(config.get("data-seed", 42)))
        return load_partition(partner, seed=int(config.get("data-seed", 42)))

    def local_stats(self, data) -> np.ndarray:
        """``[n, Σx (13), Σx² (13)]`` of the training split, float64 (27,)."""
        from sealfl.clients.heart.stats import local_sums

        return local_sums(data.x_train)

    def n_train(self, data) -> int:
        return int(data.n_train)

    def warm_up(self, data) -> None:
        """One local epoch on 8 training rows from the public initial model, result dropped:
        what a long-lived partner process does once before joining, so the first round does
        not pay torch's lazy imports (its first optimizer imports ``torch._dynamo``, ~2 s).
        Nothing leaves the partner."""
        n = min(8, int(data.n_train))
        self.train(self.init_params(), data.x_train[:n], data.y_train[:n], np.zeros(self.n_features),
                   np.ones(self.n_features), TrainConfig(local_epochs=1), 0)

    def train_round(self, params, data, mean, std, config, seed: int) -> tuple[np.ndarray, dict]:
        """:meth:`train` with settings from the round's config record."""
        d = TrainConfig()
        tc = TrainConfig(local_epochs=int(config.get("local-epochs", d.local_epochs)), lr=float(config.get("lr", d.lr)),
                         batch_size=int(config.get("batch-size", d.batch_size)), seed=int(config.get("seed", d.seed)),
                         proximal_mu=float(config.get("proximal-mu", d.proximal_mu)))
        return self.train(params, data.x_train, data.y_train, mean, std, tc, tc.seed + seed)

    def evaluate_round(self, params, data, mean, std) -> dict:
        """:meth:`evaluate` on the partner's test split."""
        return self.evaluate(params, data.x_test, data.y_test, mean, std)

    def score_candidates(self, candidates, data, params=None, mean=None, std=None) -> dict:
        """``{candidate: {"correct", "n"}}`` of each candidate ONNX model on the test split."""
        from sealfl.clients.heart.onnx_eval import onnx_predict

        out = {}
        for name, blob in candidates.items():
            p = onnx_predict(blob, data.x_test)
            out[name] = {"correct": int(np.sum((p >= 0.5) == (data.y_test >= 0.5))), "n": int(len(data.y_test))}
        return out

    def build(self, params: np.ndarray, mean: np.ndarray, std: np.ndarray) -> HeartModel:
        """A :class:`HeartModel` holding ``params``. Raises ValueError on a wrong length."""
        params = np.asarray(params, dtype=np.float64)
        if params.shape != (self.n_params,):
            raise TaskInputError(f"expected {self.n_params} parameters, got shape {params.shape}")
        model = HeartModel(mean, std)
        with torch.no_grad():
            model.linear.weight.copy_(torch.as_tensor(params[:-1], dtype=torch.float32).reshape(1, -1))
            model.linear.bias.copy_(torch.as_tensor(params[-1:], dtype=torch.float32))
        return model

    @staticmethod
    def flatten(model: HeartModel) -> np.ndarray:
        """The model's trainable parameters as float64 (14,)."""
        w = model.linear.weight.detach().cpu().numpy().reshape(-1)
        b = model.linear.bias.detach().cpu().numpy().reshape(-1)
        return np.concatenate([w, b]).astype(np.float64)

    def train(self, params: np.ndarray, x: np.ndarray, y: np.ndarray, mean: np.ndarray, std: np.ndarray,
              cfg: TrainConfig, seed: int) -> tuple[np.ndarray, dict]:
        """Train locally from ``params`` on (x (n,13) float32, y (n,) float32).

        Returns the new flat parameters (float64, (14,)) and metrics
        ``{"train_loss": mean BCE of the last epoch}``.
        """
        torch.manual_seed(seed)
        model = self.build(params, mean, std)
        start = [p.detach().clone() for p in model.linear.parameters()]
        opt = torch.optim.SGD(model.linear.parameters(), lr=cfg.lr)
        loss_fn = nn.BCEWithLogitsLoss()
        xt = torch.as_tensor(x, dtype=torch.float32)
        yt = torch.as_tensor(y, dtype=torch.float32).reshape(-1, 1)
        gen = torch.Generator().manual_seed(seed)
        last = 0.0
        for _ in range(cfg.local_epochs):
            perm = torch.randperm(len(xt), generator=gen)
            total, count = 0.0, 0
            for i in range(0, len(xt), cfg.batch_size):
                idx = perm[i : i + cfg.batch_size]
                opt.zero_grad()
                loss = loss_fn(model.logits(xt[idx]), yt[idx])
                if cfg.proximal_mu > 0:
                    prox = sum(((p - s) ** 2).sum() for p, s in zip(model.linear.parameters(), start))
                    loss = loss + 0.5 * cfg.proximal_mu * prox
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
                count += len(idx)
            last = total / max(count, 1)
        return self.flatten(model), {"train_loss": last}

    def dp_gradient_sum(self, params: np.ndarray, data, idx: np.ndarray, mean: np.ndarray, std: np.ndarray,
                        clip: float) -> np.ndarray:
        """Σ over the training rows ``idx`` of ``data`` of each example's BCE gradient clipped
        to L2 norm ``clip`` (Opacus, :func:`sealfl.clients.dp_local.clipped_gradient_sum`),
        flat like the parameters: float64 (14,) ``[w_0 .. w_12, b]``."""
        return self.clipped_gradient_sum(params, data.x_train[idx], data.y_train[idx], mean, std, clip)

    def clipped_gradient_sum(self, params: np.ndarray, x: np.ndarray, y: np.ndarray, mean: np.ndarray,
                             std: np.ndarray, clip: float) -> np.ndarray:
        """:meth:`dp_gradient_sum` over explicit rows (x (n,13) float32, y (n,) float32)."""
        from sealfl.clients.dp_local import clipped_gradient_sum

        model = self.build(params, mean, std)
        grads = clipped_gradient_sum(model.linear, nn.BCEWithLogitsLoss(reduction="sum"),
                                     (torch.as_tensor(x, dtype=torch.float32) - model.mean) / model.std,
                                     torch.as_tensor(y, dtype=torch.float32).reshape(-1, 1), clip)
        return np.concatenate([g.detach().numpy().reshape(-1) for g in grads]).astype(np.float64)

    def predict_proba(self, params: np.ndarray, x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
        """P(disease) for each row: float32 (n,)."""
        model = self.build(params, mean, std)
        with torch.no_grad():
            return model(torch.as_tensor(x, dtype=torch.float32)).numpy().reshape(-1)

    def evaluate(self, params: np.ndarray, x: np.ndarray, y: np.ndarray, mean: np.ndarray, std: np.ndarray) -> dict:
        """Accuracy at threshold 0.5 and mean BCE loss on (x, y).

        Returns ``{"accuracy": float in [0,1], "loss": float, "correct": int, "n": int}``.
        """
        p = self.predict_proba(params, x, mean, std).astype(np.float64)
        eps = 1e-7
        loss = float(-np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps))) if len(y) else 0.0
        correct = int(np.sum((p >= 0.5) == (y >= 0.5)))
        return {"accuracy": correct / max(len(y), 1), "loss": loss, "correct": correct, "n": int(len(y))}

    def to_onnx(self, params: np.ndarray, mean: np.ndarray, std: np.ndarray) -> bytes:
        """Export to ONNX (opset 17): input ``features`` float32 (batch, 13), output
        ``probability`` float32 (batch, 1). Returns the serialised model bytes."""
        model = self.build(params, mean, std).eval()
        buf = io.BytesIO()
        with warnings.catch_warnings():  # the TorchScript exporter is deprecated but exact for this graph
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                model, (torch.zeros(1, N_FEATURES),), buf, input_names=[self.input_name], output_names=[self.output_name],
                dynamic_axes={"features": {0: "batch"}, "probability": {0: "batch"}}, opset_version=17, dynamo=False,
            )
        return buf.getvalue()
