"""Federated evaluation of candidate release models (the release gate's accuracy source).

Runs :mod:`sealfl.server.eval_app` with the partner ClientApp on Ray, in a worker
process tree (:func:`sealfl.platform.supervisor.run_worker`): every partner scores every
candidate on its own test split and replies counts; pooled accuracy is
``Σ correct / Σ n``. Every partner must answer: a gate that silently skipped a hospital
would release on a different test set than the one reported.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .consortium import Consortium
from .errors import Interrupted, ReleaseError
from .simulate import plan_ray, ray_environment
from .supervisor import run_worker


def federated_evaluate(cons: Consortium, candidates: dict[str, bytes], *, ray_address: str | None = None,
                       client_app: str | None = None, client_app_kwargs: dict | None = None,
                       app_dir: str | None = None) -> dict[str, dict]:
    """Score ``candidates`` (name -> ONNX bytes) at every partner.

    ``client_app`` / ``client_app_kwargs`` / ``app_dir``: as for
    :func:`sealfl.platform.campaign.run_campaign` (default: the partner app).

    Returns ``{candidate: {"pooled": float, "correct": int, "n": int,
    "per_partner": {partner: {"correct", "n", "accuracy"}}}}``.

    Raises:
        ReleaseError: the run failed or a partner did not report (the message keeps the
            worker's log path).
        SimulationError: the Ray cluster given cannot be reached.
        Interrupted: SIGINT/SIGTERM; the worker tree is gone, nothing was written.
    """
    plan = plan_ray(ray_address)
    d = Path(tempfile.mkdtemp(prefix="sealfl-fedeval-"))
    keep = False
    try:
        paths = {}
        for i, (name, blob) in enumerate(candidates.items()):
            paths[name] = str(d / f"candidate-{i}.onnx")
            Path(paths[name]).write_bytes(blob)
        out = d / "result.json"
        job = {"kind": "fedeval", "candidates": paths, "out": str(out), "consortium_dir": str(cons.dir.resolve()),
               "num_supernodes": len(cons.partners), "client_app": client_app,
               "client_app_kwargs": client_app_kwargs or {}, "app_dir": app_dir, "ray": plan}
        log_path = d / "worker.log"
        result = run_worker(job, env=ray_environment(plan, dict(os.environ)), log_path=log_path, app_dir=app_dir)
        if not result.get("ok") or not out.exists():
            raise ReleaseError(f"federated evaluation of the release candidates failed: {result.get('error')} "
                               f"(log: {log_path})")
        res = json.loads(out.read_text())
    except Interrupted:
        raise
    except BaseException:
        keep = True  # the worker's log explains the failure
        raise
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)
    missing = [p for p in cons.partners if p not in res["per_partner"]]
    if missing:
        raise ReleaseError(f"partners {missing} did not evaluate the candidates ({res['failed']}); not releasing")
    result = {}
    for cand in candidates:
        per = {p: dict(res["per_partner"][p][cand]) for p in cons.partners}
        for v in per.values():
            v["accuracy"] = v["correct"] / max(v["n"], 1)
        correct, n = sum(v["correct"] for v in per.values()), sum(v["n"] for v in per.values())
        result[cand] = {"pooled": correct / max(n, 1), "correct": correct, "n": n, "per_partner": per}
    return result
