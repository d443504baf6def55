"""INT4 and INT8 quantisation of an exported causal LM (onnxruntime ``MatMulNBits``).

Schemes (``SCHEMES``; block size 32 along the input dimension K of every weight, the
layout of llama.cpp's ggml blocks, ggml-quants.c):

* ``int4`` -- every linear layer of the decoder in **Q4_1 form**: per block of 32 weights
  ``w = d * q + m`` with ``q`` in 0..15, float ``d = (max - min) / 15`` and float ``m = min``.
  onnxruntime's fast 4-bit kernels take integer zero points only, so the block minimum is
  carried by a second term, **centred** (``sealfl.llm-q4_1/v2``)::

      w = d * (q - 8) + (m + 8 d)
      y = MatMulNBits(x; q, scale=d)  +  (x @ S) @ M'     (no zero-point input: 8, the default)
      S (K, K/32): 0/1, sums x over each block of 32;  M'[b, n] = m + 8 d of block b, column n

  which is exactly ``x @ W`` for ``W = d*q + m``. Why centred: the integer kernel quantises
  ``x`` to int8 per block (``accuracy_level`` 4, below); that error is multiplied by the
  weights the kernel sees, ``q - 8`` in -8..7 instead of ``q`` in 0..15, and the constant
  part goes through the float block sums, which are exact -- measured on the base model
  (issue 24): top-1 agreement with fp32 0.963 centred against 0.935 with ``q`` and ``m``
  (v1, zero point 0). It also drops the zero-point tensor (the symmetric kernel path).
  The base model is a Q4_1 GGUF, so for every layer the adapters did not change this
  quantisation reproduces the base weights (up to float32 rounding of ``d`` and
  ``m + 8 d``): it loses nothing the base had not already lost. The tied ``lm_head`` and
  the token embedding (``Q8_0`` in the GGUF) are quantised too, 8-bit symmetric per block
  (``w = d * q``, ``q`` in -127..127, stored +128), again the GGUF's own form:
  ``MatMulNBits(bits=8)`` for the head and ``GatherBlockQuantized`` for the embedding
  lookup, which reads the head's tensors through ``Reshape`` nodes, so the tied table is
  stored once (32 MB for SmolLM2).
* ``int8`` -- the decoder layers 8-bit in the same asymmetric form (``q`` in 0..255,
  ``d = (max - min) / 255``; Q4_1 blocks map exactly onto this grid, ``q8 = 17 * q4``),
  centred on 128 the same way, head and embedding as in ``int4``.

Adapted layers: the merged LoRA update of a layer is small next to the base's 4-bit step
(after a few rounds |B A scale| is a fraction of ``d``), so re-quantising a merged layer
at 4 bits rounds much of the fine-tuning away. Measured on SmolLM2 after 3 LoRA steps
(1,016 held-out positions): all layers 4-bit -> INT4 top-1 agreement with the fp32 merged
model 0.858, perplexity ratio 1.154; INT8 0.944 / 1.027. Release v1 kept the adapted
layers (``q_proj``/``v_proj``, fused as ``qkv_proj`` in the export) 8-bit (``eight_bit``).
Since v2 the release build hands over the adapters' low-rank terms instead (``low_rank``):
an adapted layer's *base* weight -- the merged weight minus ``A @ B``, i.e. the base's own
Q4_1 blocks -- is quantised like any other layer, and ``x @ A @ B`` joins the block-minimum
correction, whose two MatMuls then carry ``[S | A]`` and ``[M' ; B]``: the base exact at 4
bits, the fine-tuning exact in float32, no extra node (measured in ``bench/llm_quant.md``).

Activations: ``accuracy_level = 4`` -- onnxruntime quantises each row's activations per
block of 32 to int8 at run time (MatMulNBits spec, com.microsoft). The scale of a block
depends only on that row, so a row's answer never depends on other rows of the batch;
integer products are exact on every CPU (centred weights times int8: at most
2 * 8 * 127 in a pair at 4 bits, 2 * 128 * 127 = 32,512 at 8 bits, at the int16 edge an
AVX2 kernel without VNNI must widen past -- checked at the range ends by
``tests/platform/llm/test_quantize.py`` on the CPU that runs the tests). What differs
between CPUs (AVX-512 VNNI or AVX2) is float32 rounding of the scales and sums; because a
rounding difference can move an activation across an int8 rounding boundary, logits can
differ by up to a few tenths (measured: prefill vs token-by-token decode of the same text
on one CPU, max |Δlogit| 2.8, top-1 agreement 0.92 -- the release canary's tolerances are
set from this, see :mod:`.canary`).

Measurements that chose this (SmolLM2-135M base, 4 held-out windows of 256 tokens from
the four manuals, top-1 agreement and perplexity against torch float32; 2 busy cores,
onnxruntime 1.32, 2 threads; ``bench/llm_quant.md``):

=================================================  ======  =====  ======  ==========  =======
candidate                                          MB      agree  ppl     TTFT128 s   tok/s
=================================================  ======  =====  ======  ==========  =======
float32 (builder export)                           540.3   1.000  15.19   1.50        7.9
builder ``-p int4`` (symmetric RTN, acc 4)         86.5    0.689  19.64   3.41        13.5
builder ``int4 algo_config=k_quant_mixed``         113.6   0.808  16.07   3.69        12.7
builder ``-p int4 is_symmetric=false``             --      --     --      model does not load (Gather type error)
builder ``-p int8``                                267.0   0.967  15.25   1.99        23.1
4-bit asym, integer zero point + 8-bit head        135.9   0.741  17.93   5.23        9.7
4-bit float zero point (exact Q4_1), acc 0         147.5   1.000  15.19   6.26        0.6
**Q4_1 form + Q8_0 head, acc 4 (this int4)**       149.3   0.930  15.30   0.86        47.7
Q4_1 form + Q8_0 head, acc 0 (fp32 compute)        149.3   1.000  15.19   0.77        4.6
=================================================  ======  =====  ======  ==========  =======

Symmetric or integer-zero-point 4-bit cannot represent Q4_1 blocks, so re-quantising the
already 4-bit base loses a second time (agreement 0.69-0.81); the Q4_1 form keeps the
base's blocks. Float zero points are exact but take onnxruntime's slow path; the block
minimum as a separate small MatMul keeps the fast int8 kernels.
"""

