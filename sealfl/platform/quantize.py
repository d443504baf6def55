"""INT8 post-training quantisation whose answers depend neither on the CPU nor on the batch.

Scheme (``SCHEME``): every ``Gemm``/``MatMul`` whose weight ``B`` is a constant 2-D float
initializer becomes

* **weights**: symmetric per output column, 7-bit range ``[-63, 63]``
  (``W_q = round(W / s_w)``, ``s_w = max|W[:, j]| / 63``), stored as int8;
* **activations**: symmetric per row (the last axis of ``A``), computed in the graph at run
  time: ``s_a = max|A[i, :]| / 127``, ``A_q = clip(round(A / s_a), -127, 127) + 128`` as
  uint8 with zero point 128;
* ``MatMulInteger(A_q, W_q, 128)`` in int32 (exact), then ``Cast`` to float,
  ``* s_a * s_w`` and ``+ bias`` in float32.

Why this scheme (measured on this project's heart model, 250 pooled test rows, on an AMD
AVX2-only CPU -- see the closing note of the hardening issue and ``tests/test_quantize.py``):

======================================  ========  =====================  ==============
scheme                                  accuracy  max |p_batch - p_row|  max |p - fp32|
======================================  ========  =====================  ==============
fp32                                    0.812     0                      0
``quantize_dynamic`` QInt8 (before)     0.768     0.54                   0.57
``quantize_dynamic`` QInt8 reduce_range 0.812     0.016                  0.021
weight-only int8 (DequantizeLinear)     0.812     1.2e-7                 0.004
per-row int8, 8-bit weights             0.808     0                      0.34
**per-row int8, 7-bit weights (this)**  0.812     0                      0.007
======================================  ========  =====================  ==============

* ``quantize_dynamic`` takes ONE activation scale for the whole batch (its
  ``DynamicQuantizeLinear`` is per tensor), so one patient's outlier row changes another
  patient's answer (0.77 -> 0.47 for the issue's example). Per-row scales make each row's
  answer a function of that row alone: row-wise == batch-wise exactly.
* On x86 without VNNI, onnxruntime's U8S8 integer GEMM multiplies with ``vpmaddubsw``,
  which adds two u8*s8 products into a *saturating* int16: 255*127*2 = 64770 overflows,
  255*63*2 = 32130 does not (onnxruntime docs, "Quantize ONNX models": use reduce_range /
  7-bit weights on non-VNNI machines). With 7-bit weights no kernel on any CPU (AVX2,
  AVX-512 VNNI, AVX-VNNI, ARM dot-product, which accumulate in int32) can saturate, so the
  integer part is exact everywhere and only float32 rounding of the final scaling differs.
  The 8-bit-weight row above shows the saturation on the AVX2 machine (0.34 error).
* Weight-only int8 is equally row-independent but computes in float; this scheme keeps the
  matrix product in integers, which is what INT8 buys on edge CPUs.

The arithmetic is re-implemented in NumPy by :mod:`sealfl.platform.onnx_ref` (the release's
canary and the tests compare onnxruntime against it). No calibration data is needed, so no
partner data reaches the coordinator.
"""

from __future__ import annotations

import logging

import numpy as np

from sealfl.platform.errors import QuantizeError

__all__ = ["SCHEME", "ACT_QMAX", "WEIGHT_QMAX", "ACT_ZERO_POINT", "quantize_int8", "quantize_weights"]

log = logging.getLogger(__name__)

#: Activations: symmetric int8 per row, carried as uint8 with this zero point.
ACT_QMAX = 127
ACT_ZERO_POINT = 128
#: Weights: symmetric per output column, 7-bit range (no int16 saturation on AVX2; see above).
WEIGHT_QMAX = 63
#: Description written into the signed release metadata.
SCHEME = {
    "name": "sealfl.int8-per-row/v1",
    "weights": f"int8 symmetric per output column, range [-{WEIGHT_QMAX}, {WEIGHT_QMAX}]",
    "activations": f"int8 symmetric per row (dynamic, in-graph), range [-{ACT_QMAX}, {ACT_QMAX}], "
                   f"uint8 zero point {ACT_ZERO_POINT}",
    "accumulate": "int32 (MatMulInteger), then float32 scale and bias",
}
_TINY = np.float32(1e-30)  # an all-zero row gets scale 1e-30/127, so A_q = 128 (zero) exactly


