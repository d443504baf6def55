"""The device's generation runtime on a tiny model: stop strings, max tokens, EOS, cancel,
seeds, streaming, the chat template as transformers renders it, and a child that holds
nothing but onnxruntime."""

import numpy as np
import pytest

from sealfl.enclave.sandbox.decode import KVDecoder, SamplingParams, choose_token
from sealfl.enclave.sandbox.llm_runtime import ChatTemplate, LLMRuntime, emit_limit
from tests.support.llm_tiny import HEAD_DIM, SMOL_TEMPLATE, TEXTS, encode, tiny_fp32_onnx, tokenizer_json

GEN = {"eos_token_ids": [2], "bos_token_id": 1, "pad_token_id": 2, "head_dim": HEAD_DIM, "max_context": 64,
       "special_tokens": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}}


@pytest.fixture(scope="module")
def rt():
    with LLMRuntime(tiny_fp32_onnx(), tokenizer_json(), SMOL_TEMPLATE, GEN, timeout_s=120) as r:
        yield r


def _no_eos(rt, **kw):
    """Sampling that never meets EOS on this prompt (checked), so limits are what stops it."""
    return SamplingParams(**kw)


def test_kind_generation_stops_at_max_tokens(rt):
    prompt = encode(TEXTS[1])
    for n in (1, 5, 12):
        r = rt.generate(prompt, SamplingParams(max_tokens=n))
        assert r.completion_tokens <= n and r.prompt_tokens == len(prompt)
        if 2 not in r.token_ids:
            assert r.completion_tokens == n and r.finish_reason == "length"


def test_kind_generation_stops_at_stop_strings(rt):
    prompt = encode(TEXTS[0])
    full = rt.generate(prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=3))
    text = full.text
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = text.find(stop)
    r = rt.generate(prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=3, stop=(stop, "\x00never")))
    assert r.text == text[:cut] and r.finish_reason == "stop"
    assert r.completion_tokens <= full.completion_tokens


def test_kind_generation_stops_at_eos(rt):
    prompt = encode(TEXTS[2])
    free = rt.generate(prompt, SamplingParams(max_tokens=8))
    third = free.token_ids[2]
    gen = {**GEN, "eos_token_ids": [third]}
    with LLMRuntime(tiny_fp32_onnx(), tokenizer_json(), SMOL_TEMPLATE, gen, timeout_s=120) as r2:
        res = r2.generate(prompt, SamplingParams(max_tokens=8))
    first_hit = free.token_ids.index(third)
    assert res.token_ids == free.token_ids[:first_hit + 1] and res.finish_reason == "stop"


def test_kind_streamed_pieces_join_to_the_answer_and_cancel_stops(rt):
    prompt = encode(TEXTS[3])
    pieces = []
    r = rt.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=11, stop=("zzz",)),
                    on_text=lambda p: pieces.append(p))
    assert "".join(pieces) == r.text
    got = []
    c = rt.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=11),
                    on_text=lambda p: (got.append(p), False)[1])
    assert c.finish_reason in ("cancelled", "stop", "length") and c.completion_tokens <= r.completion_tokens
    if c.finish_reason == "cancelled":
        assert c.completion_tokens < 20
    assert rt.generate(prompt, SamplingParams(max_tokens=3)).completion_tokens >= 1  # the runtime still works


def test_kind_unfinished_characters_and_stop_prefixes_are_held_back():
    # "é" is two UTF-8 bytes; after its first byte the tokenizer decodes U+FFFD
    assert emit_limit("caf\ufffd", done=False, hold=0) == 3
    assert emit_limit("caf\ufffd", done=True, hold=0) == 4
    assert emit_limit("hello wor", done=False, hold=3) == 6  # "wor" could start the stop string "world"
    assert emit_limit("ab", done=False, hold=5) == 0
    tok = __import__("tokenizers").Tokenizer.from_str(tokenizer_json().decode())
    ids = tok.encode("café", add_special_tokens=False).ids
    partial = [tok.decode(ids[:i]) for i in range(1, len(ids) + 1)]
    assert partial[-1] == "café"
    assert all(p[:emit_limit(p, False, 0)] == "café"[:emit_limit(p, False, 0)] for p in partial)


