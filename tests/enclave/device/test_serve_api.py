"""The device API's request checks as pure functions over body bytes: every parameter with
every wrong JSON type, every out-of-range value, truncated and oversized bodies, unknown
and unsupported parameters -- each refused with OpenAI's error body naming the parameter;
and the context check."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sealfl.enclave.device.serve.openai_api import (
    APILimits,
    APIRequestError,
    fit_context,
    parse_chat_request,
    parse_completion_request,
)
from sealfl.enclave.errors import EnclaveError

CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.5,
        "top_p": 0.9, "stop": ["\n"], "seed": 3, "stream": True, "stream_options": {"include_usage": True}}
COMPLETION = {"model": "tiny-llm", "prompt": "A list", "max_tokens": 8, "temperature": 0.0, "top_p": 1.0,
              "stop": "x", "seed": 0, "stream": False}

# JSON values of every type; a field's valid types are removed per field below.
JSON_VALUES = {"null": None, "boolean": True, "integer": 7, "number": 0.5, "string": "s", "array": [1],
               "object": {"a": 1}}
# For each field: the JSON types it accepts (anything else must be refused, naming it).
CHAT_TYPES = {"model": {"null", "string"}, "messages": set(), "max_tokens": {"null", "integer"},
              "temperature": {"null", "integer", "number"}, "top_p": {"null", "number"},
              "stop": {"null", "string"}, "seed": {"null", "integer"}, "stream": {"null", "boolean"},
              "stream_options": {"null", "object"}}
COMPLETION_TYPES = {"prompt": {"string"}, **{k: v for k, v in CHAT_TYPES.items() if k not in ("messages",
                                                                                           "stream_options")}}


def _body(doc) -> bytes:
    return json.dumps(doc).encode()


def _refused(parse, doc_or_bytes, param):
    body = doc_or_bytes if isinstance(doc_or_bytes, bytes) else _body(doc_or_bytes)
    with pytest.raises(APIRequestError) as err:
        parse(body)
    e = err.value
    assert isinstance(e, EnclaveError)  # the package's error hierarchy
    assert e.status == 400 and e.param == param, (e.param, str(e))
    assert e.body() == {"error": {"message": str(e), "type": "invalid_request_error", "param": param,
                                  "code": e.code}}
    return e


def test_kind_valid_requests_are_accepted_with_their_values():
    r = parse_chat_request(_body(CHAT))
    assert (r.kind, r.model, r.max_tokens, r.temperature, r.top_p, r.stop, r.seed, r.stream, r.include_usage) == \
        ("chat", "tiny-llm", 8, 0.5, 0.9, ("\n",), 3, True, True)
    assert r.messages == ({"role": "user", "content": "hi"},)
    c = parse_completion_request(_body(COMPLETION))
    assert (c.prompt, c.stop, c.temperature, c.max_tokens) == ("A list", ("x",), 0.0, 8)
    # OpenAI defaults: temperature 1, top_p 1, completions max_tokens 16, seed drawn by the server
    d = parse_completion_request(b'{"prompt": [1, 2, 3]}')
    assert (d.prompt, d.temperature, d.top_p, d.max_tokens, d.default_max_tokens, d.seed) == (
        (1, 2, 3), 1.0, 1.0, None, 16, None)
    parts = parse_chat_request(_body({"messages": [{"role": "developer", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}))
    assert parts.messages == ({"role": "system", "content": "ab"},)


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(sorted(CHAT_TYPES)), kind=st.sampled_from(sorted(JSON_VALUES)))
def test_kind_every_chat_field_with_every_wrong_json_type_is_refused_by_name(field, kind):
    if kind in CHAT_TYPES[field]:
        return
    doc = {**CHAT, field: JSON_VALUES[kind]}
    # an array of strings (stop) or of messages is valid; an array of integers names its item
    _refused(parse_chat_request, doc, f"{field}[0]" if field in ("stop", "messages") and kind == "array" else field)


@settings(max_examples=120, deadline=None)
@given(field=st.sampled_from(sorted(COMPLETION_TYPES)), kind=st.sampled_from(sorted(JSON_VALUES)))
def test_kind_every_completion_field_with_every_wrong_json_type_is_refused_by_name(field, kind):
    if kind in COMPLETION_TYPES[field] or (field == "prompt" and kind == "array"):  # [1] is a token-id prompt
        return
    doc = {**COMPLETION, field: JSON_VALUES[kind]}
    _refused(parse_completion_request, doc, "stop[0]" if field == "stop" and kind == "array" else field)


@settings(max_examples=100, deadline=None)
@given(field=st.sampled_from(["role", "content", "name"]), kind=st.sampled_from(sorted(JSON_VALUES)))
def test_kind_every_message_field_with_every_wrong_json_type_is_refused_by_name(field, kind):
    if kind == "string" or (field == "content" and kind == "array"):
        return
    msg = {"role": "user", "content": "hi", field: JSON_VALUES[kind]}
    param = f"messages[1].{field}"
    if field == "content" and kind == "array":
        param += "[0]"
    _refused(parse_chat_request, {**CHAT, "messages": [{"role": "system", "content": "s"}, msg]}, param)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.01), ("temperature", 2.01), ("temperature", 1e308),
    ("top_p", 0), ("top_p", 1.0001), ("top_p", -1),
    ("max_tokens", 0), ("max_tokens", 4097), ("max_tokens", 10**18), ("max_tokens", -5),
    ("seed", -1), ("seed", 2**63),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", ""), ("stop", "x" * 257),
    ("messages", []), ("model", "m" * 257),
])
def test_kind_out_of_range_values_are_refused_by_name(field, value):
    e = _refused(parse_chat_request, {**CHAT, field: value}, field)
    assert e.code in ("out_of_range", "invalid_value")


@pytest.mark.parametrize("message,param", [
    ({"role": "wizard", "content": "x"}, "messages[0].role"),
    ({"content": "x"}, "messages[0].role"),
    ({"role": "user"}, "messages[0].content"),
    ({"role": "user", "content": []}, "messages[0].content"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content[0]"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
    ("just text", "messages[0]"),
])
def test_kind_malformed_messages_are_refused_by_name(message, param):
    _refused(parse_chat_request, {"messages": [message]}, param)


@pytest.mark.parametrize("field,value", [("n", 2), ("logprobs", True), ("tools", [{"type": "function"}]),
                                         ("presence_penalty", 0.5), ("frequency_penalty", 1),
                                         ("response_format", {"type": "json_object"}), ("logit_bias", {"1": 5}),
                                         ("functions", []), ("best_of", 1), ("nonsense", 1)])
def test_kind_unsupported_or_unknown_parameters_are_refused_by_name(field, value):
    e = _refused(parse_chat_request, {**CHAT, field: value}, field)
    assert e.code in ("unsupported_value", "unrecognized_parameter")
    # the no-op values OpenAI clients may send are accepted
    parse_chat_request(_body({**CHAT, "n": 1, "presence_penalty": 0, "logprobs": False, "user": "u"}))


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(min_value=0, max_value=len(_body(CHAT)) - 1))
def test_kind_truncated_json_is_refused_as_the_body(cut):
    e = _refused(parse_chat_request, _body(CHAT)[:cut], "body")
    assert e.code == "invalid_json"


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b'{"messages": NaN}', b'{"a": 1, "a": 2}', b"\xff\xfe{}",
                                  b'{"messages": [{"role": "user", "content": "x"}]} trailing'])
def test_kind_bodies_that_are_not_one_strict_json_object_are_refused(body):
    _refused(parse_chat_request, body, "body")


def test_kind_a_body_over_the_cap_is_refused_before_parsing():
    limits = APILimits(max_body_bytes=100)
    body = _body({"messages": [{"role": "user", "content": "x" * 200}]})
    with pytest.raises(APIRequestError) as err:
        parse_chat_request(body, limits)
    assert err.value.param == "body" and err.value.code == "request_too_large"
    with pytest.raises(APIRequestError) as err:  # not JSON either: the size is checked first
        parse_chat_request(b"{" * 101, limits)
    assert err.value.code == "request_too_large"


def test_kind_prompts_beyond_the_context_are_refused():
    chat = parse_chat_request(_body({"messages": [{"role": "user", "content": "x"}]}))
    assert fit_context(chat, 10, 64) == 54  # no max_tokens: the default cap (256), or what the context has left
    with pytest.raises(APIRequestError) as err:
        fit_context(chat, 64, 64)
    assert err.value.param == "messages" and err.value.code == "context_length_exceeded"
    capped = parse_chat_request(_body({"messages": [{"role": "user", "content": "x"}], "max_tokens": 55}))
    with pytest.raises(APIRequestError) as err:
        fit_context(capped, 10, 64)
    assert err.value.param == "max_tokens" and "at most 54" in str(err.value)
    ids = parse_completion_request(b'{"prompt": [1, 400]}')
    with pytest.raises(APIRequestError) as err:
        fit_context(ids, 2, 64, vocab_size=400, prompt_ids=ids.prompt)
    assert err.value.param == "prompt[1]"
    assert fit_context(ids, 2, 64, vocab_size=401, prompt_ids=ids.prompt) == 16


def test_kind_a_request_without_max_tokens_gets_the_documented_default_cap():
    one = _body({"messages": [{"role": "user", "content": "x"}]})
    assert fit_context(parse_chat_request(one), 10, 2048) == 256  # not the 2,038 tokens left in the context
    assert fit_context(parse_chat_request(one, APILimits(default_max_tokens=40)), 10, 2048) == 40
    asked = parse_chat_request(_body({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1500}))
    assert fit_context(asked, 10, 2048) == 1500  # a request may ask for more, up to the context
    completion = parse_completion_request(b'{"prompt": "x"}')
    assert fit_context(completion, 10, 2048) == 16 and fit_context(completion, 60, 64) == 4  # capped, not refused


@pytest.mark.parametrize("raw, param", [
    (rb'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
    (rb'{"messages": [{"role": "\udfffuser", "content": "x"}]}', "messages[0].role"),
    (rb'{"messages": [{"role": "user", "content": "x"}], "stop": "\udbff"}', "stop"),
    (rb'{"messages": [{"role": "user", "content": "x"}], "user": "\ud800"}', "user"),
])
def test_kind_strings_that_are_not_unicode_text_are_refused_by_name(raw, param):
    e = _refused(parse_chat_request, raw, param)
    assert e.code == "invalid_value" and "Unicode" in str(e)
    e = _refused(parse_completion_request, b'{"prompt": "ok\\ud800"}', "prompt")
    assert parse_chat_request(rb'{"messages": [{"role": "user", "content": "\ud83d\ude00"}]}').messages[0][
        "content"] == "\U0001F600"  # a surrogate *pair* is one character


class _Client:
    """A waiting client: calling it gives what returns once it disconnected (``gone.set()``)."""

    def __init__(self):
        import asyncio

        self.gone = asyncio.Event()

    def __call__(self):
        return self.gone.wait()


def test_kind_the_slot_queue_is_bounded_first_come_first_served_and_times_out():
    import asyncio

    from sealfl.enclave.device.serve.metrics import ServeMetrics
    from sealfl.enclave.device.serve.state import ReleaseInfo, ServeState, SlotQueue

    async def scenario():
        state = ServeState(1, ServeMetrics(1), queue_size=2, queue_timeout_s=0.3)
        state.ready(ReleaseInfo("m", 1, "00" * 32, "int4"), [object()], 64)
        q = SlotQueue(state, asyncio.get_running_loop())
        slot, why = await q.acquire(_Client())
        assert slot is not None and why == ""
        first, second, gone = _Client(), _Client(), _Client()
        t1 = asyncio.ensure_future(q.acquire(first))
        t2 = asyncio.ensure_future(q.acquire(second))
        await asyncio.sleep(0)  # both are queued now (the loop ran them up to their wait)
        assert await q.acquire(_Client()) == (None, "busy")  # the queue of 2 is full
        state.release_slot(slot)
        got, _ = await t1  # the first to wait gets the slot
        assert got is slot and not t2.done()
        t3 = asyncio.ensure_future(q.acquire(gone))
        await asyncio.sleep(0)
        gone.gone.set()  # this client disconnects while waiting
        assert await t3 == (None, "gone")
        assert await t2 == (None, "queue_timeout")  # it waited 0.3 s
        state.release_slot(got)
        assert (await q.acquire(_Client()))[0] is slot  # nothing leaked: the slot is free again
        assert state.metrics.waiting._value.get() == 0

    asyncio.run(scenario())
