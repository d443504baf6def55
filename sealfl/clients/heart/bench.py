"""Benchmark-only task variants of the heart task (issue 9): many simulated partners
(P6) and a LoRA-sized update (P2.lora). Registered in :data:`sealfl.clients.plugins.TASKS`
as ``bench-heart-64``, ``bench-heart-256``, ``bench-heart-1024`` and ``bench-lora-8``; nothing
but ``bench/round_bench.py`` and ``bench/scale.py`` create consortia with them.

- Partners ``sim-000`` ... : the 4 hospitals' pooled training rows dealt round-robin
  (partner j gets rows j, j+K, ...; 490 rows give every partner of 256 at least one),
  and the pooled test rows likewise (with fewer rows than partners -- test rows from 64
  partners on, training rows at 1,024 -- partner j reuses split ``j mod n_rows``; pooled
  figures then count some rows twice -- these tasks measure time and memory, not accuracy).
- ``pad`` extra parameters after the heart model's 14: a stand-in for LoRA adapters
  (each round a partner moves them by a seeded N(0, 0.01) step; shares stay far inside
  the codec's ±8), so the update has the size of SmolLM2's adapters (460,800 values).
"""

from __future__ import annotations

import numpy as np

from sealfl.clients.heart.data import HOSPITALS, Partition, load_partition
from sealfl.clients.heart.task import HeartTask


class SplitHeartTask:
    """Heart logistic regression over ``k`` simulated partners, ``pad`` extra parameters."""

    k = 8
    pad = 0
    release_kind = "tabular"
    partners_doc = "simulated benchmark partners"
    candidate_sums: tuple[str, ...] = ()
    reference_candidates: tuple[str, ...] = ()

    def __init__(self):
        self._heart = HeartTask()
        self.partners = tuple(f"sim-{j:03d}" for j in range(self.k))
        self.n_params = self._heart.n_params + self.pad
        self.stats_length = self._heart.stats_length
        self.decrypt_bounds = self._heart.decrypt_bounds
        self._pooled: dict[int, tuple] = {}

    def init_params(self, seed: int = 0) -> np.ndarray:
        return np.zeros(self.n_params, dtype=np.float64)

    def train_defaults(self) -> dict:
        return self._heart.train_defaults()

    def _pool(self, seed: int):
        if seed not in self._pooled:
            parts = [load_partition(h, seed=seed) for h in HOSPITALS]
            self._pooled[seed] = tuple(np.concatenate([getattr(p, a) for p in parts])
                                       for a in ("x_train", "y_train", "x_test", "y_test"))
        return self._pooled[seed]

    def load_data(self, partner: str, config) -> Partition:
        j = self.partners.index(partner)
        xtr, ytr, xte, yte = self._pool(int(config.get("data-seed", 42)))
        step, step_t = min(self.k, len(ytr)), min(self.k, len(yte))
        r, t = j % step, j % step_t
        return Partition(partner, xtr[r::step], ytr[r::step], xte[t::step_t], yte[t::step_t])

    def local_stats(self, data) -> np.ndarray:
        from sealfl.clients.heart.stats import local_sums

        return local_sums(data.x_train)

    def n_train(self, data) -> int:
        return int(data.n_train)

    def train_round(self, params, data, mean, std, config, seed: int):
        head, metrics = self._heart.train_round(params[:14], data, mean, std, config, seed)
        if not self.pad:
            return head, metrics
        tail = params[14:] + np.random.default_rng(seed).normal(0.0, 0.01, self.pad)
        return np.concatenate([head, np.clip(tail, -1.0, 1.0)]), metrics

    def evaluate_round(self, params, data, mean, std) -> dict:
        return self._heart.evaluate(params[:14], data.x_test, data.y_test, mean, std)

    def score_candidates(self, candidates, data, params=None, mean=None, std=None) -> dict:
        return self._heart.score_candidates(candidates, data, params, mean, std)


class BenchHeart64(SplitHeartTask):
    name, k = "bench-heart-64", 64


class BenchHeart256(SplitHeartTask):
    name, k = "bench-heart-256", 256


class BenchHeart1024(SplitHeartTask):
    name, k = "bench-heart-1024", 1024


class BenchLora8(SplitHeartTask):
    name, k, pad = "bench-lora-8", 8, 460_800 - 14
