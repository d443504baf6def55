"""A small NumPy re-implementation of the ONNX operators sealfl's released models use.

It is the *second implementation* that the release canary's expected outputs and the
quantisation tests come from: onnxruntime (whose integer kernels differ by CPU) is checked
against it, never against itself. Semantics follow the ONNX operator specification
(https://onnx.ai/onnx/operators/): NumPy broadcasting for the element-wise ops, ``Round``
to nearest with ties to even (``np.rint``), ``MatMulInteger`` as ``(A - a_zp) @ (B - b_zp)``
in exact integer arithmetic, float32 everywhere a float tensor flows. ``Sigmoid`` is
evaluated in float64 and rounded to float32 (onnxruntime uses a polynomial approximation
with ~1e-7 error; the canary's tolerance is set far above that).

Only what sealfl emits is supported (``SUPPORTED_OPS``); any other operator raises
``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sealfl.platform.errors import OnnxReferenceError

__all__ = ["SUPPORTED_OPS", "run_reference"]

_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 6: np.int32, 7: np.int64, 11: np.float64}


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _gemm(ins, at):
    a, b = ins[0], ins[1]
    if at.get("transA", 0):
        a = a.T
    if at.get("transB", 0):
        b = b.T
    y = np.float32(at.get("alpha", 1.0)) * (a.astype(np.float32) @ b.astype(np.float32))
    if len(ins) > 2 and ins[2] is not None:
        y = y + np.float32(at.get("beta", 1.0)) * ins[2]
    return y.astype(np.float32)


def _matmul_integer(ins, at):
    a = ins[0].astype(np.int64) - (ins[2].astype(np.int64) if len(ins) > 2 and ins[2] is not None else 0)
    b = ins[1].astype(np.int64) - (ins[3].astype(np.int64) if len(ins) > 3 and ins[3] is not None else 0)
    acc = a @ b
    if np.any(np.abs(acc) >= 2**31):
        raise OnnxReferenceError("MatMulInteger overflows int32")
    return acc.astype(np.int32)


def _clip(ins, at):
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else -np.inf
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else np.inf
    return np.clip(ins[0], lo, hi).astype(ins[0].dtype)


def _reduce_max(ins, at):
    axes = at.get("axes")
    if axes is None and len(ins) > 1 and ins[1] is not None:
        axes = ins[1].tolist()
    axis = None if axes is None else tuple(int(a) for a in axes)
    return np.max(ins[0], axis=axis, keepdims=bool(at.get("keepdims", 1)))


def _sigmoid(ins, at):
    with np.errstate(over="ignore"):  # exp overflow -> inf -> 0.0, as the limit
        return (1.0 / (1.0 + np.exp(-ins[0].astype(np.float64)))).astype(np.float32)


def _bin(fn):
    def op(ins, at):
        out = fn(ins[0], ins[1])
        return out.astype(np.result_type(ins[0].dtype, ins[1].dtype))
    return op


_OPS = {
    "Add": _bin(np.add), "Sub": _bin(np.subtract), "Mul": _bin(np.multiply), "Div": _bin(np.divide),
    "Max": _bin(np.maximum), "Min": _bin(np.minimum),
    "Abs": lambda ins, at: np.abs(ins[0]),
    "Relu": lambda ins, at: np.maximum(ins[0], 0).astype(ins[0].dtype),
    "Round": lambda ins, at: np.rint(ins[0]),
    "Clip": _clip,
    "Cast": lambda ins, at: ins[0].astype(_DTYPES[at["to"]]),
    "ReduceMax": _reduce_max,
    "MatMul": lambda ins, at: (ins[0] @ ins[1]).astype(np.result_type(ins[0].dtype, ins[1].dtype)),
    "Gemm": _gemm,
    "MatMulInteger": _matmul_integer,
    "Sigmoid": _sigmoid,
    "Identity": lambda ins, at: ins[0],
}
#: Operators :func:`run_reference` implements.
SUPPORTED_OPS = frozenset(_OPS)


def run_reference(model_bytes: bytes, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Evaluate an ONNX model with NumPy.

    Args:
        model_bytes: serialised ONNX model using only :data:`SUPPORTED_OPS`, nodes in
            topological order (as ONNX requires).
        feeds: ``{input name: array}`` (float inputs are used as float32).

    Returns:
        the graph outputs, in graph order.

    Raises:
        ValueError: an unsupported operator, a missing input, or integer overflow.
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load_from_string(model_bytes)
    graph = model.graph
    env: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for inp in graph.input:
        if inp.name in env:
            continue
        if inp.name not in feeds:
            raise OnnxReferenceError(f"missing model input {inp.name!r}")
        arr = np.asarray(feeds[inp.name])
        env[inp.name] = arr.astype(np.float32) if arr.dtype.kind == "f" else arr
    for node in graph.node:
        op = _OPS.get(node.op_type)
        if op is None or node.domain not in ("", "ai.onnx"):
            raise OnnxReferenceError(f"the NumPy reference does not implement operator {node.domain or ''}{node.op_type!r}")
        ins = [env[n] if n else None for n in node.input]
        env[node.output[0]] = np.asarray(op(ins, _attrs(node)))
    return [env[o.name] for o in graph.output]
