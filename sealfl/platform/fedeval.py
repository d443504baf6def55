"""Federated evaluation of candidate release models (the release gate's accuracy source).

Runs :mod:`sealfl.server.eval_app` with the partner ClientApp on Ray: every partner
scores every candidate on its own test split and replies counts; pooled accuracy is
``Σ correct / Σ n``. Every partner must answer: a gate that silently skipped a hospital
would release on a different test set than the one reported.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from sealfl.server.eval_app import make_eval_server_app

from .consortium import Consortium
from .errors import ReleaseError
from .simulate import run_on_ray


def federated_evaluate(cons: Consortium, candidates: dict[str, bytes], *, ray_address: str | None = None,
                       client_app=None) -> dict[str, dict]:
    """Score ``candidates`` (name -> ONNX bytes) at every partner.

    Returns ``{candidate: {"pooled": float, "correct": int, "n": int,
    "per_partner": {partner: {"correct", "n", "accuracy"}}}}``.
    Raises ReleaseError if the run failed or any partner did not report.
    """
    from sealfl.clients.app import make_client_app

    with tempfile.TemporaryDirectory(prefix="sealfl-fedeval-") as d:
        out = Path(d) / "result.json"
        _, failure = run_on_ray(make_eval_server_app(candidates, len(cons.partners), out),
                                client_app or make_client_app(str(cons.dir.resolve())), len(cons.partners),
                                ray_address=ray_address)
        if failure is not None or not out.exists():
            raise ReleaseError(f"federated evaluation of the release candidates failed: {failure}") from failure
        res = json.loads(out.read_text())
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
