"""A tabular release's candidates, as Ray tasks when the release is given a cluster.

Two steps, each a pure function of its inputs (so the bytes are the same wherever they run):

1. **export**: the task plug-in's ``to_onnx(params, mean, std)`` -> float32 ONNX bytes;
2. **quantise**: :func:`sealfl.platform.quantize.quantize_int8` of those bytes, and the
   release canary on :func:`sealfl.platform.canary.canary_rows` (NumPy reference outputs).

On the Ray cluster this process is connected to (``ray.is_initialized()``, or
``ray_address`` given: see :func:`sealfl.platform.simulate.attached_ray`) each step is one
task (1 CPU, ``SPREAD`` over the nodes, retried twice if its node dies; the export's
result goes to the quantise task through the object store without coming back here);
otherwise both run in this process. The gate's evaluations are the partners' (a Flower
query round whose ClientApps are Ray actors on the same cluster:
:func:`sealfl.platform.fedeval.federated_evaluate`); the build machine's own canary check
(:func:`sealfl.platform.canary.self_check`) stays in this process, as a device runs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from sealfl.platform.errors import QuantizeError, ReleaseError

__all__ = ["TabularCandidates", "build_tabular_candidates"]

log = logging.getLogger(__name__)
LOCAL = "local"


@dataclass(frozen=True)
class TabularCandidates:
    """The candidates of one tabular release.

    Attributes:
        fp32: float32 ONNX bytes (the gate's reference).
        int8: the INT8 ONNX bytes that are released.
        canary: the canary metadata object of ``int8``.
        nodes: ``{"export", "quantize"}`` -> Ray node id the step ran on, or ``"local"``.
    """

    fp32: bytes
    int8: bytes
    canary: dict
    nodes: dict


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else LOCAL


def _export(task_name: str, params, mean, std) -> tuple[bytes, str]:
    from sealfl.clients.plugins import get_task

    return get_task(task_name).to_onnx(np.asarray(params), np.asarray(mean), np.asarray(std)), _node()


def _quantize(fp32: bytes, task_name: str, mean, std) -> tuple[bytes, dict, str]:
    from sealfl.clients.plugins import get_task
    from sealfl.platform.canary import build_canary, canary_rows
    from sealfl.platform.quantize import quantize_int8

    task = get_task(task_name)
    try:
        int8 = quantize_int8(fp32)
        canary = build_canary(int8, task.input_name, task.output_name, canary_rows(task.input_features, mean, std))
    except ValueError as exc:  # QuantizeError, OnnxReferenceError are ValueErrors
        raise QuantizeError(f"cannot quantise the model: {exc}") from exc
    return int8, canary, _node()


def _on_ray(task_name: str, params, mean, std) -> TabularCandidates:
    import ray

    opts = {"num_cpus": 1, "scheduling_strategy": "SPREAD", "max_retries": 2}
    exported = ray.remote(_export).options(num_returns=2, **opts).remote(task_name, params, mean, std)
    quantized = ray.remote(_quantize).options(num_returns=3, **opts).remote(exported[0], task_name, mean, std)
    try:
        fp32, export_node = ray.get(exported)
        int8, canary, quantize_node = ray.get(quantized)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.as_instanceof_cause()
        if isinstance(cause, ReleaseError):
            raise cause from exc
        raise ReleaseError(f"a release build task failed on the Ray cluster: {exc}") from exc
    nodes = {"export": export_node, "quantize": quantize_node}
    log.info("release candidates built on Ray nodes %s", nodes)
    return TabularCandidates(fp32, int8, canary, nodes)


def build_tabular_candidates(task_name: str, params, mean, std, *, ray_address: str | None = None
                             ) -> TabularCandidates:
    """Export and quantise a tabular task's decrypted model (module docstring).

    Args:
        task_name: the consortium's task plug-in (:func:`sealfl.clients.plugins.get_task`).
        params, mean, std: the final model and feature scaling (float arrays of the
            task's shapes, e.g. heart: (14,), (13,), (13,)).
        ray_address: a Ray cluster to run the steps on (``None``/``"local"``: this process,
            unless it is already connected to one).

    Raises:
        QuantizeError: the exported graph cannot be quantised or its canary built.
        ReleaseError: a task failed on the cluster for another reason.
        SimulationError: ``ray_address`` cannot be reached.
    """
    if ray_address and ray_address != "local":
        from sealfl.platform.simulate import attached_ray

        with attached_ray(ray_address):
            return _on_ray(task_name, params, mean, std)
    import ray

    if ray.is_initialized():
        return _on_ray(task_name, params, mean, std)
    fp32, _ = _export(task_name, params, mean, std)
    int8, canary, _ = _quantize(fp32, task_name, mean, std)
    return TabularCandidates(fp32, int8, canary, {"export": LOCAL, "quantize": LOCAL})
