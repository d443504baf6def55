"""Round bookkeeping on disk: ``rounds.jsonl``, ``status.json`` and encrypted checkpoints.

Campaign directory layout (written by the aggregator, read by the coordinator):

- ``status.json`` -- ``{"status": "running"|"finished"|"failed", "round", "num_rounds",
  "error", "server_has_secret_key"}`` (rewritten atomically after every step)
- ``rounds.jsonl`` -- one JSON object per finished round (train + evaluate results)
- ``checkpoint/global.npz`` -- the latest encrypted global state (``model_ct`` uint8,
  ``model_weight`` float64 (1,), ``stats_ct`` uint8, ``round`` int64 (1,)); written to a
  temporary name and renamed, so a crash leaves the previous checkpoint intact.

Nothing here is secret: the aggregator only ever holds ciphertexts.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from sealfl.common.fsutil import atomic_write


#: Set when the process is being stopped by a signal: the aggregator thread must not
#: overwrite the "interrupted" status the signal handler records.
FROZEN = threading.Event()
#: Held around every status.json write, so "check FROZEN, then write" is atomic.
STATUS_LOCK = threading.Lock()


class RoundLog:
    """Append-only record of a campaign's rounds in ``campaign_dir``."""

    def __init__(self, campaign_dir: str | Path, num_rounds: int):
        self.dir = Path(campaign_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.num_rounds = num_rounds
        self.status: dict[str, Any] = {"status": "running", "round": 0, "num_rounds": num_rounds, "error": None,
                                       "started": time.time(), "pid": os.getpid()}
        self.current: dict[str, Any] = {}

    def set_status(self, **kw: Any) -> None:
        """Update and atomically rewrite ``status.json`` (no-op once :data:`FROZEN` is set)."""
        with STATUS_LOCK:
            if FROZEN.is_set():
                return
            self.status.update(kw)
            atomic_write(self.dir / "status.json", json.dumps(self.status, indent=2).encode(), 0o644)

    def note(self, **kw: Any) -> None:
        """Add fields to the record of the round in progress."""
        self.current.update(kw)

    def end_round(self, server_round: int) -> None:
        """Append the round's record to ``rounds.jsonl`` and advance ``status.json``."""
        if FROZEN.is_set():
            return
        rec = {"round": server_round, **self.current}
        with open(self.dir / "rounds.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        self.current = {}
        self.set_status(round=server_round)

    def rounds(self) -> list[dict]:
        """All finished rounds, oldest first. A line that is not a JSON object (e.g. a
        partial last line while the aggregator writes) is skipped."""
        p = self.dir / "rounds.jsonl"
        if not p.exists():
            return []
        out = []
        for line in p.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict) and isinstance(rec.get("round"), int):
                out.append(rec)
        return out


def save_checkpoint(campaign_dir: str | Path, server_round: int, model_ct: bytes, model_weight: float, stats_ct: bytes) -> Path:
    """Atomically write ``checkpoint/global.npz`` (see module docstring). Returns its path."""
    import io

    buf = io.BytesIO()
    np.savez(buf, model_ct=np.frombuffer(model_ct, np.uint8), model_weight=np.array([model_weight], np.float64),
             stats_ct=np.frombuffer(stats_ct, np.uint8), round=np.array([server_round], np.int64))
    path = Path(campaign_dir) / "checkpoint" / "global.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, buf.getvalue(), 0o644)
    return path


def load_checkpoint(campaign_dir: str | Path) -> dict:
    """Read ``checkpoint/global.npz``: ``{"model_ct": bytes, "model_weight": float,
    "stats_ct": bytes, "round": int}``. Raises FileNotFoundError if there is none."""
    with np.load(Path(campaign_dir) / "checkpoint" / "global.npz") as z:
        return {"model_ct": z["model_ct"].tobytes(), "model_weight": float(z["model_weight"][0]),
                "stats_ct": z["stats_ct"].tobytes(), "round": int(z["round"][0])}