def quantize_weights(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-column 7-bit quantisation of a weight matrix.

    Args:
        w: float (K, M) weights (K inputs, M outputs).

    Returns:
        ``(w_q, s_w)``: int8 (K, M) with values in [-63, 63] and float32 (1, M) scales,
        ``w ~= w_q * s_w``. A column of zeros gets scale 1e-30/63 and zeros.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise QuantizeError(f"weights must be 2-D (K, M), got shape {w.shape}")
    s = np.maximum(np.abs(w).max(axis=0, keepdims=True), _TINY) / np.float32(WEIGHT_QMAX)
    q = np.clip(np.rint(w / s), -WEIGHT_QMAX, WEIGHT_QMAX).astype(np.int8)
    return q, s.astype(np.float32)


def _const(numpy_helper, name: str, value) -> object:
    return numpy_helper.from_array(np.asarray(value), name)


def _quantized_nodes(helper, numpy_helper, TensorProto, prefix: str, a: str, out: str, w: np.ndarray,
                     scale: float, bias: np.ndarray | None) -> tuple[list, list]:
    """Nodes and initializers computing ``out = scale * (a @ w) + bias`` per the module scheme."""
    w_q, s_w = quantize_weights(w)

    def t(s: str) -> str:
        return f"{prefix}/q8/{s}"

    inits = [
        _const(numpy_helper, t("w_q"), w_q),
        _const(numpy_helper, t("s_w"), (s_w * np.float32(scale)).astype(np.float32)),
        _const(numpy_helper, t("qmax"), np.float32(ACT_QMAX)),
        _const(numpy_helper, t("tiny"), _TINY),
        _const(numpy_helper, t("lo"), np.float32(-ACT_QMAX)),
        _const(numpy_helper, t("hi"), np.float32(ACT_QMAX)),
        _const(numpy_helper, t("offset"), np.float32(ACT_ZERO_POINT)),
        _const(numpy_helper, t("zero_point"), np.uint8(ACT_ZERO_POINT)),
    ]
    nodes = [
        helper.make_node("Abs", [a], [t("abs")], name=t("Abs")),
        helper.make_node("ReduceMax", [t("abs")], [t("amax")], axes=[-1], keepdims=1, name=t("ReduceMax")),
        helper.make_node("Max", [t("amax"), t("tiny")], [t("amax_safe")], name=t("Max")),
        helper.make_node("Div", [t("amax_safe"), t("qmax")], [t("s_a")], name=t("ScaleA")),
        helper.make_node("Div", [a, t("s_a")], [t("a_scaled")], name=t("DivA")),
        helper.make_node("Round", [t("a_scaled")], [t("a_round")], name=t("Round")),
        helper.make_node("Clip", [t("a_round"), t("lo"), t("hi")], [t("a_clip")], name=t("Clip")),
        helper.make_node("Add", [t("a_clip"), t("offset")], [t("a_shift")], name=t("Shift")),
        helper.make_node("Cast", [t("a_shift")], [t("a_q")], to=TensorProto.UINT8, name=t("CastU8")),
        helper.make_node("MatMulInteger", [t("a_q"), t("w_q"), t("zero_point")], [t("acc")], name=t("MatMulInteger")),
        helper.make_node("Cast", [t("acc")], [t("acc_f")], to=TensorProto.FLOAT, name=t("CastF")),
        helper.make_node("Mul", [t("acc_f"), t("s_a")], [t("y_a")], name=t("MulA")),
    ]
    if bias is None:
        nodes.append(helper.make_node("Mul", [t("y_a"), t("s_w")], [out], name=t("MulW")))
    else:
        inits.append(_const(numpy_helper, t("bias"), np.asarray(bias, dtype=np.float32)))
        nodes += [helper.make_node("Mul", [t("y_a"), t("s_w")], [t("y")], name=t("MulW")),
                  helper.make_node("Add", [t("y"), t("bias")], [out], name=t("AddBias"))]
    return nodes, inits


def quantize_int8(model_bytes: bytes) -> bytes:
    """Return the INT8 version (module scheme) of a float32 ONNX model.

    Every ``Gemm`` (``transA=0``) and ``MatMul`` whose second input is a constant 2-D float
    initializer is replaced; other nodes are kept.

    Args:
        model_bytes: a serialised float32 ONNX model (``ModelProto`` bytes).

    Returns:
        the serialised INT8 model (passes ``onnx.checker``).

    Raises:
        ValueError: the bytes are not an ONNX model, or it has no quantisable node.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    try:
        model = onnx.load_from_string(model_bytes)
    except Exception as exc:  # protobuf raises DecodeError and others
        raise QuantizeError(f"INT8 quantisation: not an ONNX model: {exc}") from exc
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    nodes, added, replaced = [], [], 0
    for i, node in enumerate(graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = inits.get(node.input[1]) if len(node.input) > 1 else None
        if node.op_type not in ("Gemm", "MatMul") or weight is None or len(weight.dims) != 2 \
                or weight.data_type != TensorProto.FLOAT or attrs.get("transA", 0):
            nodes.append(node)
            continue
        w = numpy_helper.to_array(weight).astype(np.float32)
        bias, scale = None, 1.0
        if node.op_type == "Gemm":
            if attrs.get("transB", 0):
                w = w.T
            scale = float(attrs.get("alpha", 1.0))
            if len(node.input) > 2 and node.input[2]:
                if node.input[2] not in inits:
                    nodes.append(node)  # a computed bias: keep the float node
                    continue
                bias = numpy_helper.to_array(inits[node.input[2]]).astype(np.float32) * np.float32(attrs.get("beta", 1.0))
        new_nodes, new_inits = _quantized_nodes(helper, numpy_helper, TensorProto, node.name or f"node{i}",
                                                node.input[0], node.output[0], w, scale, bias)
        nodes += new_nodes
        added += new_inits
        replaced += 1
    if not replaced:
        raise QuantizeError("INT8 quantisation: the model has no Gemm/MatMul with a constant 2-D float weight")
    used = {name for n in nodes for name in n.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + added)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise QuantizeError(f"INT8 quantisation produced an invalid model: {exc}") from exc
    log.info("INT8: replaced %d Gemm/MatMul node(s) with per-row int8 MatMulInteger", replaced)
    return model.SerializeToString()
