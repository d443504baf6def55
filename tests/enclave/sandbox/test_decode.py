"""The KV decoder's shared buffer (IOBinding) against plain onnxruntime runs with numpy
arrays: logits bit for bit, a graph that cannot share its buffer stays plain."""

import numpy as np
import onnxruntime as ort
import pytest

from sealfl.enclave.sandbox.decode import KVDecoder
from tests.support.llm_tiny import HEAD_DIM, TEXTS, encode, tiny_fp32_onnx


@pytest.fixture(scope="module")
def sess():
    return ort.InferenceSession(tiny_fp32_onnx(), providers=["CPUExecutionProvider"])


def _plain_greedy(sess, ids, n):
    """Greedy decode by hand: session.run with numpy arrays, presents fed back as pasts."""
    names = [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    past = {k: np.zeros((1, 2, 0, HEAD_DIM), np.float32) for k in names}
    outs = [o.name for o in sess.get_outputs()]
    rows, seq, total = [], list(ids), 0
    for _ in range(n + 1):
        total += len(seq)
        res = dict(zip(outs, sess.run(outs, {"input_ids": np.array([seq], np.int64),
                                            "attention_mask": np.ones((1, total), np.int64),
                                            "logits_start": np.array([-1], np.int64), **past})))
        past = {k: res[k.replace("past_key_values.", "present.")] for k in names}
        rows.append(res["logits"][0, -1])
        seq = [int(np.argmax(rows[-1]))]
    return rows


def test_kind_the_shared_buffer_gives_plain_onnxruntime_logits_bit_for_bit(sess):
    ids = encode(TEXTS[4])
    dec = KVDecoder(sess, max_context=64, head_dim=HEAD_DIM)
    assert dec.shared_buffer
    want = _plain_greedy(sess, ids, 20)
    got = [dec.feed(ids, last_only=True, copy=False)[-1].copy()]
    for _ in range(20):
        got.append(dec.feed([int(np.argmax(got[-1]))], last_only=True, copy=False)[-1].copy())
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    # every position (the gate's and the canary's scoring) and a second sequence after reset
    plain = KVDecoder(sess, max_context=64, head_dim=HEAD_DIM, io_binding=False)
    assert not plain.shared_buffer
    for text in TEXTS[:3]:
        seq = encode(text)
        assert np.array_equal(dec.teacher_forced(seq, 4), plain.teacher_forced(seq, 4))


def test_kind_rows_handed_out_with_copy_are_not_overwritten_by_the_next_step(sess):
    dec = KVDecoder(sess, max_context=64, head_dim=HEAD_DIM)
    ids = encode(TEXTS[0])
    first = dec.feed(ids, last_only=True)
    kept = first.copy()
    view = dec.feed([1], last_only=True, copy=False)
    assert np.array_equal(first, kept) and not np.array_equal(view, kept)
    with pytest.raises(ValueError, match="exceeds the limit"):
        dec.feed(list(range(3, 3 + 64)))


def _concat_graph():
    """A toy causal LM whose cache is a Concat (no in-place append) and whose logits depend
    on the mean over the whole past: a shared buffer would change them."""
    from onnx import TensorProto, helper, numpy_helper

    vocab, dim = 5, 2
    rng = np.random.default_rng(0)
    e, w = rng.normal(size=(vocab, dim)).astype(np.float32), rng.normal(size=(dim, vocab)).astype(np.float32)
    emb, head = numpy_helper.from_array(e, "emb"), numpy_helper.from_array(w, "head")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    kv = ["batch", 1, "past", dim]
    g = helper.make_graph(
        [helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
         helper.make_node("Unsqueeze", ["x", "axes"], ["x4"]),
         helper.make_node("Concat", ["past_key_values.0.key", "x4"], ["present.0.key"], axis=2),
         helper.make_node("Concat", ["past_key_values.0.value", "x4"], ["present.0.value"], axis=2),
         helper.make_node("ReduceMean", ["present.0.key"], ["ctx"], axes=[1, 2], keepdims=0),
         helper.make_node("Unsqueeze", ["ctx", "axes"], ["ctx3"]),
         helper.make_node("Add", ["x", "ctx3"], ["h"]),
         helper.make_node("MatMul", ["h", "head"], ["logits"])],
        "toy",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
         helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, kv),
         helper.make_tensor_value_info("past_key_values.0.value", TensorProto.FLOAT, kv)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab]),
         helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, ["batch", 1, "total", dim]),
         helper.make_tensor_value_info("present.0.value", TensorProto.FLOAT, ["batch", 1, "total", dim])],
        [emb, head, axes])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(), e, w


