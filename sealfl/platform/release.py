"""The release pipeline: decrypt (in the release enclave) -> evaluate -> ONNX -> INT8 ->
accuracy gate -> manifest, DSSE/in-toto signature, release attestation.

Provisioning (at consortium set-up): :func:`provision_release_enclave` creates the
release enclave (``<consortium>/enclave``), seals the HE secret context into it and
exports the device trust anchors (``<consortium>/trust``).

On a Ray cluster (``ray_address``, ``--ray-address``) the ONNX export and the INT8
quantisation run as Ray tasks (:mod:`sealfl.platform.tabular_build`; the LLM's INT4/INT8
variants: :func:`sealfl.platform.llm.build.quantize_variants`) and the gate's evaluations
in the partners' ClientApp actors there; the release is the same bytes either way.

Quantisation: :mod:`sealfl.platform.quantize` (per-row int8 activations, 7-bit weights:
each row's answer is independent of the batch and of the CPU). The release carries a
signed canary (:mod:`sealfl.platform.canary`) that devices check before they accept it;
the build machine checks it first (:func:`~sealfl.platform.canary.self_check`).

Gate: the INT8 model's pooled test accuracy may be at most ``max_drop`` (default 0.01,
one point) below the fp32 model's; otherwise :class:`ReleaseError` and nothing is
written. Accuracies are pooled from per-partner ``{correct, n}`` counts that each
partner computes on its own test split (:mod:`sealfl.platform.fedeval`, a Flower query
round on Ray).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from sealfl.clients.plugins import get_task
from sealfl.common.errors import Interrupted, signal_name
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.enclave.release.keyholder import KeyHolder
from sealfl.he.errors import CiphertextError, DecryptedValueError, ServerOptError
from sealfl.platform import supervisor
from sealfl.platform.campaign_outcome import (
    campaign_dp,
    campaign_privacy,
    campaign_server_opt,
    campaign_test_counts,
    campaign_train_config,
    check_campaign_of,
    finished_checkpoint,
)
from sealfl.platform.canary import self_check
from sealfl.platform.consortium import Consortium
from sealfl.platform.errors import ReleaseError
from sealfl.platform.fedeval import federated_evaluate
from sealfl.platform.provenance import campaign_provenance
from sealfl.platform.quantize import SCHEME
from sealfl.platform.register import check_new_version, mark_issued, read_register, reserve, unreserve
from sealfl.platform.tabular_build import build_tabular_candidates

log = logging.getLogger(__name__)
MODEL_FILE = "model.int8.onnx"


def enclave_dir(cons: Consortium) -> Path:
    return cons.dir / "enclave"


def trust_dir(cons: Consortium) -> Path:
    return cons.dir / "trust"


def provision_release_enclave(cons: Consortium, secret_context: bytes, backend: str = "sim") -> ReleaseEnclave:
    """Create the release enclave on the TEE ``backend`` (``"sim"``, the labelled insecure
    simulation, or ``"tpm"``), seal the HE secret into it, export device trust anchors."""
    enclave = ReleaseEnclave.create(enclave_dir(cons), backend=backend)
    KeyHolder.provision(enclave, secret_context)
    enclave.export_trust(trust_dir(cons))
    return enclave


def open_final_model(keys: KeyHolder, ckpt: dict, task, campaign_dir) -> tuple:
    """Decrypt the final checkpoint inside the release enclave, checked and rounded
    (:meth:`KeyHolder.open_model`, :meth:`KeyHolder.open_stats`), with the campaign's server
    optimizer's last step (:mod:`sealfl.he.server_opt`, named in its server_config.json):
    returns (params, mean, std).

    Raises ReleaseError (nothing is released) if a decrypted value is out of the task's
    bounds, the statistics count differs from the declared total, or a ciphertext is bad.
    """
    declared = ckpt["stats_declared_n"]
    try:
        params = keys.open_model(ckpt["model_ct"], ckpt["model_weight"], task.n_params, task.decrypt_bounds,
                                 declared_total=declared, opt=campaign_server_opt(campaign_dir),
                                 dp=campaign_dp(campaign_dir))
        mean, std = keys.open_stats(ckpt["stats_ct"], task.stats_length, declared, task.decrypt_bounds)
    except ServerOptError as exc:
        raise ReleaseError(f"campaign {campaign_dir}: {exc}; not releasing") from exc
    except CiphertextError as exc:
        raise ReleaseError(f"the release enclave refuses the final aggregate of campaign {campaign_dir}: {exc} "
                           "(its length must fit the server optimizer named in server_config.json: was the "
                           "optimizer changed after the campaign?); not releasing") from exc
    except DecryptedValueError as exc:
        raise ReleaseError(f"the release enclave refuses the final aggregate of campaign {campaign_dir}: {exc}; "
                           "not releasing") from exc
    return params, mean, std


def check_gate(fp32_accuracy: float, int8_accuracy: float, max_drop: float) -> None:
    """The accuracy gate: raise ReleaseError if INT8 accuracy is more than ``max_drop``
    (a fraction; 0.01 = one point) below fp32 accuracy, or either is not finite."""
    if not (math.isfinite(fp32_accuracy) and math.isfinite(int8_accuracy)):
        raise ReleaseError("accuracy is not a finite number; not releasing")
    drop = fp32_accuracy - int8_accuracy
    log.info("release gate: fp32 %.4f, int8 %.4f (drop %.4f, allowed %.4f)", fp32_accuracy, int8_accuracy, drop, max_drop)
    if drop > max_drop + 1e-12:
        raise ReleaseError(
            f"INT8 pooled test accuracy {int8_accuracy:.4f} is {100 * drop:.2f} points below fp32 "
            f"{fp32_accuracy:.4f} (allowed: {100 * max_drop:.2f}); not releasing")


def _holds_files(d: Path) -> bool:
    return d.is_dir() and any(d.iterdir())


@dataclass
class ReleaseResult:
    """Outcome of :func:`release`.

    Attributes:
        summary: what ``ReleaseEnclave.write_release`` returned (name, version, root_digest, files, dir).
        accuracy: ``{"fp32": {...}, "int8": {...}}`` each with ``pooled`` and ``per_partner``.
        sizes: ``{"fp32_onnx_bytes", "int8_onnx_bytes"}``.
        params: the decrypted global model (float64, (14,)).
        seconds: wall time of the pipeline.
        nodes: build step -> the Ray node id it ran on, or ``"local"`` (tabular releases:
            ``export``, ``quantize``; see :mod:`sealfl.platform.tabular_build`).
    """

    summary: dict
    accuracy: dict
    sizes: dict
    params: list
    seconds: float
    nodes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ReleaseJob:
    """What every release builder is given (:data:`BUILDERS`).

    Attributes:
        cons: the consortium.
        task: its task plug-in.
        enclave: the opened release enclave.
        params, mean, std: the decrypted, checked final model (and feature scaling).
        ckpt: the finished checkpoint (:func:`finished_checkpoint`).
        campaign_dir, out_dir: the campaign read and the release directory to write.
        version, name, max_drop: the release's version, name and gate.
        evaluation: keyword arguments for :func:`federated_evaluate` (``ray_address``,
            ``client_app``, ``client_app_kwargs``, ``app_dir``).
        on_stage: called with each stage's name as it starts, or None.
        nodes: filled by the builder: build step -> Ray node id or ``"local"``.
    """

    cons: Consortium
    task: object
    enclave: ReleaseEnclave
    params: object
    mean: object
    std: object
    ckpt: dict
    campaign_dir: Path
    out_dir: Path
    version: int
    name: str
    max_drop: float
    evaluation: dict
    on_stage: object = None
    nodes: dict = field(default_factory=dict)


def release(consortium_dir: str | Path, campaign_dir: str | Path, out_dir: str | Path, *, version: int,
            name: str | None = None, max_drop: float = 0.01, ray_address: str | None = None,
            client_app: str | None = None, client_app_kwargs: dict | None = None,
            app_dir: str | None = None, on_stage=None) -> ReleaseResult:
    """Build, gate, sign and attest a release of the campaign's final global model.

    Raises:
        ConsortiumError: not a consortium directory.
        UnsealError: the release enclave's code changed since provisioning.
        ReleaseError: ``version`` is not newer than every earlier release of the consortium
            (``releases.json``), the campaign did not finish or has no final checkpoint, the
            decrypted aggregate is out of the task's bounds, a partner did not evaluate or
            reported impossible counts, or the INT8 model fails the accuracy gate (nothing is written).
        ReleaseWriteError: ``out_dir`` is not empty (from the enclave).
        Interrupted: SIGINT/SIGTERM (inside :func:`~sealfl.platform.supervisor.interruptible`)
            before the version was reserved: nothing was written or registered.

    Interruption is acted on between steps (decrypt, evaluate, gate, write); the write
    itself -- reserve the version, rename the release directory into place, mark the
    version issued (:mod:`sealfl.platform.register`) -- runs to its end, after which a
    pending signal is raised with the release named as written. The partners' evaluation
    runs in a worker process tree (:mod:`sealfl.platform.supervisor`).
    ``client_app`` / ``client_app_kwargs`` / ``app_dir``: see :func:`federated_evaluate`.

    The consortium's task decides what is built (:mod:`sealfl.clients.plugins`): its
    ``release_kind`` names the builder in :data:`BUILDERS` -- :func:`release_tabular`, or
    :func:`sealfl.platform.llm.pipeline.release_llm` for a causal LM (``accuracy`` then
    holds its report: gate figures, perplexity before/after per partner, sizes, time per
    stage; ``on_stage(name)`` is called as each stage starts) -- and ``name`` defaults to
    the task's ``release_name``.
    """
    if not (0.0 <= max_drop <= 1.0):
        raise ReleaseError(f"max_drop must lie in [0, 1], got {max_drop}")
    t0 = time.perf_counter()
    cons = Consortium.load(consortium_dir)
    check_new_version(read_register(cons.dir), version)
    if _holds_files(Path(out_dir)) or (Path(out_dir).exists() and not Path(out_dir).is_dir()):
        raise ReleaseError(f"{out_dir} exists and is not an empty directory; choose a new output directory")
    ckpt = finished_checkpoint(campaign_dir)
    check_campaign_of(cons, campaign_dir)
    supervisor.check()
    (on_stage or (lambda _name: None))("decrypt the final model in the release enclave")
    enclave = ReleaseEnclave.open(enclave_dir(cons))
    keys = KeyHolder(enclave, cons.he_params, bytes.fromhex(cons.context_id))
    task = get_task(cons.task)
    params, mean, std = open_final_model(keys, ckpt, task, campaign_dir)
    builder = BUILDERS.get(task.release_kind)
    if builder is None:
        raise ReleaseError(f"task {task.name!r} asks for a {task.release_kind!r} release, which no builder makes; "
                           f"known: {sorted(BUILDERS)}")
    job = ReleaseJob(cons, task, enclave, params, mean, std, ckpt, Path(campaign_dir), Path(out_dir), version,
                     name or task.release_name, max_drop,
                     {"ray_address": ray_address, "client_app": client_app, "client_app_kwargs": client_app_kwargs,
                      "app_dir": app_dir}, on_stage)
    summary, accuracy, sizes, released = builder(job)
    return ReleaseResult(summary, accuracy, sizes, released, time.perf_counter() - t0, dict(job.nodes))


def release_tabular(job: ReleaseJob) -> tuple[dict, dict, dict, list]:
    """Build a tabular release: ONNX -> INT8 -> canary -> the partners' gate -> signed and
    attested (the steps and errors of :func:`release`).

    Returns:
        (summary, accuracy, sizes, the released float parameters).
    """
    cons, task, enclave, params, mean, std = job.cons, job.task, job.enclave, job.params, job.mean, job.std
    ckpt, campaign_dir, out_dir, version, name = job.ckpt, job.campaign_dir, job.out_dir, job.version, job.name
    max_drop = job.max_drop
    stage = job.on_stage or (lambda _name: None)
    stage("export ONNX, quantize INT8 and build the canary")
    built = build_tabular_candidates(task.name, params, mean, std, ray_address=job.evaluation.get("ray_address"))
    fp32, int8, canary = built.fp32, built.int8, built.canary
    job.nodes.update(built.nodes)
    self_check(int8, canary)
    try:
        supervisor.check()
        stage("gate: partners score the fp32 and INT8 candidates")
        acc = federated_evaluate(cons, {"fp32": fp32, "int8": int8}, **job.evaluation,
                                 expected_n=campaign_test_counts(campaign_dir))
    except Interrupted as exc:
        raise Interrupted(exc.signum, f"release build stopped by {signal_name(exc.signum)} while the partners "
                                      f"evaluated the candidates; nothing was written and version {version} "
                                      "is still free") from None
    check_gate(acc["fp32"]["pooled"], acc["int8"]["pooled"], max_drop)
    stage("sign, attest and write the release")
    metadata = {
        "model_file": MODEL_FILE,
        "task": task.name,
        "input": {"name": task.input_name, "dtype": "float32", "shape": ["batch", task.n_features],
                  "features": [dict(f) for f in task.input_features]},
        "output": {"name": task.output_name, "dtype": "float32", "shape": ["batch", 1]},
        "quantization": dict(SCHEME),
        "canary": canary,
        "campaign": {"rounds": ckpt["round"], "context_id": cons.context_id, "partners": cons.partners},
        "accuracy": {"fp32_pooled_test": acc["fp32"]["pooled"], "int8_pooled_test": acc["int8"]["pooled"],
                     "max_drop": max_drop},
    }
    provenance = campaign_provenance(
        cons, campaign_dir, ckpt, optimizer=campaign_server_opt(campaign_dir), gate=dict(metadata["accuracy"]),
        export={"format": "onnx", "model_file": MODEL_FILE, "input": metadata["input"], "output": metadata["output"]},
        quantization=dict(SCHEME))
    privacy = campaign_privacy(campaign_dir)
    if privacy is not None:  # the DP guarantee, in the signed metadata and in the provenance
        metadata["privacy"] = privacy
        provenance["privacy"] = privacy
    supervisor.check()
    reserve(cons.dir, version, str(out_dir))  # before the directory exists: no version is issued twice
    try:
        summary = enclave.write_release(out_dir, {MODEL_FILE: int8}, name, version, metadata, provenance)
    except Exception:
        if not _holds_files(Path(out_dir)):  # the rename never happened: the version was not used
            unreserve(cons.dir, version)
        raise
    mark_issued(cons.dir, version, summary["root_digest"], summary["dir"])
    if supervisor.requested():
        raise Interrupted(supervisor.requested(), f"release v{version} was completed in {out_dir} before stopping "
                                                  "(the signal arrived while it was being written)")
    return summary, acc, {"fp32_onnx_bytes": len(fp32), "int8_onnx_bytes": len(int8)}, params.tolist()


def _release_causal_lm(job: ReleaseJob) -> tuple[dict, dict, dict, list]:
    from sealfl.platform.llm.pipeline import release_llm

    summary, report = release_llm(job.cons, job.task, job.enclave, job.params, job.ckpt, job.campaign_dir,
                                  job.out_dir, version=job.version, name=job.name, **job.evaluation,
                                  expected_n=campaign_test_counts(job.campaign_dir),
                                  train_config=campaign_train_config(job.campaign_dir), on_stage=job.on_stage)
    return summary, report, report["sizes"], []


#: release_kind of a task plug-in -> the builder of its release
BUILDERS = {"tabular": release_tabular, "causal-lm": _release_causal_lm}
