"""``sealfl release build`` for a causal-LM campaign.

1. the release enclave opens the campaign's final checkpoint (key holder: decrypt, check
   against the task's bounds, round; :func:`sealfl.platform.release.open_final_model`);
2. merges the global adapters into the pinned base model, exports ONNX with a KV cache
   and quantises INT4 and INT8 (:func:`.release.build_candidates`);
3. the partners score the candidates on their own held-out text in a Flower query round
   (:func:`sealfl.platform.fedeval.federated_evaluate`): each receives the candidates and
   the *encrypted* final checkpoint, decrypts it as a key holder, merges the fp32
   reference itself and replies counts and NLL sums only (names ``fp32``, ``base``,
   ``int4``, ``int8``; :meth:`sealfl.clients.causal_lm.task.CausalLMTask.score_candidates`);
4. the gate (:func:`.gate.check_gate`), the canaries, and the signed, attested release,
   registered like every release (:mod:`sealfl.platform.register`).

The pooled ``base`` and ``fp32`` perplexities on the same held-out positions are the
campaign's perplexity before and after fine-tuning; they go into the release metadata.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np

from sealfl.common import protocol as P
from sealfl.common.errors import Interrupted, signal_name
from sealfl.platform import supervisor
from sealfl.platform.fedeval import federated_evaluate
from sealfl.platform.llm.build import build_candidates, llm_release_files
from sealfl.platform.llm.gate import THRESHOLDS, GateCounts
from sealfl.platform.provenance import campaign_provenance
from sealfl.platform.register import mark_issued, reserve, unreserve

__all__ = ["release_llm", "global_arrays"]

log = logging.getLogger(__name__)


def global_arrays(ckpt: dict) -> dict[str, np.ndarray]:
    """The final checkpoint as the arrays of a ``global`` record (ciphertexts stay encrypted)."""
    return {P.MODEL_CT: P.to_u8(ckpt["model_ct"]),
            P.MODEL_WEIGHT: np.array([ckpt["model_weight"]], dtype=np.float64),
            P.STATS_CT: P.to_u8(ckpt["stats_ct"]),
            P.STATS_N: np.array([ckpt["stats_declared_n"]], dtype=np.int64)}


def _ppl(nll: float, n: int) -> float:
    return math.exp(nll / n) if n else float("nan")


def release_llm(cons, task, enclave, params, ckpt: dict, campaign_dir, out_dir, *, version: int, name: str,
                ray_address=None, client_app=None, client_app_kwargs=None, app_dir=None, expected_n=None,
                train_config: dict | None = None, on_stage=None):
    """Steps 2-4 of the module docstring (step 1 is the caller's). Returns
    ``(summary, report)`` where report holds ``gate``, ``perplexity``, ``per_partner``,
    ``sizes`` and ``seconds`` per stage.

    Raises:
        ReleaseError: export/quantisation, the partners' scoring or the gate failed (nothing
            is written); ReleaseWriteError from the enclave.
        Interrupted: SIGINT/SIGTERM before the version was reserved.
    """
    stage = on_stage or (lambda *_: None)
    seconds = {}
    t0 = time.perf_counter()
    stage("merge + export + quantise")
    bundle = task.bundle().clone()
    build = build_candidates(bundle, task.spec, params, ray_address=ray_address)
    seconds.update({f"release.{k}": v for k, v in build.seconds.items()})
    supervisor.check()
    stage("partners score the candidates")
    t1 = time.perf_counter()
    try:
        pooled = federated_evaluate(cons, build.variants, ray_address=ray_address, client_app=client_app,
                                    client_app_kwargs=client_app_kwargs, app_dir=app_dir, expected_n=expected_n,
                                    reference_names=task.reference_candidates, sums=task.candidate_sums,
                                    global_arrays=global_arrays(ckpt), config=train_config)
    except Interrupted as exc:
        raise Interrupted(exc.signum, f"release build stopped by {signal_name(exc.signum)} while the partners "
                                      f"scored the candidates; nothing was written and version {version} "
                                      "is still free") from None
    seconds["release.gate_scoring"] = time.perf_counter() - t1
    ref = pooled["fp32"]
    counts = {v: GateCounts(pooled[v]["n"], pooled[v]["correct"], ref["nll"], pooled[v]["nll"])
              for v in build.variants}
    per_partner = {p: {"perplexity_before": _ppl(pooled["base"]["per_partner"][p]["nll"],
                                                 pooled["base"]["per_partner"][p]["n"]),
                       "perplexity_after": _ppl(ref["per_partner"][p]["nll"], ref["per_partner"][p]["n"]),
                       "positions": ref["per_partner"][p]["n"]}
                   for p in cons.partners}
    for v in per_partner.values():
        v["ratio"] = v["perplexity_after"] / v["perplexity_before"]
    perplexity = {"before": float(np.mean([v["perplexity_before"] for v in per_partner.values()])),
                  "after": float(np.mean([v["perplexity_after"] for v in per_partner.values()])),
                  "pooled_before": _ppl(pooled["base"]["nll"], pooled["base"]["n"]),
                  "pooled_after": _ppl(ref["nll"], ref["n"])}
    stage("gate + canary + sign")
    t1 = time.perf_counter()
    extra = {"campaign": {"rounds": ckpt["round"], "context_id": cons.context_id, "partners": cons.partners},
             "perplexity": {**perplexity, "per_partner": per_partner}}
    payload, metadata = llm_release_files(build, bundle, task.spec, counts, extra, THRESHOLDS)
    from sealfl.platform.campaign_outcome import campaign_server_opt

    provenance = campaign_provenance(
        cons, campaign_dir, ckpt, optimizer=campaign_server_opt(campaign_dir),
        gate={v: metadata["variants"][v]["gate"] for v in build.variants},
        export={"format": "onnx", "variants": sorted(build.variants)},
        quantization={v: metadata["variants"][v].get("quantization", {}) for v in build.variants})
    supervisor.check()
    reserve(cons.dir, version, str(out_dir))
    try:
        summary = enclave.write_release(out_dir, payload, name, version, metadata, provenance)
    except Exception:
        if not (Path(out_dir).is_dir() and any(Path(out_dir).iterdir())):
            unreserve(cons.dir, version)
        raise
    mark_issued(cons.dir, version, summary["root_digest"], summary["dir"])
    seconds["release.sign"] = time.perf_counter() - t1
    seconds["release.total"] = time.perf_counter() - t0
    report = {"gate": {v: metadata["variants"][v]["gate"] for v in build.variants},
              "perplexity": perplexity, "per_partner": per_partner,
              "sizes": {f"{v}_bytes": len(b) for v, b in build.variants.items()} |
              {"release_bytes": sum(len(b) for b in payload.values())},
              "seconds": seconds}
    if supervisor.requested():
        raise Interrupted(supervisor.requested(), f"release v{version} was completed in {out_dir} before stopping "
                                                  "(the signal arrived while it was being written)")
    return summary, report