def test_kind_a_graph_that_cannot_share_its_buffer_is_decoded_plain():
    model, e, w = _concat_graph()
    s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    dec = KVDecoder(s, max_context=16)
    assert not dec.shared_buffer
    ids = [1, 3, 2, 4]
    got = dec.teacher_forced(ids, 2)
    # by hand: each call adds the mean embedding of every cached position (prefill: both)
    want = [(e[t] + e[ids[:n]].mean(0)) @ w for t, n in zip(ids, (2, 2, 3, 4))]
    np.testing.assert_allclose(got, np.array(want), rtol=1e-5, atol=1e-6)


def _reference_choice(logits, temperature, top_p, rng):
    """The token choice as written before the nucleus shortcut: softmax in float64, the
    full stable sort for the nucleus, numpy's choice -- the oracle."""
    x = np.asarray(logits, dtype=np.float64)
    p = np.exp((x - x.max()) / temperature)
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(p.size, p=p))


def test_kind_the_nucleus_shortcut_picks_what_the_full_sort_picks():
    """Peaked, flat and tied rows (rounded logits), many temperatures and top-p: the same
    nucleus as the full stable sort, and the same sampled token for the same seed as
    numpy's Generator.choice over the whole renormalised row (with top-p 1 too)."""
    from sealfl.enclave.sandbox.decode import SamplingParams, _nucleus, choose_token

    for i in range(600):
        r = np.random.default_rng(i)
        x = (r.standard_normal(int(r.integers(8, 5000))) * r.uniform(0.1, 5)).astype(np.float32)
        if i % 3 == 0:
            x[r.integers(0, x.size, 5)] += 12
        if i % 5 == 0:
            x = np.round(x)
        t, top_p = float(r.uniform(0.05, 2)), float(r.uniform(0.05, 0.999))
        p = np.exp((x.astype(np.float64) - x.max()) / t)
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        want = order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
        assert np.array_equal(_nucleus(p, top_p), want), i
        for p_cut in (top_p, 1.0):  # with a nucleus, and sampling from the whole softmax
            params = SamplingParams(temperature=t, top_p=p_cut, seed=i)
            assert choose_token(x, params, np.random.default_rng(i)) == _reference_choice(
                x, t, p_cut, np.random.default_rng(i)), (i, p_cut)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_kind_logits_that_are_not_finite_are_refused(bad):
    from sealfl.enclave.sandbox.decode import SamplingParams, choose_token

    x = np.zeros(1000, np.float32)
    x[517] = bad
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)):
        with pytest.raises(ValueError, match="not finite"):
            choose_token(x, params, np.random.default_rng(0))


_KV_PROBE = """
import numpy as np
from sealfl.enclave.sandbox.decode import _lazy_zeros
def rss_kib():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
junk = [bytearray(24 << 20) for _ in range(3)]  # freed big blocks raise malloc's mmap threshold
del junk
before = rss_kib()
kv = _lazy_zeros(60, (1, 3, 2048, 64))
assert kv.shape == (60, 1, 3, 2048, 64) and not kv.any()
kv[:, 0, :, :200, :] = 1.0  # 200 positions of every head
print(rss_kib() - before)
"""


def test_kind_kv_buffers_are_resident_only_where_written():
    """The shared KV buffers (SmolLM2's shape: 60 of (1, 3, 2048, 64) float32, 94 MB) cost
    resident memory only for the positions written -- in the child's malloc settings
    (huge pages) and after large heap blocks were freed, where numpy.zeros made all 94 MB
    resident at once (90 MiB measured)."""
    import os
    import subprocess
    import sys

    from sealfl.enclave.sandbox.runtime import CHILD_GLIBC_TUNABLES

    env = {**os.environ, "GLIBC_TUNABLES": CHILD_GLIBC_TUNABLES}
    out = subprocess.run([sys.executable, "-c", _KV_PROBE], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) < 20 * 1024, "KV buffers became resident beyond the written positions"
