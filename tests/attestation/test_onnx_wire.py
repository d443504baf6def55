"""The wire-format scan behind check_self_contained finds exactly the external tensors that
onnx's own parse finds (wherever they sit), copies no tensor bytes, and refuses malformed
protobuf."""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from sealfl.attestation import onnx_wire
from sealfl.attestation.onnx_check import external_tensors
from sealfl.attestation.onnx_wire import WireError, scan_external
from tests.attestation.test_onnx import CASES, _external, _gemm, _model


def _oracle(data: bytes) -> set[tuple[str, str]]:
    return {(r.tensor, r.location) for r in external_tensors(onnx.load_model_from_string(data))}


def test_kind_field_numbers_are_onnx_protos():
    d = {m.DESCRIPTOR.name: m.DESCRIPTOR for m in (onnx.ModelProto, onnx.GraphProto, onnx.NodeProto,
                                                   onnx.AttributeProto, onnx.SparseTensorProto, onnx.TensorProto,
                                                   onnx.FunctionProto, onnx.TrainingInfoProto,
                                                   onnx.StringStringEntryProto)}
    expect = {"ModelProto": {"graph": 7, "training_info": 20, "functions": 25},
              "GraphProto": {"node": 1, "name": 2, "initializer": 5, "sparse_initializer": 15},
              "NodeProto": {"name": 3, "op_type": 4, "attribute": 5},
              "AttributeProto": {"name": 1, "t": 5, "g": 6, "tensors": 10, "graphs": 11, "sparse_tensor": 22,
                                 "sparse_tensors": 23},
              "SparseTensorProto": {"values": 1, "indices": 2},
              "TensorProto": {"name": 8, "external_data": 13, "data_location": 14},
              "StringStringEntryProto": {"key": 1, "value": 2},
              "FunctionProto": {"name": 1, "node": 7, "domain": 10},
              "TrainingInfoProto": {"initialization": 1, "algorithm": 2}}
    for msg, fields in expect.items():
        assert {f: d[msg].fields_by_name[f].number for f in fields} == fields, msg
    assert TensorProto.EXTERNAL == 1
    walked = {(k, f) for k, children in onnx_wire._CHILDREN.items() for f in children}
    assert (onnx_wire._MODEL, 7) in walked and (onnx_wire._ATTR, 23) in walked


@pytest.mark.parametrize("case", sorted(CASES))
def test_kind_the_scan_finds_what_the_parse_finds(case):
    data, tensor, location = CASES[case]
    has_graph, found = scan_external(data)
    assert has_graph
    assert {(t, loc) for t, _, loc in found} == _oracle(data) and (tensor, location) in _oracle(data)


def test_kind_random_models_agree_with_the_parse():
    """Many external and internal tensors in random places (initializers, Constant nodes,
    If branches, sparse initializers), some with a location, some only data_location."""
    for seed in range(40):
        rng = np.random.default_rng(seed)
        inits, nodes = [], []
        for i in range(int(rng.integers(0, 6))):
            t = _external(f"e{i}", f"x{i}.bin") if rng.random() < 0.5 else \
                numpy_helper.from_array(rng.normal(size=(3,)).astype(np.float32), f"i{i}")
            if rng.random() < 0.2:
                del t.external_data[:]  # only data_location = EXTERNAL
            (inits.append(t) if rng.random() < 0.5 else
             nodes.append(helper.make_node("Constant", [], [f"c{i}"], value=t)))
        if rng.random() < 0.5:
            g = helper.make_graph([helper.make_node("Constant", [], ["b"], value=_external(f"br{seed}", "br.bin"))],
                                  "branch", [], [helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 1])])
            nodes.append(helper.make_node("If", ["cond"], ["w"], then_branch=g, else_branch=g))
        data = _model(nodes + [_gemm()], inits)
        assert {(t, loc) for t, _, loc in scan_external(data)[1]} == _oracle(data), seed


def test_kind_a_repeated_field_is_judged_at_least_as_strictly_as_protobuf_merges_it():
    """Two serialised models concatenated parse as their merge: the scan sees both graphs'
    tensors; a data_location written twice (EXTERNAL, then DEFAULT) is still refused."""
    ext, _, _ = CASES["initializer"]
    clean = _model([_gemm()], [numpy_helper.from_array(np.zeros((4, 1), np.float32), "W")])
    assert _oracle(clean + ext) <= {(t, loc) for t, _, loc in scan_external(clean + ext)[1]}
    assert {(t, loc) for t, _, loc in scan_external(clean + ext)[1]} == {("W", "../../etc/hostname")}
    t = numpy_helper.from_array(np.zeros((4, 1), np.float32), "W")
    twice = t.SerializeToString() + bytes([14 << 3, 1, 14 << 3, 0])  # data_location 1, then 0
    graph = _field(2, b"main") + _field(5, twice)
    data = _field(7, graph)  # a ModelProto holding only that graph, written by hand
    assert not _oracle(data)  # protobuf: the last data_location wins, DEFAULT
    assert scan_external(data)[1] == [("W", "graph 'main' initializer", "")]


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    def varint(v: int) -> bytes:
        out = b""
        while v >= 0x80:
            out += bytes([v & 0x7F | 0x80])
            v >>= 7
        return out + bytes([v])

    return varint(number << 3 | 2) + varint(len(payload)) + payload


@pytest.mark.parametrize("junk", [b"\x00\x01", b"this is not onnx", b"\x3a\xff\xff\xff\xff\x0f",
                                  b"\x3a\x05ab", b"\x0b\x0c", b"\x3a" + b"\x80" * 11])
def test_kind_malformed_wire_data_is_refused(junk):
    with pytest.raises(WireError):
        scan_external(junk)


def test_kind_a_truncated_model_raises_only_wire_errors():
    """Every prefix of a model either scans (a cut at a field boundary of the top level)
    or raises WireError -- never another exception."""
    data, _, _ = CASES["if-branch"]
    refused = 0
    for cut in range(len(data)):
        try:
            scan_external(data[:cut])
        except WireError:
            refused += 1
    assert refused > len(data) // 2


def test_kind_the_scan_copies_no_tensor_bytes():
    """A model with 24 MB of weights: the scan allocates (Python) under 1 MB."""
    w = numpy_helper.from_array(np.ones((6 << 20,), np.float32), "big")
    data = _model([_gemm()], [w, _external("W", "w.bin")])
    tracemalloc.start()
    try:
        _, found = scan_external(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [t for t, _, _ in found] == ["W"] and peak < 1 << 20
