"""Finding external-data tensors in a serialised ONNX model without parsing it into objects.

:func:`sealfl.attestation.onnx_check.check_self_contained` used to parse the whole
``ModelProto`` (``onnx``/protobuf), which copies every tensor's bytes: +121 MB of transient
memory for SmolLM2's 125 MB INT4 model, in the device process that already holds the
verified bytes (issue 24). :func:`scan_external` walks the protobuf wire format instead
(protobuf "Encoding": a message is a sequence of ``key = field << 3 | wire type`` varints,
each followed by a varint, 8 or 4 bytes, or a varint length and that many bytes), reading
only the fields that can lead to a tensor and skipping every other value by its length --
a weight's ``raw_data`` is never copied. Where it descends (field numbers of onnx.proto,
checked against ``onnx``'s descriptors by the tests):

============================  =================================================
ModelProto                    graph 7, training_info 20, functions 25
GraphProto                    node 1, name 2, initializer 5, sparse_initializer 15
NodeProto                     name 3, op_type 4, attribute 5
AttributeProto                t 5, g 6, tensors 10, graphs 11, sparse_tensor 22,
                              sparse_tensors 23
SparseTensorProto             values 1, indices 2
TensorProto                   name 8, external_data 13, data_location 14
StringStringEntryProto        key 1, value 2
FunctionProto                 name 1, node 7, domain 10
TrainingInfoProto             initialization 1, algorithm 2
============================  =================================================

A tensor is external if any ``data_location`` varint of it says ``EXTERNAL`` (1) or it has
an ``external_data`` entry -- every occurrence of a field counts, so a message whose field
appears twice (protobuf merges them; the last scalar wins) is judged at least as strictly
as a parser judges it. The walk is iterative (nesting depth costs no Python recursion).
Malformed wire data on the walked path (a truncated value, a length past its message, a
field number 0, a group or an unknown wire type) raises :class:`WireError`.
"""

from __future__ import annotations

__all__ = ["WireError", "scan_external"]

_MODEL, _GRAPH, _NODE, _ATTR, _SPARSE, _TENSOR, _FUNC, _TRAIN = range(8)
#: per message kind: {field number: (child kind, where-label)} of the fields walked into
_CHILDREN = {
    _MODEL: {7: (_GRAPH, ""), 20: (_TRAIN, ""), 25: (_FUNC, "")},
    _GRAPH: {1: (_NODE, ""), 5: (_TENSOR, "initializer"), 15: (_SPARSE, "sparse initializer")},
    _NODE: {5: (_ATTR, "")},
    _ATTR: {5: (_TENSOR, ""), 6: (_GRAPH, ""), 10: (_TENSOR, ""), 11: (_GRAPH, ""), 22: (_SPARSE, ""),
            23: (_SPARSE, "")},
    _SPARSE: {1: (_TENSOR, "(values)"), 2: (_TENSOR, "(indices)")},
    _TRAIN: {1: (_GRAPH, ".initialization"), 2: (_GRAPH, ".algorithm")},
    _FUNC: {7: (_NODE, "")},
    _TENSOR: {},
}
#: per message kind: the string field that names it (for the report); a node without a
#: name is named by its op_type (4), a function by ``domain:name`` (10, 1)
_NAME_FIELD = {_GRAPH: 2, _NODE: 3, _TENSOR: 8, _FUNC: 1, _ATTR: 1}
_ALT_NAME_FIELD = {_NODE: 4, _FUNC: 10}


class WireError(ValueError):
    """The bytes are not well-formed protobuf on the path walked (message says where)."""


