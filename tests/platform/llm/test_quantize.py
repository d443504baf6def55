"""INT4/INT8 of the causal LM: Q4_1 blocks survive exactly, onnxruntime computes what the
NumPy form says, integer kernels do not saturate at the range ends on this CPU, and the
quantised graph keeps the export's contract (checked against torch)."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from sealfl.enclave.sandbox.decode import KVDecoder
from sealfl.platform.llm.quantize import (
    BLOCK,
    QuantizeError,
    dequantize_asym_blocks,
    dequantize_sym8_blocks,
    quantize_asym_blocks,
    quantize_llm,
    quantize_sym8_blocks,
)
from tests.support.llm_tiny import HEAD_DIM, TEXTS, encode, tiny_bundle, tiny_fp32_onnx, torch_logits


def _q4_1_weight(rng, k=96, n=24):
    """A weight whose every block of 32 lies on a Q4_1 grid d*q + m using all of 0 and 15
    (what llama.cpp's quantize_row_q4_1 produces), like the GGUF base model's layers."""
    d = rng.uniform(0.001, 0.05, size=(n, k // BLOCK, 1)).astype(np.float32)
    m = rng.uniform(-0.5, 0.1, size=(n, k // BLOCK, 1)).astype(np.float32)
    q = rng.integers(0, 16, size=(n, k // BLOCK, BLOCK))
    q[..., 0], q[..., 1] = 0, 15
    return (q * d + m).astype(np.float32).reshape(n, k).T.copy()


def test_kind_q4_1_blocks_survive_int4_quantisation():
    w = _q4_1_weight(np.random.default_rng(0))
    q, d, m = quantize_asym_blocks(w, 4)
    back = dequantize_asym_blocks(q, d, m)
    np.testing.assert_allclose(back, w, rtol=0, atol=np.abs(w).max() * 2e-6)
    q8, d8, m8 = quantize_asym_blocks(w, 8)  # the int8 grid holds the Q4_1 grid exactly: q8 = 17 q4
    np.testing.assert_array_equal(q8, q.astype(np.int32) * 17)
    np.testing.assert_allclose(dequantize_asym_blocks(q8, d8, m8), w, rtol=0, atol=np.abs(w).max() * 2e-6)


def test_kind_q8_0_blocks_survive_the_8bit_head():
    rng = np.random.default_rng(1)
    d = rng.uniform(0.001, 0.02, size=(16, 2, 1)).astype(np.float32)
    q = rng.integers(-127, 128, size=(16, 2, BLOCK))
    q[..., 0] = 127
    w = (q * d).astype(np.float32).reshape(16, 64).T.copy()
    qq, dd = quantize_sym8_blocks(w)
    np.testing.assert_array_equal(qq.astype(np.int32) - 128, q)
    np.testing.assert_allclose(dequantize_sym8_blocks(qq, dd), w, rtol=0, atol=1e-7)


@pytest.mark.parametrize("bad", [np.zeros((33, 4)), np.zeros(32), np.full((32, 2), np.nan)])
def test_kind_unquantisable_weights_are_refused(bad):
    with pytest.raises(QuantizeError):
        quantize_asym_blocks(bad, 4)


def _one_matmul(w, scheme):
    k, n = w.shape
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["logits"], name="lm_head/MatMul"),
                           helper.make_node("MatMul", ["x", "W2"], ["h"], name="body/MatMul"),
                           helper.make_node("Gather", ["E", "input_ids"], ["emb"], name="embed/Gather")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k]),
                                helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["m"])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("logits", "h", "emb")],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w, "W2"),
                           numpy_helper.from_array(np.ascontiguousarray(w.T), "E")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(quantize_llm(model, scheme), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_kind_onnxruntime_computes_the_quantised_form(scheme):
    """Body: x @ (d*q + m) via MatMulNBits + block-min term; head: x @ (d*q8); embedding rows.
    accuracy_level 4 quantises x per block of 32 to int8, so allow that error (1/127 of a
    block's max |x| per term); a lost block minimum would be off by ~|x| * |m| * 32."""
    rng = np.random.default_rng(2)
    w = _q4_1_weight(rng)
    sess = _one_matmul(w, scheme)
    x = rng.normal(size=(5, w.shape[0])).astype(np.float32)
    ids = np.array([0, 3, 23], np.int64)
    logits, h, emb = sess.run(["logits", "h", "emb"], {"x": x, "input_ids": ids})
    exact = x.astype(np.float64) @ w.astype(np.float64)
    bound = np.abs(x).max() / 127 * np.abs(w).sum(axis=0).max()
    assert np.abs(h - exact).max() <= bound
    assert np.abs(logits - exact).max() <= bound
    qq, dd = quantize_sym8_blocks(w)
    np.testing.assert_allclose(emb, dequantize_sym8_blocks(qq, dd).T[ids], rtol=0, atol=1e-6)
    # a row's answer does not depend on the other rows of the batch (per-row activation scales)
    rows = np.concatenate([sess.run(["h"], {"x": x[i:i + 1], "input_ids": ids})[0] for i in range(len(x))])
    np.testing.assert_allclose(rows, h, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("default_zp", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_kind_integer_kernels_do_not_saturate_at_the_range_ends(bits, default_zp):
    """Weights at both ends of their range times activations at +-max: the pairwise sums an
    AVX2 (no VNNI) kernel forms would overflow int16 if it did not widen. Exact integers --
    with the zero point given, and left to its default (2^(bits-1), the centred form the
    release graph uses since v2: onnxruntime may take another kernel path for it)."""
    k, n = 64, 4
    qmax = 2**bits - 1
    for fill in (0, qmax):
        q = np.full((n, k // BLOCK, BLOCK), fill, np.uint8)
        blob = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8) if bits == 4 else q
        zp_val = (qmax + 1) // 2
        zp = np.full((n, k // BLOCK), zp_val, np.uint8)
        if bits == 4:
            zp = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)
        node = helper.make_node("MatMulNBits", ["A", "B", "S"] + ([] if default_zp else ["Z"]), ["Y"],
                                domain="com.microsoft", K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=4)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", n])],
                              [numpy_helper.from_array(blob, "B"),
                               numpy_helper.from_array(np.ones(n * k // BLOCK, np.float32), "S")]
                              + ([] if default_zp else [numpy_helper.from_array(zp.reshape(-1), "Z")]))
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        a = np.array([[127.0] * k, [-127.0] * k, [127.0, -127.0] * (k // 2)], np.float32)
        y = sess.run(None, {"A": a})[0]
        exact = a.astype(np.float64) @ np.full((k, n), fill - zp_val, np.float64)
        np.testing.assert_array_equal(y, exact)


@pytest.mark.parametrize("scheme,tol", [("int4", 0.5), ("int8", 0.1)])
def test_kind_quantised_export_keeps_the_graph_contract(scheme, tol):
    """The tiny model's export, quantised, decodes with the KV cache like torch's float32
    model (top-1 of every position; logits within the quantisation error)."""
    b = tiny_bundle()
    ids = encode(TEXTS[0] + " " + TEXTS[1])
    ref = torch_logits(b.model, ids)
    fp32 = ort.InferenceSession(tiny_fp32_onnx(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(KVDecoder(fp32, head_dim=HEAD_DIM).teacher_forced(ids, 4), ref, atol=1e-4)
    q = ort.InferenceSession(quantize_llm(tiny_fp32_onnx(), scheme), providers=["CPUExecutionProvider"])
    got = KVDecoder(q, head_dim=HEAD_DIM).teacher_forced(ids, 4)
    assert np.abs(got - ref).max() < tol
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.9


def test_kind_a_graph_without_logits_is_not_quantised():
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                          [numpy_helper.from_array(np.ones((32, 4), np.float32), "W")])
    with pytest.raises(QuantizeError, match="logits"):
        quantize_llm(helper.make_model(g), "int4")
    with pytest.raises(QuantizeError, match="scheme"):
        quantize_llm(helper.make_model(g), "int3")


@pytest.mark.parametrize("scheme", ["fp32", "int4", "int8"])
def test_kind_last_position_logits_equal_the_last_row_of_all_positions(scheme):
    """``logits_start`` (sealfl.platform.llm.head): not fed, the graph returns every
    position (the gate's scoring); fed [-1], one row -- torch's last row for fp32, and the
    last row of the all-positions run for the quantised graphs (the head works row by row),
    with the KV cache continuing identically after either."""
    b = tiny_bundle()
    ids = encode(TEXTS[1] + " " + TEXTS[0])
    ref = torch_logits(b.model, ids)
    model = tiny_fp32_onnx() if scheme == "fp32" else quantize_llm(tiny_fp32_onnx(), scheme)
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    assert "logits_start" in [i.name for i in sess.get_inputs()]
    full, last = KVDecoder(sess, head_dim=HEAD_DIM), KVDecoder(sess, head_dim=HEAD_DIM)
    all_rows = full.feed(ids[:-1])
    one_row = last.feed(ids[:-1], last_only=True)
    assert all_rows.shape == (len(ids) - 1, ref.shape[1]) and one_row.shape == (1, ref.shape[1])
    scale = float(np.abs(all_rows).max())
    np.testing.assert_allclose(one_row[0], all_rows[-1], atol=1e-4 * scale + 1e-6)
    if scheme == "fp32":
        np.testing.assert_allclose(one_row[0], ref[len(ids) - 2], atol=1e-4)
    np.testing.assert_allclose(last.feed(ids[-1:], last_only=True)[0], full.feed(ids[-1:])[0],
                               atol=1e-4 * scale + 1e-6)


def test_kind_an_adapted_layer_keeps_its_base_blocks_and_the_update_exact():
    """W = (Q4_1 base) + A @ B: with the low-rank terms the graph quantises only the base
    -- its blocks come back exactly -- and adds x @ A @ B in float32: the answer is x @ W
    within the int8-activation error of the base alone; re-quantising W at 4 bits instead
    loses the small update (measured against the same oracle)."""
    from onnx import load_from_string

    rng = np.random.default_rng(5)
    base = _q4_1_weight(rng)
    a = rng.normal(scale=0.05, size=(base.shape[0], 4)).astype(np.float32)
    b = rng.normal(scale=0.05, size=(4, base.shape[1])).astype(np.float32)
    w = (base.astype(np.float64) + a.astype(np.float64) @ b).astype(np.float32)
    k, n = w.shape
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["h"], name="body/MatMul"),
                           helper.make_node("MatMul", ["x", "H"], ["logits"], name="lm_head/MatMul"),
                           helper.make_node("Gather", ["E", "input_ids"], ["emb"], name="embed/Gather")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k]),
                                helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["m"])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("h", "logits", "emb")],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w, "H"),
                           numpy_helper.from_array(np.ascontiguousarray(w.T), "E")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    folded = quantize_llm(model, "int4", low_rank={"body/MatMul": (a, b)})
    inits = {i.name: numpy_helper.to_array(i) for i in load_from_string(folded).graph.initializer}
    q, d, m = quantize_asym_blocks(base, 4)
    assert np.array_equal(inits["body/MatMul/q/B"], (q[..., 0::2] | (q[..., 1::2] << 4)))  # the base's own blocks
    x = rng.normal(size=(6, k)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    bound = np.abs(x).max() / 127 * np.abs(base).sum(axis=0).max()

    def run(data):
        s = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        return s.run(["h"], {"x": x, "input_ids": np.array([0], np.int64)})[0]

    assert np.abs(run(folded) - exact).max() <= bound
    plain = run(quantize_llm(model, "int4"))  # W re-quantised at 4 bits: the update is mostly lost
    assert np.abs(run(folded) - exact).mean() < np.abs(plain - exact).mean() / 2
    with pytest.raises(QuantizeError, match="do not fit"):
        quantize_llm(model, "int4", low_rank={"body/MatMul": (a[:-1], b)})


def test_kind_the_build_maps_every_adapter_onto_its_exported_columns():
    """adapter_low_rank on the tiny model: every adapted module lands on a MatMul node whose
    columns equal the merged weight (checked inside), and A @ B equals the merged minus the
    un-merged weight of each module, in the export's x @ W layout."""
    from sealfl.clients.causal_lm.lora import LoraSpec, n_adapter_params
    from sealfl.clients.causal_lm.merge import merge_adapters
    from sealfl.platform.llm.build import adapter_low_rank
    from sealfl.platform.llm.export import export_fp32

    spec = LoraSpec(r=4, alpha=8)
    bundle = tiny_bundle()
    before = {n: p.detach().numpy().copy() for n, p in bundle.model.named_parameters()}
    vec = np.random.default_rng(0).normal(scale=0.05, size=n_adapter_params(bundle.model, spec))
    merged = merge_adapters(bundle.model, spec, vec)
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        proto = export_fp32(merged, bundle.tokenizer_json, bundle.chat_template, bundle.generation, work)
    terms = adapter_low_rank(merged, spec, vec, proto)
    layers = merged.config.num_hidden_layers
    assert sorted(terms) == [f"/model/layers.{i}/attn/qkv_proj/MatMul" for i in range(layers)]
    nq = merged.config.num_attention_heads * HEAD_DIM
    nk = merged.config.num_key_value_heads * HEAD_DIM
    for i in range(layers):
        a, b = terms[f"/model/layers.{i}/attn/qkv_proj/MatMul"]
        delta = a.astype(np.float64) @ b
        for proj, col, width in (("q_proj", 0, nq), ("k_proj", nq, nk), ("v_proj", nq + nk, nk)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            want = dict(merged.named_parameters())[name].detach().numpy().T - before[name].T
            np.testing.assert_allclose(delta[:, col:col + width], want, atol=2e-6)