from __future__ import annotations

import logging

import numpy as np

from sealfl.platform.errors import QuantizeError

__all__ = ["BLOCK", "SCHEMES", "QuantizeError", "quantize_asym_blocks", "dequantize_asym_blocks",
           "quantize_sym8_blocks", "dequantize_sym8_blocks", "pack_nibbles", "quantize_llm"]

log = logging.getLogger(__name__)

BLOCK = 32
ACCURACY_LEVEL = 4
SCHEMES = {
    "int4": {"name": "sealfl.llm-q4_1/v2", "body_bits": 4, "head_bits": 8, "block_size": BLOCK,
             "accuracy_level": ACCURACY_LEVEL,
             "body": "4-bit asymmetric per block of 32 (w = d*q + m, q in 0..15; Q4_1 form), centred: "
                     "MatMulNBits (q - 8, default zero point) + block-sum x (m + 8d) MatMul",
             "head": "tied lm_head and embedding 8-bit symmetric per block of 32 (Q8_0 form): MatMulNBits bits=8, "
                     "GatherBlockQuantized",
             "activations": "int8 per row and block of 32 at run time (accuracy_level 4)"},
    "int8": {"name": "sealfl.llm-q8_1/v2", "body_bits": 8, "head_bits": 8, "block_size": BLOCK,
             "accuracy_level": ACCURACY_LEVEL,
             "body": "8-bit asymmetric per block of 32 (w = d*q + m, q in 0..255), centred: MatMulNBits (q - 128, "
                     "default zero point) + block-sum x (m + 128d) MatMul",
             "head": "tied lm_head and embedding 8-bit symmetric per block of 32 (Q8_0 form)",
             "activations": "int8 per row and block of 32 at run time (accuracy_level 4)"},
}