def _varint(buf, i: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= end or shift > 63:
            raise WireError(f"truncated or overlong varint at byte {i}")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf, start: int, end: int):
    """``(field, wire type, value, begin, stop)`` of each field of the message in
    ``buf[start:end]``: ``value`` is the varint for wire type 0, else None; a
    length-delimited field's bytes are ``buf[begin:stop]``."""
    i = start
    while i < end:
        key, i = _varint(buf, i, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise WireError(f"field number 0 at byte {i}")
        if wire == 0:
            value, i = _varint(buf, i, end)
            yield field, wire, value, i, i
        elif wire == 1 or wire == 5:
            i += 8 if wire == 1 else 4
            if i > end:
                raise WireError(f"truncated fixed-width value before byte {end}")
        elif wire == 2:
            n, i = _varint(buf, i, end)
            if i + n > end:
                raise WireError(f"a length of {n} bytes at byte {i} runs past its message (ends at {end})")
            yield field, wire, None, i, i + n
            i += n
        else:
            raise WireError(f"wire type {wire} (groups or unknown) at byte {i}")


def _text(buf, begin: int, stop: int) -> str:
    return bytes(buf[begin:stop]).decode("utf-8", "replace")


def _where(kind: int, name: str, parent: str, label: str) -> str:
    """Where a message sits, for the report: ``graph 'main' > node 'If_0' attribute
    'then_branch' > graph 'then' initializer``."""
    own = {_GRAPH: f"graph {name!r}", _FUNC: f"function {name!r}", _NODE: f"node {name!r}",
           _ATTR: f"attribute {name!r}", _TRAIN: "training_info"}.get(kind, "")
    sep = " > " if kind in (_GRAPH, _NODE) else " "
    text = (parent + sep + own).strip(" >") if own else parent
    return text + label if label.startswith(".") else " ".join(p for p in (text, label) if p)


def _external_entry_location(buf, begin: int, stop: int) -> str | None:
    """The value of an ``external_data`` entry whose key is ``location``, else None."""
    key = value = None
    for field, wire, _, b, s in _fields(buf, begin, stop):
        if wire == 2 and field == 1:
            key = _text(buf, b, s)
        elif wire == 2 and field == 2:
            value = _text(buf, b, s)
    return value if key == "location" else None


def scan_external(data: bytes) -> tuple[bool, list[tuple[str, str, str]]]:
    """Walk a serialised ``ModelProto`` (module docstring).

    Returns:
        ``(has_graph, externals)``: whether the model has a ``graph`` field, and for every
        tensor with external data ``(tensor name, where it sits, its location entry or "")``
        in the order met.

    Raises:
        WireError: malformed protobuf on the walked path.
    """
    buf = memoryview(data)
    out: list[tuple[str, str, str]] = []
    has_graph = False
    stack = [(_MODEL, 0, len(buf), "")]  # (kind, start, end, where the message sits)
    while stack:
        kind, start, end, where = stack.pop()
        name, alt, children, external, location = "", "", [], False, ""
        for field, wire, value, begin, stop in _fields(buf, start, end):
            if kind == _MODEL and field == 7 and wire == 2:
                has_graph = True
            if wire == 2 and field == _NAME_FIELD.get(kind):
                name = _text(buf, begin, stop)
            elif wire == 2 and field == _ALT_NAME_FIELD.get(kind):
                alt = _text(buf, begin, stop)
            elif kind == _TENSOR and field == 14 and wire == 0 and value == 1:
                external = True  # data_location = EXTERNAL
            elif kind == _TENSOR and field == 13 and wire == 2:
                external = True  # an external_data entry
                found = _external_entry_location(buf, begin, stop)
                location = found if found is not None else location
            elif wire == 2 and field in _CHILDREN[kind]:
                child, label = _CHILDREN[kind][field]
                children.append((child, begin, stop, label))
        if kind == _NODE:
            name = name or alt
        elif kind == _FUNC:
            name = f"{alt}:{name}"
        if kind == _TENSOR:
            if external:
                out.append((name, where, location))
            continue
        for child, begin, stop, label in reversed(children):  # pushed reversed: walked in file order
            stack.append((child, begin, stop, _where(kind, name, where, label)))
    return has_graph, out
