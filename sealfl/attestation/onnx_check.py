"""What the device would load is what was verified: ONNX models must be self-contained.

An ONNX tensor may keep its bytes outside the model file ("external data", ONNX IR spec,
``TensorProto.data_location = EXTERNAL`` with ``external_data`` entries ``location``,
``offset``, ``length``; onnx/docs/ExternalData.md). onnxruntime then reads that path
relative to the model's directory -- for a model loaded from bytes, relative to the working
directory -- so a signed model whose initializer points at ``../../etc/hostname`` or
``weights.bin`` would load bytes nobody signed. :func:`check_self_contained` walks the
model's protobuf wire format (:mod:`sealfl.attestation.onnx_wire`: no tensor's bytes are
copied, no external data is ever loaded) and refuses every tensor that points outside,
wherever it sits:

* graph initializers and sparse initializers (values and indices);
* tensors in node attributes (``t``, ``tensors``, ``sparse_tensor``, ``sparse_tensors``),
  e.g. ``Constant`` nodes;
* subgraphs in node attributes (``g``, ``graphs``: the bodies of ``If``, ``Loop``,
  ``Scan``), at any depth;
* the node bodies of model-local functions (``ModelProto.functions``);
* the graphs of ``ModelProto.training_info`` (initialization and algorithm).

Pure (bytes in, decision out). :func:`external_tensors` does the same on a parsed
``onnx.ModelProto`` (tools and tests; the ``onnx`` package is the caller's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sealfl.attestation.errors import VerificationError
from sealfl.attestation.onnx_wire import WireError, scan_external

__all__ = ["ExternalTensor", "external_tensors", "check_self_contained"]

#: Most external tensors listed in one error message.
_MAX_LISTED = 5


@dataclass(frozen=True)
class ExternalTensor:
    """A tensor whose data lives outside the model file.

    Attributes:
        tensor: the tensor's name (``""`` if unnamed).
        where: where it sits, e.g. ``"graph 'main' > node 'If_0' attribute 'then_branch' >
            graph 'then' initializer"``.
        location: its ``external_data`` ``location`` entry (``""`` if none).
    """

    tensor: str
    where: str
    location: str


def _tensor_ref(tensor: Any, where: str, out: list[ExternalTensor]) -> None:
    from onnx import TensorProto

    if tensor.data_location == TensorProto.EXTERNAL or len(tensor.external_data) > 0:
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        out.append(ExternalTensor(tensor.name, where, location))


def external_tensors(model: Any) -> list[ExternalTensor]:
    """Every tensor of ``model`` (an ``onnx.ModelProto``) that uses external data, in
    traversal order (module docstring lists where it looks). Pure; iterative, so deeply
    nested subgraphs cannot exhaust Python's recursion limit."""
    out: list[ExternalTensor] = []
    graphs: list[tuple[Any, str]] = []
    nodes: list[tuple[Any, str]] = []
    if model.HasField("graph"):
        graphs.append((model.graph, f"graph {model.graph.name!r}"))
    for function in model.functions:
        for node in function.node:
            nodes.append((node, f"function '{function.domain}:{function.name}'"))
    for i, info in enumerate(model.training_info):
        for field in ("initialization", "algorithm"):
            if info.HasField(field):
                graph = getattr(info, field)
                graphs.append((graph, f"training_info[{i}].{field} graph {graph.name!r}"))
    while graphs or nodes:
        if graphs:
            graph, where = graphs.pop()
            for tensor in graph.initializer:
                _tensor_ref(tensor, f"{where} initializer", out)
            for sparse in graph.sparse_initializer:
                _tensor_ref(sparse.values, f"{where} sparse initializer (values)", out)
                _tensor_ref(sparse.indices, f"{where} sparse initializer (indices)", out)
            for node in graph.node:
                nodes.append((node, where))
            continue
        node, where = nodes.pop()
        for attr in node.attribute:
            here = f"{where} > node {node.name or node.op_type!r} attribute {attr.name!r}"
            if attr.HasField("t"):
                _tensor_ref(attr.t, here, out)
            for tensor in attr.tensors:
                _tensor_ref(tensor, here, out)
            sparse_list = ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + list(attr.sparse_tensors)
            for sparse in sparse_list:
                _tensor_ref(sparse.values, f"{here} (sparse values)", out)
                _tensor_ref(sparse.indices, f"{here} (sparse indices)", out)
            if attr.HasField("g"):
                graphs.append((attr.g, f"{here} > graph {attr.g.name!r}"))
            for sub in attr.graphs:
                graphs.append((sub, f"{here} > graph {sub.name!r}"))
    return out


def check_self_contained(data: bytes, file: str) -> None:
    """Refuse a model file that is not a self-contained ONNX model. Pure.

    Args:
        data: the verified bytes of the model file.
        file: its name in the release (for the error).

    Raises:
        VerificationError: check ``onnx`` -- the bytes are not an ONNX ``ModelProto`` with a
            graph, or any tensor uses external data (the message names up to five such
            tensors, where each sits and the path it points at).
    """
    try:
        has_graph, found = scan_external(data)  # the wire format, no copy of any tensor (onnx_wire)
    except WireError as exc:
        raise VerificationError(file, "onnx", f"not an ONNX model ({exc})") from exc
    if not has_graph:
        raise VerificationError(file, "onnx", "not an ONNX model: it has no graph")
    refs = [ExternalTensor(tensor, where, location) for tensor, where, location in found]
    if refs:
        listed = "; ".join(f"tensor {r.tensor!r} ({r.where}) -> external data {r.location!r}"
                           for r in refs[:_MAX_LISTED])
        more = f"; and {len(refs) - _MAX_LISTED} more" if len(refs) > _MAX_LISTED else ""
        raise VerificationError(file, "onnx", f"{len(refs)} tensor(s) load data from outside the signed file: "
                                f"{listed}{more}")