def _blocks(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[0] % BLOCK:
        raise QuantizeError(f"weight must be 2-D (K, N) with K a multiple of {BLOCK}, got shape {w.shape}")
    k, n = w.shape
    return np.ascontiguousarray(w.T).reshape(n, k // BLOCK, BLOCK)


def quantize_asym_blocks(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric block quantisation of a weight (K, N) (K inputs, N outputs).

    Returns:
        ``(q, d, m)``: uint8 (N, K/32, 32) in ``0 .. 2**bits - 1``, float32 scales (N, K/32)
        and float32 block minima (N, K/32), with ``w[k, n] ~= d[n, b] * q[n, b, j] + m[n, b]``
        for ``k = 32 b + j``. A constant block gets ``d = 1``, ``q = 0``, ``m`` = the value.

    Raises:
        QuantizeError: not 2-D, K not a multiple of 32, or a value that is not finite.
    """
    if bits not in (4, 8):
        raise QuantizeError(f"bits must be 4 or 8, got {bits}")
    wb = _blocks(w)
    if not np.all(np.isfinite(wb)):
        raise QuantizeError("weight holds values that are not finite")
    qmax = np.float32(2**bits - 1)
    mn = wb.min(axis=-1)
    d = (wb.max(axis=-1) - mn) / qmax
    d = np.where(d > 0, d, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint((wb - mn[..., None]) / d[..., None]), 0, qmax).astype(np.uint8)
    return q, d, mn.astype(np.float32)


def dequantize_asym_blocks(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of :func:`quantize_asym_blocks`: float32 (K, N)."""
    w = q.astype(np.float32) * d[..., None] + m[..., None]
    n, nb, _ = q.shape
    return np.ascontiguousarray(w.reshape(n, nb * BLOCK).T)


def quantize_sym8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """8-bit symmetric block quantisation (Q8_0 form) of a weight (K, N).

    Returns:
        ``(q, d)``: uint8 (N, K/32, 32) holding ``q + 128`` for ``q`` in -127..127 and float32
        scales ``d = max|w| / 127`` (N, K/32); ``w ~= d * (q_u8 - 128)``.

    Raises:
        QuantizeError: as :func:`quantize_asym_blocks`.
    """
    wb = _blocks(w)
    if not np.all(np.isfinite(wb)):
        raise QuantizeError("weight holds values that are not finite")
    amax = np.abs(wb).max(axis=-1)
    d = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = (np.clip(np.rint(wb / d[..., None]), -127, 127) + 128).astype(np.uint8)
    return q, d


def dequantize_sym8_blocks(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Inverse of :func:`quantize_sym8_blocks`: float32 (K, N)."""
    w = (q.astype(np.float32) - np.float32(128)) * d[..., None]
    n, nb, _ = q.shape
    return np.ascontiguousarray(w.reshape(n, nb * BLOCK).T)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Pack 4-bit values (uint8 < 16, last axis even) two per byte, low nibble first
    (MatMulNBits' layout)."""
    q = np.asarray(q, dtype=np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _nbits_node(helper, numpy_helper, prefix, x, out, w, bits, acc, inits, nodes, low_rank=None, sums=None):
    """Nodes for ``out = x @ w`` with ``w`` (K, N) in the centred asymmetric block form
    (module docstring): MatMulNBits of ``q - 2**(bits-1)`` (its default zero point) plus the
    block sums times ``m + 2**(bits-1) d``. With ``low_rank = (A, B)`` (float (K, R), (R, N);
    ``w = base + A @ B``, an adapted layer) only ``base`` is quantised and ``A @ B`` rides in
    the correction term: ``x @ [S | A] @ [M' ; B]``, the same two MatMuls. ``sums`` maps
    ``(x, S)`` to the block sums already computed from that input (gate and up projections
    read the same ``x``): those are reused, not computed twice."""
    k, n = w.shape
    if low_rank is not None:
        a, b = (np.asarray(t, dtype=np.float64) for t in low_rank)
        if a.shape[0] != k or b.shape[1] != n or a.shape[1] != b.shape[0]:
            raise QuantizeError(f"low-rank terms {a.shape} x {b.shape} do not fit the weight {w.shape}")
        w = (np.asarray(w, dtype=np.float64) - a @ b).astype(np.float32)
    q, d, m = quantize_asym_blocks(w, bits)
    blob = pack_nibbles(q) if bits == 4 else q
    centred_min = (m + np.float32(2 ** (bits - 1)) * d).astype(np.float32)
    names = {s: f"{prefix}/q/{s}" for s in ("B", "scales", "min", "y", "xs", "corr")}
    summer = f"sealfl/q/block_sum_{k}"
    block_sum = np.kron(np.eye(k // BLOCK, dtype=np.float32), np.ones((BLOCK, 1), np.float32))
    corr = np.ascontiguousarray(centred_min.T)
    if low_rank is not None:  # this layer's own [S | A] and [M' ; B]
        summer = f"{prefix}/q/block_sum_lora"
        inits.append(numpy_helper.from_array(np.concatenate([block_sum, a.astype(np.float32)], axis=1), summer))
        corr = np.concatenate([corr, b.astype(np.float32)], axis=0)
    elif not any(i.name == summer for i in inits):
        # (K, K/32) 0/1 matrix: x @ S sums x over each block of 32 (rank-agnostic, unlike a Reshape)
        inits.append(numpy_helper.from_array(block_sum, summer))
    inits += [numpy_helper.from_array(blob, names["B"]), numpy_helper.from_array(d.reshape(-1), names["scales"]),
              numpy_helper.from_array(corr, names["min"])]
    nodes += [
        helper.make_node("MatMulNBits", [x, names["B"], names["scales"]], [names["y"]],
                         name=f"{prefix}/MatMulNBits", domain="com.microsoft", K=k, N=n, bits=bits,
                         block_size=BLOCK, accuracy_level=acc),
    ]
    shared = sums is not None and low_rank is None
    if shared and (x, summer) in sums:
        names["xs"] = sums[(x, summer)]
    else:
        nodes.append(helper.make_node("MatMul", [x, summer], [names["xs"]], name=f"{prefix}/BlockSum"))
        if shared:
            sums[(x, summer)] = names["xs"]
    nodes += [
        helper.make_node("MatMul", [names["xs"], names["min"]], [names["corr"]], name=f"{prefix}/BlockMin"),
        helper.make_node("Add", [names["y"], names["corr"]], [out], name=f"{prefix}/Add"),
    ]


def _check_wiring(graph, scheme: str) -> None:
    """Every node input is a graph input, an initializer or an earlier node's output
    (``onnx.checker`` cannot be used: it rejects onnxruntime's own default-domain ops such
    as ``SimplifiedLayerNormalization`` that the export contains)."""
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    for node in graph.node:
        missing = [i for i in node.input if i not in known]
        if missing:
            raise QuantizeError(f"{scheme} quantisation produced an invalid model: node {node.name} reads "
                                f"undefined {missing}")
        known.update(node.output)
    undefined = [o.name for o in graph.output if o.name not in known]
    if undefined:
        raise QuantizeError(f"{scheme} quantisation produced an invalid model: outputs {undefined} are not computed")


def quantize_llm(model_bytes_or_proto, scheme: str = "int4", eight_bit: tuple[str, ...] = (),
                 low_rank: dict | None = None) -> bytes:
    """Quantise a float32 causal-LM ONNX graph (as exported by :mod:`.export`).

    Every ``MatMul`` with a constant 2-D float weight is replaced (module docstring); the
    one producing the graph output ``logits`` is the head (8-bit symmetric). The token
    embedding -- a ``Gather`` on ``input_ids`` whose table is the head's weight (tied,
    possibly through a ``Transpose``) or its own initializer -- becomes a
    ``GatherBlockQuantized`` over the 8-bit symmetric form of that table.

    Args:
        model_bytes_or_proto: ``onnx.ModelProto`` or its bytes (external data loaded).
        scheme: ``"int4"`` or ``"int8"`` (:data:`SCHEMES`).
        eight_bit: node-name fragments of layers kept at 8 bits in any scheme (the
            adapted layers when their low-rank terms are not given).
        low_rank: ``{MatMul node name: (A float (K, R), B float (R, N))}`` -- the layers the
            adapters changed, ``W = base + A @ B`` (``merged_low_rank`` of :mod:`.build`):
            ``base`` is quantised in the scheme's form (the base model's own blocks) and
            ``A @ B`` is computed exactly in float32 beside it ("Adapted layers" in the
            module docstring).

    Returns:
        the serialised quantised model (one file, no external data).

    Raises:
        QuantizeError: unknown scheme, no head/embedding found, a weight with K not a
            multiple of 32, or the result fails ``onnx.checker``.
    """
    import onnx
    from onnx import helper, numpy_helper

    if scheme not in SCHEMES:
        raise QuantizeError(f"unknown quantisation scheme {scheme!r}; choose one of {sorted(SCHEMES)}")
    cfg = SCHEMES[scheme]
    if isinstance(model_bytes_or_proto, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(model_bytes_or_proto)  # the caller's graph stays as it was
    else:
        model = onnx.load_from_string(model_bytes_or_proto)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    new_inits: list = []
    nodes: list = []
    sums: dict = {}  # (input, S) -> its block sums (_nbits_node)
    head = None
    for node in graph.node:
        w_init = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w_init is None or len(w_init.dims) != 2 or w_init.data_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        w = numpy_helper.to_array(w_init)
        prefix = node.name or node.output[0]
        if "logits" in node.output or any(o in outputs and "logit" in o for o in node.output):
            q, d = quantize_sym8_blocks(w)
            k, n = w.shape
            names = (f"{prefix}/q8/B", f"{prefix}/q8/scales", f"{prefix}/q8/zp")
            new_inits += [numpy_helper.from_array(q, names[0]), numpy_helper.from_array(d.reshape(-1), names[1]),
                          numpy_helper.from_array(np.full(n * (k // BLOCK), 128, np.uint8), names[2])]
            nodes.append(helper.make_node("MatMulNBits", [node.input[0], *names], list(node.output),
                                          name=f"{prefix}/MatMulNBits", domain="com.microsoft", K=k, N=n, bits=8,
                                          block_size=BLOCK, accuracy_level=cfg["accuracy_level"]))
            head = (node.input[1], q, d, names)
            continue
        terms = (low_rank or {}).get(node.name)
        bits = 8 if terms is None and any(f in prefix for f in eight_bit) else cfg["body_bits"]
        try:
            _nbits_node(helper, numpy_helper, prefix, node.input[0], node.output[0], w, bits,
                        cfg["accuracy_level"], new_inits, nodes, terms, sums)
        except QuantizeError as exc:
            raise QuantizeError(f"node {prefix}: {exc}") from exc
    if head is None:
        raise QuantizeError("no MatMul with a constant weight produces the 'logits' output; not a causal-LM export")
    final, embedded = [], False
    for node in nodes:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == "input_ids":
            table = node.input[0]
            src = producers.get(table)
            tied = (src is not None and src.op_type == "Transpose" and src.input[0] == head[0]) or table == head[0]
            names = ("sealfl/embed/q8", "sealfl/embed/scales", "sealfl/embed/zp")
            if tied:
                # one copy of the tied table in the file: the embedding reads the head's
                # quantised tensors through Reshape nodes ((N, K/32, 32) -> (N, K), flat -> (N, K/32))
                vocab, nb, _ = head[1].shape
                hb, hs, hz = head[3]
                new_inits += [numpy_helper.from_array(np.array([vocab, nb * BLOCK], np.int64), "sealfl/embed/shape_q"),
                              numpy_helper.from_array(np.array([vocab, nb], np.int64), "sealfl/embed/shape_s")]
                final += [helper.make_node("Reshape", [hb, "sealfl/embed/shape_q"], [names[0]], name="sealfl/embed/ReshapeQ"),
                          helper.make_node("Reshape", [hs, "sealfl/embed/shape_s"], [names[1]], name="sealfl/embed/ReshapeS"),
                          helper.make_node("Reshape", [hz, "sealfl/embed/shape_s"], [names[2]], name="sealfl/embed/ReshapeZ")]
            elif table in inits:
                tw = numpy_helper.to_array(inits[table]).astype(np.float32)  # (vocab, hidden)
                q, d = quantize_sym8_blocks(np.ascontiguousarray(tw.T))
                vocab, nb, _ = q.shape
                new_inits += [numpy_helper.from_array(q.reshape(vocab, nb * BLOCK), names[0]),
                              numpy_helper.from_array(d, names[1]),
                              numpy_helper.from_array(np.full((vocab, nb), 128, np.uint8), names[2])]
            else:
                raise QuantizeError(f"embedding {node.name}: its table {table!r} is neither the head weight nor constant")
            final.append(helper.make_node("GatherBlockQuantized", [names[0], "input_ids", names[1], names[2]],
                                          list(node.output), name=f"{node.name}/GatherBlockQuantized",
                                          domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=BLOCK,
                                          bits=8))
            embedded = True
            continue
        final.append(node)
    if not embedded:
        raise QuantizeError("no Gather on input_ids found: cannot quantise the token embedding")
    used = {i for n in final for i in n.input}
    final = [n for n in final if not (n.op_type == "Transpose" and not (set(n.output) & used))]
    used = {i for n in final for i in n.input}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.node[:]
    graph.node.extend(final)
    del graph.initializer[:]
    graph.initializer.extend(kept + [i for i in new_inits if i.name in used])
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _check_wiring(graph, scheme)
    data = model.SerializeToString()
    log.info("quantised causal LM to %s: %.1f MB", scheme, len(data) / 1e6)
    return data
