"""What the device would load is what was verified: ONNX tensors with external data are
refused at verification, naming tensor and location, wherever they sit in the model."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from sealfl.attestation.errors import VerificationError
from sealfl.attestation.onnx_check import check_self_contained, external_tensors
from sealfl.attestation.release import load_trust_anchors, verify_release
from sealfl.enclave.device.boot import boot, read_device_state
from sealfl.enclave.errors import BootError
from sealfl.enclave.sandbox.runtime import SandboxedRuntime
from tests.support.releases import (
    MODEL_FILE,
    default_payload,
    make_onnx_model,
    signed_release_files,
    write_signed_release,
)


def _external(name: str, location: str, shape=(4, 1)) -> TensorProto:
    """A float tensor whose bytes live in ``location`` (ONNX external data, ExternalData.md)."""
    tensor = numpy_helper.from_array(np.zeros(shape, np.float32), name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(4 * int(np.prod(shape))))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _model(nodes, initializers=(), sparse=(), functions=(), opset=17) -> bytes:
    graph = helper.make_graph(list(nodes), "main",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
                              list(initializers), sparse_initializer=list(sparse))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("local", 1)], functions=list(functions))
    model.ir_version = 9
    return model.SerializeToString()


def _gemm(w="W"):
    return helper.make_node("Gemm", ["x", w, "B"], ["y"])


B = numpy_helper.from_array(np.zeros((1,), np.float32), "B")


def _subgraph(name: str, location: str):
    """A branch/body graph whose Constant node holds an external tensor."""
    const = helper.make_node("Constant", [], ["c"], value=_external(f"{name}_c", location))
    return helper.make_graph([const], name, [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4, 1])])


def _cases() -> dict[str, tuple[bytes, str, str]]:
    """model bytes, expected tensor name, expected location -- one per place a tensor can sit."""
    cond = helper.make_node("If", ["cond"], ["w_if"], then_branch=_subgraph("then", "then.bin"),
                            else_branch=_subgraph("else_ok", "else.bin"))
    loop = helper.make_node("Loop", ["", "cond"], ["w_loop"], body=_subgraph("body", "loop.bin"))
    scan = helper.make_node("Scan", ["x"], ["w_scan"], body=_subgraph("scan", "scan.bin"), num_scan_inputs=1)
    function = helper.make_function("local", "MakeW", [], ["w"],
                                    [helper.make_node("Constant", [], ["w"], value=_external("fn_w", "fn.bin"))],
                                    [helper.make_opsetid("", 17)])
    sparse = helper.make_sparse_tensor(_external("sp_values", "sparse.bin", (2,)),
                                       numpy_helper.from_array(np.array([0, 3], np.int64), "sp_idx"), [4, 1])
    deep = _subgraph("level0", "deep.bin")
    empty = helper.make_graph([], "empty", [], [])
    for level in range(1, 20):  # nested If bodies, 20 deep (protobuf parses at most 100 levels)
        inner = helper.make_node("If", ["cond"], ["c"], then_branch=deep, else_branch=empty)
        deep = helper.make_graph([inner], f"level{level}", [],
                                 [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4, 1])])
    training = helper.make_model(helper.make_graph([_gemm()], "main", [], [], [B]))
    info = training.training_info.add()
    info.initialization.CopyFrom(helper.make_graph([], "init", [], [], [_external("train_w", "train.bin")]))
    training.ir_version = 9
    return {
        "initializer": (_model([_gemm()], [_external("W", "../../etc/hostname"), B]), "W", "../../etc/hostname"),
        "sparse-initializer": (_model([_gemm()], [B], sparse=[sparse]), "sp_values", "sparse.bin"),
        "constant-attribute": (_model([helper.make_node("Constant", [], ["W"], value=_external("cW", "c.bin")),
                                       _gemm()], [B]), "cW", "c.bin"),
        "attribute-tensor-list": (_model([helper.make_node("Custom", [], ["W"], domain="local",
                                                           ts=[_external("listed", "list.bin")]), _gemm()], [B]),
                                  "listed", "list.bin"),
        "if-branch": (_model([cond, _gemm("w_if")], [B]), "then_c", "then.bin"),
        "loop-body": (_model([loop, _gemm("w_loop")], [B]), "body_c", "loop.bin"),
        "scan-body": (_model([scan, _gemm("w_scan")], [B]), "scan_c", "scan.bin"),
        "function-body": (_model([helper.make_node("MakeW", [], ["W"], domain="local"), _gemm()], [B],
                                 functions=[function]), "fn_w", "fn.bin"),
        "nested-20-deep": (_model([helper.make_node("If", ["cond"], ["W"], then_branch=deep, else_branch=empty),
                                   _gemm()], [B]), "level0_c", "deep.bin"),
        "training-info": (training.SerializeToString(), "train_w", "train.bin"),
    }


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_kind_external_data_is_refused_wherever_the_tensor_sits(case):
    model, tensor, location = CASES[case]
    found = external_tensors(__import__("onnx").load_model_from_string(model))
    assert (tensor, location) in {(r.tensor, r.location) for r in found}
    with pytest.raises(VerificationError) as info:
        check_self_contained(model, MODEL_FILE)
    assert (info.value.file, info.value.check) == (MODEL_FILE, "onnx")
    assert repr(tensor) in str(info.value) and repr(location) in str(info.value)


def test_kind_self_contained_models_pass_and_non_onnx_is_refused():
    check_self_contained(make_onnx_model(), MODEL_FILE)
    for junk in (b"this is not onnx", b"", b"\x00\x01"):
        with pytest.raises(VerificationError) as info:
            check_self_contained(junk, MODEL_FILE)
        assert info.value.check == "onnx"


def test_kind_signed_model_with_external_data_is_refused_by_verify_and_boot(trust_dir, enclave, tmp_path):
    """The issue's input: a validly signed and attested ONNX whose initializer's external data
    points at ../../etc/hostname -- refused at verification, naming tensor and path."""
    model, tensor, location = CASES["initializer"]
    payload = {**default_payload(), MODEL_FILE: model}
    files = signed_release_files(enclave, payload, "heart-mlp", 4, {"model_file": MODEL_FILE})
    with pytest.raises(VerificationError) as info:
        verify_release(files, load_trust_anchors(trust_dir))
    assert (info.value.file, info.value.check) == (MODEL_FILE, "onnx")
    assert "'W'" in str(info.value) and "'../../etc/hostname'" in str(info.value)
    release = write_signed_release(enclave, tmp_path / "r", payload, "heart-mlp", 4, {"model_file": MODEL_FILE})
    with pytest.raises(BootError) as boot_info:
        boot(trust_dir, release, tmp_path / "device", backend="sim")
    assert (boot_info.value.reason, boot_info.value.file, boot_info.value.check) == ("verification", MODEL_FILE,
                                                                                    "onnx")
    assert read_device_state(tmp_path / "device").last_good is None


def test_kind_every_onnx_payload_is_checked_not_only_the_model_file(trust_dir, enclave):
    payload = {**default_payload(), "spare.onnx": CASES["constant-attribute"][0]}
    files = signed_release_files(enclave, payload, "heart-mlp", 4, {"model_file": MODEL_FILE})
    with pytest.raises(VerificationError) as info:
        verify_release(files, load_trust_anchors(trust_dir))
    assert (info.value.file, info.value.check) == ("spare.onnx", "onnx")


def test_kind_sandbox_child_runs_in_an_empty_private_directory():
    with SandboxedRuntime(make_onnx_model()) as rt:
        cwd = os.readlink(f"/proc/{rt.pid}/cwd")
        assert cwd == rt.workdir and cwd != "/"
        assert os.listdir(cwd) == []
        assert stat.S_IMODE(os.stat(cwd).st_mode) == 0o700
    assert not os.path.exists(cwd)
