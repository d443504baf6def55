"""The ``logits_start`` input: let a device compute the language-model head for the last
prompt position only.

A causal-LM export computes ``logits`` (batch, seq, vocab) for every position it is fed.
Scoring (the release gate, perplexity) needs every position; generation needs only the
last one, and for a 128-token prompt the head (576 x 49,152 for SmolLM2-135M) over all
positions was ~250 of ~960 ms of the first token here (onnxruntime runs every node of a
graph, whatever outputs are requested). This module inserts, in front of the head,

    hidden' = Slice(hidden, starts=logits_start, ends=[INT64_MAX], axes=[1])

with ``logits_start`` an int64 (1,) graph input: ``[0]`` gives every position (scoring),
``[-1]`` the last one, (batch, 1, vocab) (generation). It is a required input, not an
initializer with a default: onnxruntime warns at every session about overridable
initializers and hides them from ``get_inputs()``. :class:`sealfl.enclave.sandbox.decode.KVDecoder`
feeds it whenever a graph has it. The last row is the same
either way: the head is a matrix product row by row (its int8 activation quantisation,
``MatMulNBits`` accuracy level 4, is per row and block -- onnxruntime
``contrib_ops/cpu/quantization/matmul_nbits.cc``), which tests check on the real graph.
"""

from __future__ import annotations

import numpy as np

from sealfl.platform.errors import ReleaseError

__all__ = ["LOGITS_START", "add_logits_start", "HeadError"]

LOGITS_START = "logits_start"
_INT64_MAX = np.iinfo(np.int64).max


class HeadError(ReleaseError):
    """The graph has no single node producing ``logits`` to put the slice in front of."""


def add_logits_start(model) -> None:
    """Insert the ``logits_start`` slice in front of the node producing ``logits`` (in place).

    Args:
        model: ``onnx.ModelProto`` of a causal-LM export (``logits`` output, hidden states
            (batch, seq, hidden) float32 as the head's first input).

    Raises:
        HeadError: no node, or more than one, produces ``logits``; or the graph already
            has a ``logits_start`` input.
    """
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    heads = [n for n in g.node if "logits" in n.output]
    if len(heads) != 1:
        raise HeadError(f"expected one node producing 'logits', found {len(heads)}")
    if any(i.name == LOGITS_START for i in g.input) or any(i.name == LOGITS_START for i in g.initializer):
        raise HeadError(f"the graph already has a {LOGITS_START!r} input")
    head = heads[0]
    hidden, sliced = head.input[0], "/sealfl/head/last_positions"
    g.initializer.extend([
        numpy_helper.from_array(np.array([_INT64_MAX], dtype=np.int64), "/sealfl/head/ends"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "/sealfl/head/axes"),
    ])
    g.input.append(helper.make_tensor_value_info(LOGITS_START, TensorProto.INT64, [1]))
    at = list(g.node).index(head)
    g.node.insert(at, helper.make_node("Slice", [hidden, LOGITS_START, "/sealfl/head/ends", "/sealfl/head/axes"],
                                       [sliced], name="/sealfl/head/Slice"))
    head.input[0] = sliced
