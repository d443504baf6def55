"""INT8 numerics that hold on every CPU: row-wise == batch-wise, and onnxruntime == a
NumPy implementation of the same integer arithmetic (written out in this file from the
scheme's definition, independently of the quantiser).

Nothing here depends on which integer kernel onnxruntime picks (AVX2, AVX-512 VNNI,
AVX-VNNI, ARM dot-product): the assertions are properties, not figures."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from sealfl.clients.heart.data import FEATURE_SPEC, load_partitions
from sealfl.clients.heart.task import HeartTask, TrainConfig
from sealfl.platform.onnx_ref import run_reference
from sealfl.platform.quantize import WEIGHT_QMAX, quantize_int8

ROW = [63, 1, 145, 233, 1, 150, 0, 2.3, 0, 0, 1, 0, 0]  # the example row


@pytest.fixture(scope="module")
def heart():
    parts = load_partitions()
    x = np.concatenate([p.x_train for p in parts])
    y = np.concatenate([p.y_train for p in parts])
    task = HeartTask()
    mean, std = x.mean(0), x.std(0)
    params, _ = task.train(task.init_params(), x, y, mean, std, TrainConfig(local_epochs=10), 0)
    fp32 = task.to_onnx(params, mean, std)
    return {"fp32": fp32, "int8": quantize_int8(fp32), "params": params, "mean": mean, "std": std,
            "x_test": np.concatenate([p.x_test for p in parts])}


def _session(model: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1  # as the device's sandbox runs it
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _by_hand(params, mean, std, x):
    """The scheme as the quantize module's docstring defines it, in float32 NumPy."""
    x = np.asarray(x, np.float32)
    z = (x - mean.astype(np.float32)) / std.astype(np.float32)
    w = params[:-1].astype(np.float32).reshape(-1, 1)
    s_w = np.abs(w).max(axis=0, keepdims=True) / np.float32(63)
    w_q = np.clip(np.rint(w / s_w), -63, 63).astype(np.int64)
    s_a = np.maximum(np.abs(z).max(axis=1, keepdims=True), np.float32(1e-30)) / np.float32(127)
    a_q = np.clip(np.rint(z / s_a), -127, 127).astype(np.int64)
    logit = ((a_q @ w_q).astype(np.float32) * s_a) * s_w + np.float32(params[-1])
    return 1.0 / (1.0 + np.exp(-logit.astype(np.float64)))


def _wild_rows(seed, n):
    """Rows far outside the data (x1000 outliers): large per-row scales stress the kernels."""
    rng = np.random.default_rng(seed)
    base = np.array(ROW, np.float32)
    x = base + rng.normal(size=(n, 13)).astype(np.float32) * np.array([10, 1, 20, 80, 1, 25, 1, 1, 1, 1, 1, 1, 1],
                                                                       np.float32)
    x[::5, 3] = 100000.0
    x[1::7] *= 1000.0
    return x.astype(np.float32)


def test_kind_int8_row_answer_does_not_depend_on_the_batch(heart):
    s = _session(heart["int8"])
    row = np.array([ROW], np.float32)
    outlier = row.copy()
    outlier[0, 3] = 100000.0  # chol = 100000 in ANOTHER patient's row
    alone = s.run(None, {"features": row})[0][0, 0]
    in_batch = s.run(None, {"features": np.concatenate([row, outlier])})[0][0, 0]
    assert abs(alone - in_batch) <= 1e-6
    # the same for every test row within any batch of test rows and wild rows
    x = np.concatenate([heart["x_test"], _wild_rows(1, 64)])
    batch = s.run(None, {"features": x})[0].reshape(-1)
    single = np.array([s.run(None, {"features": x[i:i + 1]})[0][0, 0] for i in range(len(x))])
    np.testing.assert_allclose(single, batch, rtol=0, atol=1e-6)


def test_kind_int8_equals_numpy_of_the_same_arithmetic(heart):
    x = np.concatenate([heart["x_test"], _wild_rows(2, 256)])
    ours = _session(heart["int8"]).run(None, {"features": x})[0].reshape(-1)
    hand = _by_hand(heart["params"], heart["mean"], heart["std"], x).reshape(-1)
    ref = run_reference(heart["int8"], {"features": x})[0].reshape(-1)
    # the NumPy graph evaluator implements the written-out scheme ...
    np.testing.assert_allclose(ref, hand, rtol=0, atol=1e-6)
    # ... and onnxruntime on THIS CPU computes it (a saturating int16 kernel would be off by ~0.3)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.lists(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=13, max_size=13),
                     min_size=1, max_size=12))
def test_kind_int8_property_any_rows(heart, data):
    x = np.asarray(data, np.float32)
    s = _session(heart["int8"])
    batch = s.run(None, {"features": x})[0].reshape(-1)
    ref = run_reference(heart["int8"], {"features": x})[0].reshape(-1)
    np.testing.assert_allclose(batch, ref, rtol=0, atol=1e-5)
    single = np.array([s.run(None, {"features": x[i:i + 1]})[0][0, 0] for i in range(len(x))])
    np.testing.assert_allclose(single, batch, rtol=0, atol=1e-6)


def test_kind_int8_weights_use_7_bits_and_keep_accuracy(heart):
    m = onnx.load_from_string(heart["int8"])
    w = [numpy_helper.to_array(i) for i in m.graph.initializer if i.data_type == TensorProto.INT8]
    assert w and all(int(np.abs(a).max()) <= WEIGHT_QMAX == 63 for a in w)
    assert "MatMulInteger" in {n.op_type for n in m.graph.node}
    y = np.concatenate([p.y_test for p in load_partitions()])
    x = heart["x_test"]
    acc = {k: float(np.mean((_session(heart[k]).run(None, {"features": x})[0].reshape(-1) >= 0.5) == (y >= 0.5)))
           for k in ("fp32", "int8")}
    assert acc["int8"] >= acc["fp32"] - 0.01  # the release gate's rule, on the same rows


def test_kind_int8_quantises_matmul_and_gemm_variants():
    """Gemm with transB/alpha/beta and a bare MatMul: the quantised graph equals the float
    graph up to the quantisation step, and equals the NumPy reference tightly."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(3, 5)).astype(np.float32)  # (M, K) for transB=1
    w2 = rng.normal(size=(3, 2)).astype(np.float32)
    b = rng.normal(size=(3,)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["h"], transB=1, alpha=0.5, beta=2.0),
         helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "W2"], ["y"])],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B"), numpy_helper.from_array(w2, "W2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    fp32 = model.SerializeToString()
    q = quantize_int8(fp32)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    want = np.maximum(0.5 * x @ w.T + 2.0 * b, 0) @ w2
    got = _session(q).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, run_reference(q, {"x": x})[0], rtol=0, atol=1e-5)
    assert np.max(np.abs(got - want)) < 0.05 * np.max(np.abs(want))
    assert sum(n.op_type == "MatMulInteger" for n in onnx.load_from_string(q).graph.node) == 2


def test_feature_ranges_contain_every_row_of_the_source_data():
    from sealfl.enclave.device.inputs import check_rows, parse_input_spec

    spec = parse_input_spec({"name": "features", "features": list(FEATURE_SPEC)})
    for p in load_partitions():
        check_rows(spec, p.x_train)
        check_rows(spec, p.x_test)
