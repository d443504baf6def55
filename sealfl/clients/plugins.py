"""Tasks are plug-ins: the consortium's ``task`` names one, and campaign, strategy, release
pipeline and device code ask it instead of knowing the model.

A task (:class:`Task`) gives the aggregator plain numbers -- the flat vector length
(``n_params``), the statistics vector length (``stats_length``), the public initial model
(``init_params``), the training settings partners receive (``train_defaults``) -- and gives
partners everything model-specific: their own data (``load_data``), the plaintext
statistics ``[n, Σx, Σx²]`` they encrypt (``local_stats``), local training
(``train_round``), evaluation (``evaluate_round``) and the release gate's scoring of
candidate models (``score_candidates``), plus what a key holder accepts as a decrypted
aggregate (``decrypt_bounds``). The release pipeline builds what ``release_kind`` names
(``tabular``, ``causal-lm``: :data:`sealfl.platform.release.BUILDERS`) under the default
name ``release_name``.

Registered tasks (:data:`TASKS`): ``heart`` (logistic regression on Fed-Heart-Disease,
:class:`sealfl.clients.heart.task.HeartTask`) and ``causal-lm`` (federated LoRA of
SmolLM2-135M-Instruct, :class:`sealfl.clients.causal_lm.task.CausalLMTask`). Tasks are
imported on first use, so naming one never loads the other's dependencies.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from sealfl.clients.errors import ClientError
from sealfl.he.decrypted import DecryptBounds

__all__ = ["Task", "TASKS", "ALIASES", "get_task", "task_names"]

#: task name -> "module:class"
TASKS = {
    "heart": "sealfl.clients.heart.task:HeartTask",
    "causal-lm": "sealfl.clients.causal_lm.task:CausalLMTask",
    # benchmark-only variants (bench/round_bench.py; sealfl.clients.heart.bench)
    "bench-heart-64": "sealfl.clients.heart.bench:BenchHeart64",
    "bench-heart-256": "sealfl.clients.heart.bench:BenchHeart256",
    "bench-heart-1024": "sealfl.clients.heart.bench:BenchHeart1024",
    "bench-lora-8": "sealfl.clients.heart.bench:BenchLora8",
}
#: names earlier consortia stored
ALIASES = {"heart-logreg": "heart"}


class Task(Protocol):
    """What a task provides (see module docstring)."""

    name: str
    release_kind: str
    release_name: str
    n_params: int
    stats_length: int
    decrypt_bounds: DecryptBounds
    partners: tuple[str, ...]
    partners_doc: str
    candidate_sums: tuple[str, ...]
    reference_candidates: tuple[str, ...]

    def init_params(self, seed: int = 0) -> np.ndarray: ...

    def train_defaults(self) -> dict: ...

    def load_data(self, partner: str, config: Mapping) -> Any: ...

    def local_stats(self, data: Any) -> np.ndarray: ...

    def n_train(self, data: Any) -> int: ...

    def train_round(self, params: np.ndarray, data: Any, mean: np.ndarray, std: np.ndarray, config: Mapping,
                    seed: int) -> tuple[np.ndarray, dict]: ...

    def evaluate_round(self, params: np.ndarray, data: Any, mean: np.ndarray, std: np.ndarray) -> dict: ...

    def score_candidates(self, candidates: Mapping[str, bytes], data: Any, params: np.ndarray | None,
                         mean: np.ndarray | None, std: np.ndarray | None) -> dict: ...

    # optional: ``warm_up(data) -> None``, run once by a long-lived partner process before it
    # joins (``sealfl partner start``), so its first round pays no one-time start-up cost


def task_names() -> list[str]:
    """The registered task names."""
    return sorted(TASKS)


_INSTANCES: dict[str, Any] = {}


def get_task(name: str) -> Task:
    """The task registered as ``name`` (or an alias); one instance per process.

    Raises:
        ClientError: unknown name (lists the known ones).
    """
    key = ALIASES.get(name, name)
    if key not in TASKS:
        raise ClientError(f"unknown task {name!r}; known tasks: {', '.join(task_names())}")
    if key not in _INSTANCES:
        module, _, cls = TASKS[key].partition(":")
        _INSTANCES[key] = getattr(importlib.import_module(module), cls)()
    return _INSTANCES[key]