def test_kind_same_seed_same_text_other_seed_other_text(rt):
    prompt = encode(TEXTS[4])
    a = rt.generate(prompt, SamplingParams(max_tokens=16, temperature=1.5, top_p=0.95, seed=5))
    b = rt.generate(prompt, SamplingParams(max_tokens=16, temperature=1.5, top_p=0.95, seed=5))
    others = {tuple(rt.generate(prompt, SamplingParams(max_tokens=16, temperature=1.5, top_p=0.95, seed=s)).token_ids)
              for s in (6, 7, 8)}
    assert a.token_ids == b.token_ids
    assert others - {tuple(a.token_ids)}


def test_kind_top_p_keeps_only_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    picks = {choose_token(logits, SamplingParams(temperature=1.0, top_p=0.7), rng) for _ in range(300)}
    assert picks == {0, 1}
    assert choose_token(logits, SamplingParams(), rng) == 0
    with pytest.raises(ValueError):
        choose_token(np.array([1.0, np.nan]), SamplingParams(), rng)


@pytest.mark.parametrize("bad", [{"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0},
                                 {"top_p": 1.5}, {"max_tokens": 0}, {"max_tokens": 10**6}, {"max_tokens": True},
                                 {"seed": -1}, {"stop": ("",)}, {"stop": tuple("abcdefghi")}])
def test_kind_sampling_parameters_out_of_range_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_kind_prompt_beyond_the_context_is_refused(rt):
    with pytest.raises(ValueError, match="context"):
        rt.generate(list(range(3, 70)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        rt.generate([], SamplingParams())


def test_kind_chat_template_renders_as_transformers_does():
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(
        tokenizer_json().decode()), bos_token="<|im_start|>", eos_token="<|im_end|>")
    hf.chat_template = SMOL_TEMPLATE
    ours = ChatTemplate(SMOL_TEMPLATE, GEN["special_tokens"])
    for msgs in ([{"role": "user", "content": "What is a list?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "ünïcode {{ x }}"}]):
        for gen_prompt in (True, False):
            assert ours.render(msgs, gen_prompt) == hf.apply_chat_template(msgs, tokenize=False,
                                                                           add_generation_prompt=gen_prompt)
    with pytest.raises(ValueError):
        ours.render([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ValueError, match="refused"):
        ChatTemplate("{{ raise_exception('no') }}").render([{"role": "user", "content": "x"}])


def test_kind_the_child_holds_only_onnxruntime(rt):
    # the runtime refuses a child that imported torch/tenseal/flwr/tokenizers/sealfl; here it
    # started, and it has a pid of its own
    assert rt.alive and rt.health_check()["pid"] == rt.pid


def test_kind_generated_tokens_equal_a_plain_onnxruntime_decode(rt):
    """The child's streamed decode (shared KV buffer, argmax on float32) against a decode by
    hand in this process: numpy arrays in and out, no binding, no child."""
    import onnxruntime as ort

    plain = KVDecoder(ort.InferenceSession(tiny_fp32_onnx(), providers=["CPUExecutionProvider"]),
                      max_context=64, head_dim=HEAD_DIM, io_binding=False)
    for text in TEXTS[:3]:
        ids = encode(text)
        for params in (SamplingParams(max_tokens=14), SamplingParams(max_tokens=14, temperature=1.2, seed=4)):
            rng, want = np.random.default_rng(params.seed), []
            plain.reset()
            logits = plain.feed(ids, last_only=True)[-1]
            while len(want) < params.max_tokens:
                tok = int(np.argmax(logits)) if params.temperature == 0 else choose_token(logits, params, rng)
                want.append(tok)
                if tok == 2:
                    break
                logits = plain.feed([tok], last_only=True)[-1]
            r = rt.generate(ids, params)
            assert r.token_ids == want and r.text == rt.decode(want)


def test_kind_the_child_streams_without_waiting_and_answers_each_stop_once(rt):
    child, ids = rt._child, encode(TEXTS[1])
    greedy = SamplingParams(max_tokens=6).to_dict()
    child.post({"op": "generate", "prompt": ids, "params": greedy, "stop_ids": []})
    # nothing is sent back: a child that waited between tokens would send one and time out
    replies = [child.receive() for _ in range(6)]
    assert [x["last"] for x in replies] == [False] * 5 + [True]
    child.post({"op": "stop"})  # after the last token: answered once, the pipe stays in step
    assert child.receive() == {"ok": True, "stopped": True, "nblobs": 0}
    child.post({"op": "generate", "prompt": ids, "params": SamplingParams(max_tokens=50).to_dict(), "stop_ids": []})
    child.post({"op": "stop"})
    seen = []
    while not (x := child.receive()).get("stopped"):
        seen.append(x)
    assert len(seen) <= 50 and all("token" in x for x in seen)
    cancelled = rt.generate(ids, SamplingParams(max_tokens=20), on_text=lambda piece: False)
    assert cancelled.finish_reason == "cancelled" and cancelled.completion_tokens < 20
    assert rt.generate(ids, SamplingParams(max_tokens=6)).token_ids == [x["token"] for x in replies]


def test_kind_a_callback_that_raises_ends_the_stream_and_the_next_request_is_unaffected(rt):
    ids, greedy = encode(TEXTS[2]), SamplingParams(max_tokens=10)
    want = rt.generate(ids, greedy).token_ids

    def boom(piece):
        raise KeyError("client went away")

    with pytest.raises(KeyError):
        rt.generate(ids, SamplingParams(max_tokens=40), on_text=boom)
    assert rt.alive and rt.generate(ids, greedy).token_ids == want


def test_kind_the_model_crosses_on_its_own_pipe_never_as_a_blob(monkeypatch):
    """init names the model pipe and carries no blob (the child never holds the model as a
    bytes object; onnxruntime reads the pipe as a file), and the model it loads is the one
    written: its logits equal a direct onnxruntime decode's (test above)."""
    from sealfl.enclave.sandbox import runtime as runtime_module

    sent = []
    real = runtime_module.SandboxedRuntime._request

    def spy(self, header, blobs, timeout):
        sent.append((dict(header), len(blobs)))
        return real(self, header, blobs, timeout)

    monkeypatch.setattr(runtime_module.SandboxedRuntime, "_request", spy)
    model = tiny_fp32_onnx()
    with LLMRuntime(model, tokenizer_json(), SMOL_TEMPLATE, GEN, timeout_s=120, intra_op_threads=1) as r:
        assert r.generate(encode(TEXTS[0]), SamplingParams(max_tokens=3)).completion_tokens == 3
    init = [(h, n) for h, n in sent if h.get("op") == "init"]
    assert init == [({"op": "init", "model_pipe": len(model)}, 0)]


def test_kind_a_model_that_does_not_parse_is_refused_promptly():
    """A corrupt model: the child's onnxruntime fails mid-pipe, replies, exits; the writer
    sees the closed pipe -- the refusal comes at once, not after the start timeout."""
    import time

    from sealfl.enclave.errors import RuntimeSandboxError

    t0 = time.monotonic()
    with pytest.raises(RuntimeSandboxError, match="could not load the model"):
        LLMRuntime(b"\x08\x07" + b"\xff" * (4 << 20), tokenizer_json(), SMOL_TEMPLATE, GEN, start_timeout_s=100,
                   intra_op_threads=1)
    assert time.monotonic() - t0 < 60
