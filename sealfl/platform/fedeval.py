"""Federated evaluation of candidate release models (the release gate's accuracy source).

Runs :mod:`sealfl.server.eval_app` with the partner ClientApp on Ray, in a worker
process tree (:func:`sealfl.platform.supervisor.run_worker`): every partner scores every
candidate on its own test split and replies counts; pooled accuracy is
``Σ correct / Σ n``. Every partner must answer with counts that pass the checks of
:func:`sealfl.server.validation.check_candidate_counts` (integers, ``0 <= correct <= n``,
one ``n`` for every candidate, equal to the ``n`` that partner reported during the
campaign when given): a gate that silently skipped a hospital, or pooled a partner's
``correct = 900 of n = 60``, would release on numbers that are not the test set's.
The result file the eval app writes is checked again here (it is a file: hostile until
checked), so pooled accuracies always lie in [0, 1].
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from sealfl.common.errors import Interrupted
from sealfl.platform.consortium import Consortium
from sealfl.platform.errors import ReleaseError
from sealfl.platform.partner_keys import partner_public_keys
from sealfl.platform.simulate import plan_ray, ray_environment
from sealfl.platform.supervisor import run_worker
from sealfl.server.errors import ReplyError
from sealfl.server.validation import ReplyLimits, check_candidate_counts

#: largest result file read back (a few hundred bytes per partner and candidate)
MAX_RESULT_BYTES = 1 << 20


def pool_counts(per_partner: Mapping, partners: list[str], candidates: list[str], *, limits: ReplyLimits,
                expected_n: Mapping[str, int] | None = None, sums: Sequence[str] = ()) -> dict[str, dict]:
    """Check every partner's counts and pool them per candidate.

    Args:
        per_partner: ``{partner: {candidate: {"correct", "n"}}}`` (parsed JSON).
        partners: every partner that must be present; candidates: candidate names.
        limits: caps on counts; expected_n: partner -> test rows from the campaign.
        sums: float sums reported per candidate (pooled by addition, like the counts).
    Returns:
        ``{candidate: {"pooled", "correct", "n", <sum>..., "per_partner": {p: {"correct", "n",
        "accuracy", <sum>...}}}}``.
    Raises:
        ReleaseError: a partner is missing or its counts fail a check (names both).
    """
    if not isinstance(per_partner, Mapping):
        raise ReleaseError("federated evaluation result is not a mapping of partners; not releasing")
    result: dict[str, dict] = {c: {"per_partner": {}} for c in candidates}
    for p in partners:
        raw = per_partner.get(p)
        if not isinstance(raw, Mapping):
            raise ReleaseError(f"partner {p!r} did not report counts for the candidates; not releasing")
        flat = {f"{c}.{k}": v for c, d in raw.items() if isinstance(d, Mapping) for k, v in d.items()}
        try:
            counts = check_candidate_counts(flat, candidates, limits=limits, sums=sums,
                                            expected_n=(expected_n or {}).get(p), where=f"partner {p!r} counts")
        except ReplyError as exc:
            raise ReleaseError(f"refusing the counts of partner {p!r}: {exc}; not releasing") from exc
        for c in candidates:
            v = counts[c]
            result[c]["per_partner"][p] = {**v, "accuracy": v["correct"] / v["n"]}
    for c in candidates:
        per = result[c]["per_partner"]
        correct, n = sum(v["correct"] for v in per.values()), sum(v["n"] for v in per.values())
        result[c].update(pooled=correct / n, correct=correct, n=n,
                         **{k: sum(v[k] for v in per.values()) for k in sums})
    return result


def federated_evaluate(cons: Consortium, candidates: dict[str, bytes], *, ray_address: str | None = None,
                       client_app: str | None = None, client_app_kwargs: dict | None = None,
                       app_dir: str | None = None, expected_n: Mapping[str, int] | None = None,
                       limits: ReplyLimits | None = None, reference_names: Sequence[str] = (),
                       sums: Sequence[str] = (), global_arrays: Mapping | None = None,
                       config: Mapping | None = None) -> dict[str, dict]:
    """Score ``candidates`` (name -> ONNX bytes) at every partner.

    ``client_app`` / ``client_app_kwargs`` / ``app_dir``: as for
    :func:`sealfl.platform.campaign.run_campaign` (default: the partner app).

    Returns ``{candidate: {"pooled": float, "correct": int, "n": int,
    "per_partner": {partner: {"correct", "n", "accuracy"}}}}``.

    Raises:
        ReleaseError: the run failed, a partner did not report, or a partner's counts fail
            a check (the message names the partner and the reason; a failed run keeps the
            worker's log path).
        SimulationError: the Ray cluster given cannot be reached.
        Interrupted: SIGINT/SIGTERM; the worker tree is gone, nothing was written.
    """
    limits = limits or ReplyLimits()
    plan = plan_ray(ray_address)
    d = Path(tempfile.mkdtemp(prefix="sealfl-fedeval-"))
    keep = False
    try:
        paths = {}
        for i, (name, blob) in enumerate(candidates.items()):
            paths[name] = str(d / f"candidate-{i}.onnx")
            Path(paths[name]).write_bytes(blob)
        out = d / "result.json"
        gpath = None
        if global_arrays:
            import numpy as np

            gpath = str(d / "global.npz")
            np.savez(gpath, **{k: np.asarray(v) for k, v in global_arrays.items()})
        job = {"kind": "fedeval", "candidates": paths, "out": str(out), "consortium_dir": str(cons.dir.resolve()),
               "num_supernodes": len(cons.partners), "client_app": client_app,
               "client_app_kwargs": client_app_kwargs or {}, "app_dir": app_dir, "ray": plan,
               "eval": {"partners": list(cons.partners), "partner_keys": partner_public_keys(cons),
                        "context_id": cons.context_id,
                        "limits": {"max_examples": limits.max_examples, "max_loss": limits.max_loss},
                        "expected_n": dict(expected_n) if expected_n else None,
                        "reference_names": list(reference_names), "sums": list(sums), "global": gpath,
                        "config": dict(config or {})}}
        log_path = d / "worker.log"
        result = run_worker(job, env=ray_environment(plan, dict(os.environ)), log_path=log_path, app_dir=app_dir)
        if not result.get("ok") or not out.exists():
            raise ReleaseError(f"federated evaluation of the release candidates failed: {result.get('error')} "
                               f"(log: {log_path})")
        raw = out.read_bytes()
    except Interrupted:
        raise
    except BaseException:
        keep = True  # the worker's log explains the failure
        raise
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)
    if len(raw) > MAX_RESULT_BYTES:
        raise ReleaseError(f"federated evaluation result is {len(raw)} bytes (cap {MAX_RESULT_BYTES}); not releasing")
    try:
        res = json.loads(raw)
        per, failed = res["per_partner"], res.get("failed", {})
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ReleaseError(f"federated evaluation result is unreadable ({exc}); not releasing") from exc
    missing = [p for p in cons.partners if p not in per]
    if missing:
        raise ReleaseError(f"partners {missing} did not evaluate the candidates ({failed}); not releasing")
    return pool_counts(per, list(cons.partners), sorted(set(candidates) | set(reference_names)), limits=limits,
                       expected_n=expected_n, sums=sums)
