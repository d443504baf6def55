"""``sealfl device serve`` against the running server on a free loopback port (started and
stopped by pid), with the official ``openai`` client: a tiny randomly initialised Llama
packaged as a signed release. Plain and streamed chat (joined stream == plain answer),
usage counts equal the tokenizer's, stop sequences, 400 per invalid kind, 429 beyond
--max-concurrent while a paused request holds the slot, a disconnect frees the slot,
/health 503 before load, /metrics, a tampered release never served, and SIGINT/SIGTERM
leave no child behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai  # the official client (dev extra): missing, the module fails instead of skipping
import pytest

from sealfl.common.testpoints import ENV_DIR, ENV_STAGE, event_path
from tests.support.llm_tiny import SMOL_TEMPLATE, tokenizer_json, write_tiny_release
from tests.support.serve import DEADLINE_S, Server, _children, _gone, _wait

MESSAGES = [{"role": "user", "content": "What is a list?"}]


@pytest.fixture(scope="module")
def release_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    write_tiny_release(root)
    return root


@pytest.fixture(scope="module")
def server(release_root, tmp_path_factory):
    s = Server(release_root, tmp_path_factory.mktemp("serve-a"))
    s.wait_ready()
    yield s
    s.kill()


def test_kind_the_inference_protocol_is_not_ready_for_a_language_model(server):
    r = httpx.get(server.url + "/v2/health/ready", timeout=DEADLINE_S)
    assert r.status_code == 503 and r.json() == {"ready": False}
    infer = httpx.post(server.url + "/v2/models/tiny-llm/infer", json={"inputs": []}, timeout=DEADLINE_S)
    assert infer.status_code == 503 and "/v1" in infer.json()["error"]

def test_kind_generation_requests_are_logged_with_counts_and_never_the_prompt(server):
    prompt = "Tell me about the zebra-striped access log canary"
    server.client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=3, seed=0)
    text = server.log.read_text()
    line = [ln for ln in text.splitlines() if "path=/v1/chat/completions status=200" in ln][-1]
    fields = dict(kv.split("=", 1) for kv in line.split()[2:])  # after the date and time
    assert fields["method"] == "POST" and int(fields["prompt_tokens"]) > 5 and fields["completion_tokens"] == "3"
    assert 0 < float(fields["ttft_ms"]) <= float(fields["total_ms"])
    assert "zebra" not in text

def test_kind_health_models_and_plain_chat_name_the_verified_release(server, release_root):
    h = server.health().json()
    state = json.loads((server.port_file.parent / "state" / "state.json").read_text())
    assert h["status"] == "ok" and h["release"]["name"] == "tiny-llm" and h["release"]["version"] == 1
    assert h["release"]["root_digest"] == state["last_good"]["root_digest"]
    from sealfl.enclave.device.evidence import device_public_key

    ak = device_public_key(server.port_file.parent / "state")
    from sealfl.attestation.keys import keyid, load_public_key

    assert h["tee"] == {"backend": "sim", "insecure": True, "ak_keyid": keyid(load_public_key(ak))}
    models = server.client.models.list().data
    assert [m.id for m in models] == ["tiny-llm"]
    r = server.client.chat.completions.create(model="tiny-llm", messages=MESSAGES, max_tokens=6, seed=1)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 6


@pytest.mark.parametrize("bad", ["", "a", "abc", "zz" * 4, "00" * 65, "aa b", "0x" + "00" * 4])
def test_kind_attestation_nonce_that_is_not_1_to_64_hex_bytes_gets_400(server, bad):
    r = httpx.get(server.url + "/attestation", params={"nonce": bad}, timeout=DEADLINE_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "nonce", r.text


def test_kind_attestation_endpoint_evidence_verifies_for_its_nonce_only(server, release_root):
    """GET /attestation on the serving device: the evidence verifies with the device's AK
    for the verifier's nonce against a policy built here from independent measurements
    (this process's hash of the runtime code, the trust directory, the served root), and
    fails for any other nonce (a replay)."""
    from sealfl.attestation.errors import QuoteError
    from sealfl.attestation.eventlog import POLICY_SCHEMA, parse_policy, verify_evidence
    from sealfl.attestation.keys import load_public_key
    from sealfl.enclave.device.evidence import device_public_key, measure_config
    from sealfl.enclave.measurement import measure_device_runtime

    state = server.port_file.parent / "state"
    root = server.health().json()["release"]["root_digest"]
    nonce = os.urandom(32)
    r = httpx.get(server.url + "/attestation", params={"nonce": nonce.hex()}, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    policy = parse_policy({"schema": POLICY_SCHEMA, "backends": ["sim"],
                           "runtime_code": [measure_device_runtime().hex()],
                           "config": [measure_config(release_root / "trust").hex()], "release_root": [root]})
    ak = load_public_key(device_public_key(state))
    assert verify_evidence(r.json(), ak, nonce, policy).release_root == root
    with pytest.raises(QuoteError, match="nonce"):
        verify_evidence(r.json(), ak, os.urandom(32), policy)


def test_kind_usage_counts_equal_the_tokenizers(server):
    """Prompt tokens: transformers' own apply_chat_template over the release's tokenizer and
    template (a second implementation of the rendering); completion tokens: max_tokens
    when the answer ran to its length."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json().decode()))
    tok.chat_template = SMOL_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    r = server.client.chat.completions.create(model="tiny-llm", messages=messages, max_tokens=7, temperature=1.0,
                                              seed=5)
    assert r.usage.prompt_tokens == len(expected)
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    c = server.client.completions.create(model="tiny-llm", prompt="A for loop iterates", max_tokens=5, seed=2)
    assert c.usage.prompt_tokens == len(tok("A for loop iterates", add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_kind_streamed_pieces_join_to_the_plain_answer_for_the_same_seed(server, endpoint):
    kw = dict(model="tiny-llm", max_tokens=24, temperature=0.9, seed=11)
    if endpoint == "chat":
        plain = server.client.chat.completions.create(messages=MESSAGES, **kw)
        text, finish = plain.choices[0].message.content, plain.choices[0].finish_reason
        chunks = list(server.client.chat.completions.create(messages=MESSAGES, stream=True,
                                                            stream_options={"include_usage": True}, **kw))
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        plain = server.client.completions.create(prompt="Tuples are", **kw)
        text, finish = plain.choices[0].text, plain.choices[0].finish_reason
        chunks = list(server.client.completions.create(prompt="Tuples are", stream=True,
                                                       stream_options={"include_usage": True}, **kw))
        pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and "".join(pieces) == text and finishes == [finish]
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_kind_every_streamed_event_is_valid_utf8_json_and_ends_with_done(server):
    body = {"model": "tiny-llm", "messages": MESSAGES, "max_tokens": 40, "temperature": 1.0, "seed": 4,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    for e in events[:-1]:
        assert e.startswith(b"data: ")
        json.loads(e[6:].decode("utf-8", errors="strict"))


def test_kind_stop_sequences_end_the_answer_before_them(server):
    kw = dict(model="tiny-llm", messages=MESSAGES, max_tokens=30, temperature=1.0, seed=3)
    free = server.client.chat.completions.create(**kw).choices[0].message.content
    assert len(free) >= 6, free
    stop = free[3:6]
    cut = free.find(stop)
    r = server.client.chat.completions.create(stop=[stop, "\x00never"], **kw)
    assert r.choices[0].message.content == free[:cut] and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in
              server.client.chat.completions.create(stop=[stop, "\x00never"], stream=True, **kw) if c.choices]
    assert "".join(pieces) == free[:cut]


@pytest.mark.parametrize("kind,body,param", [
    ("empty messages", {"messages": []}, "messages"),
    ("no messages", {"model": "tiny-llm"}, "messages"),
    ("wrong type", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("message content type", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("absurd max_tokens", {"messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),
    ("max_tokens beyond the context", {"messages": MESSAGES, "max_tokens": 4000}, "max_tokens"),
    ("temperature out of range", {"messages": MESSAGES, "temperature": 2.5}, "temperature"),
    ("top_p out of range", {"messages": MESSAGES, "top_p": 0}, "top_p"),
    ("unknown parameter", {"messages": MESSAGES, "frobnicate": 1}, "frobnicate"),
    ("prompt beyond the context", {"messages": [{"role": "user", "content": "list " * 600}]}, "messages"),
])
def test_kind_invalid_requests_get_400_naming_the_parameter(server, kind, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=DEADLINE_S)
    assert r.status_code == 400, (kind, r.text)
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], kind


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint, raw, param", [
    ("chat", rb'{"messages": [{"role": "user", "content": "a\ud800b"}]}', "messages[0].content"),
    ("chat", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("chat", rb'{"messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]}', "messages[0].name"),
    ("chat", rb'{"messages": [{"role": "user", "content": "hi"}], "stop": ["x", "\udc00"]}', "stop[1]"),
    ("completion", rb'{"prompt": "\ud800"}', "prompt"),
    ("completion", rb'{"prompt": "ok", "model": "\ud800tiny"}', "model"),
])
def test_kind_strings_that_are_not_unicode_text_get_400_naming_the_parameter(server, endpoint, raw, param, stream):
    body = raw[:-1] + (b', "stream": true}' if stream else b"}")
    r = httpx.post(server.url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions"),
                   content=body, headers={"Content-Type": "application/json"}, timeout=DEADLINE_S)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and "Unicode" in err["message"]
    ok = server.client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "a😀b"}],
                                               max_tokens=2)  # a paired surrogate escape is a real character
    assert ok.usage.prompt_tokens > 0


def test_kind_raw_bodies_truncated_oversized_or_for_another_model_are_refused(server):
    full = json.dumps({"messages": MESSAGES, "max_tokens": 3}).encode()
    r = httpx.post(server.url + "/v1/chat/completions", content=full[:-7], timeout=DEADLINE_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (1 << 20)}]}).encode()
    r = httpx.post(server.url + "/v1/chat/completions", content=big, timeout=DEADLINE_S)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the cap holds on what is read
        for _ in range(17):
            yield b" " * 65536

    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=DEADLINE_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    with pytest.raises(openai.NotFoundError) as err:
        server.client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        server.client.completions.create(model="tiny-llm", prompt="x", max_tokens=2, n=2)
    assert err.value.body["param"] == "n"


EXPECTED_FAMILIES = {  # family name -> type (prometheus_client's parser strips _total)
    "sealfl_llm_time_to_first_token_seconds": "histogram", "sealfl_llm_inter_token_latency_seconds": "histogram",
    "sealfl_llm_prompt_tokens": "counter", "sealfl_llm_generation_tokens": "counter",
    "sealfl_llm_requests": "counter", "sealfl_llm_requests_running": "gauge",
    "sealfl_llm_requests_rejected": "counter", "sealfl_llm_kv_cache_usage_ratio": "gauge",
    "sealfl_llm_model_verification_failures": "counter", "sealfl_llm_worker_restarts": "counter",
    "sealfl_llm_worker_resident_memory_bytes": "gauge", "process_resident_memory_bytes": "gauge",
    "sealfl_llm_release_info": "gauge", "sealfl_llm_model_loaded": "gauge", "sealfl_llm_slots": "gauge",
}


def test_kind_metrics_parse_with_the_expected_families_and_prometheus_names(server):
    from prometheus_client.parser import text_string_to_metric_families

    server.client.chat.completions.create(model="tiny-llm", messages=MESSAGES, max_tokens=4, seed=0)
    r = httpx.get(server.url + "/metrics", timeout=DEADLINE_S)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name, typ in EXPECTED_FAMILIES.items():
        assert name in fams and fams[name].type == typ, name
    for f in fams.values():  # Prometheus naming: snake case, counters end in _total, no client input in labels
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", f.name), f.name
        for s in f.samples:
            if f.type == "counter":
                assert s.name.endswith("_total"), s.name
            assert set(s.labels) <= {"le", "endpoint", "finish_reason", "reason", "name", "version", "variant",
                                     "root_digest", "status", "result"}, s
    assert fams["sealfl_llm_time_to_first_token_seconds"].samples[-1].value >= 0
    assert server.metric("sealfl_llm_time_to_first_token_seconds_count") >= 1
    assert server.metric("sealfl_llm_generation_tokens_total") >= 1
    assert server.metric("sealfl_llm_worker_resident_memory_bytes") > 10 * 2**20  # onnxruntime in the child
    assert server.metric("sealfl_llm_release_info", {"name": "tiny-llm", "variant": "int4"}) == 1
    # Prometheus's own linter of the format and names (make installs it: scripts/install-promtool.sh)
    promtool = shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable).parent))
    assert promtool, "promtool is missing: run scripts/install-promtool.sh .venv/bin (make does)"
    out = subprocess.run([promtool, "check", "metrics"], input=r.text, capture_output=True, text=True,
                         timeout=DEADLINE_S)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_kind_a_dead_worker_is_restarted_from_the_verified_bytes_and_counted(server):
    """The sandboxed child dies (SIGKILL by its pid): the request that meets the dead
    child gets a 500 naming the failure, the slot is restarted (health check + canary)
    and counted, and the next requests are served."""
    (child,) = _children(server.proc.pid)
    os.kill(child, signal.SIGKILL)
    _wait(lambda: _gone(child), "the child to die")
    with pytest.raises(openai.InternalServerError) as err:
        server.client.chat.completions.create(model="tiny-llm", messages=MESSAGES, max_tokens=3)
    assert err.value.body["type"] == "server_error" and "pid" in err.value.body["message"]
    _wait(lambda: server.metric("sealfl_llm_worker_restarts_total") == 1, "the slot's restart", proc=server.proc)
    r = server.client.chat.completions.create(model="tiny-llm", messages=MESSAGES, max_tokens=3)
    assert r.usage.completion_tokens >= 1
    assert server.metric("sealfl_llm_requests_total", {"endpoint": "chat", "finish_reason": "error"}) == 1
    assert child not in _children(server.proc.pid)


def test_kind_a_sigkilled_server_takes_its_sandboxed_children_along(server):
    """No handler runs on SIGKILL, and a child that cannot read its pipe's EOF (stopped
    here with SIGSTOP, as a child deep in a long inference would not read it either)
    would live on: the children's PR_SET_PDEATHSIG is what ends them."""
    kids = _children(server.proc.pid)
    assert kids
    for k in kids:
        os.kill(k, signal.SIGSTOP)
    try:
        server.kill()
        _wait(lambda: all(_gone(k) for k in kids), "the sandboxed children to die with the server")
    finally:
        for k in kids:
            if not _gone(k):
                os.kill(k, signal.SIGKILL)


def test_kind_busy_slots_answer_429_and_a_disconnect_frees_the_slot(release_root, tmp_path):
    """One slot; a streamed request pauses after its first piece (test pause point
    ``serve-stream``, released only by that request's cancellation -- no sleeps) and so
    holds the slot: the next request gets 429 with Retry-After. The client closes its
    stream: the generation stops, the slot is free, the next request succeeds. SIGINT
    then stops the server: exit 130, no child left."""
    pause = tmp_path / "pause"
    pause.mkdir()
    s = Server(release_root, tmp_path, env={ENV_STAGE: "serve-stream", ENV_DIR: str(pause)},
               args=("--max-concurrent", "1"))
    try:
        s.wait_ready()
        stream = s.client.chat.completions.create(model="tiny-llm", messages=MESSAGES, max_tokens=200,
                                                  temperature=1.0, seed=9, stream=True)
        it = iter(stream)
        next(it)  # the role chunk: the request holds the slot
        _wait(lambda: os.path.exists(event_path("serve-stream", pause)), "the pause point", proc=s.proc)
        assert s.metric("sealfl_llm_requests_running") == 1
        with pytest.raises(openai.RateLimitError) as err:
            s.client.chat.completions.create(model="tiny-llm", messages=MESSAGES, max_tokens=2)
        assert err.value.response.headers["retry-after"] == "1"
        assert err.value.body["code"] == "too_many_requests"
        assert s.metric("sealfl_llm_requests_rejected_total", {"reason": "busy"}) == 1
        stream.close()  # disconnect mid-stream
        _wait(lambda: s.metric("sealfl_llm_requests_running") == 0, "the slot to be freed", proc=s.proc)
        assert s.metric("sealfl_llm_requests_total", {"endpoint": "chat", "finish_reason": "cancelled"}) == 1
        assert s.metric("sealfl_llm_kv_cache_usage_ratio") == 0
        r = s.client.chat.completions.create(model="tiny-llm", messages=MESSAGES, max_tokens=3, seed=1)
        assert r.choices[0].finish_reason in ("stop", "length")
        code, log, kids = s.stop(signal.SIGINT)
    finally:
        s.kill()
    assert code == 130, log
    assert kids
    _wait(lambda: all(_gone(k) for k in kids), "the sandboxed children to exit")
    assert "Traceback" not in log and "interrupted" in log


def test_kind_a_bounded_queue_waits_in_order_refuses_when_full_and_a_default_cap_ends_long_answers(
        release_root, tmp_path):
    """One slot, a queue of one, a default completion cap of 5 tokens. A paused stream holds
    the slot; a chat request without max_tokens waits in the queue; the next one finds the
    queue full: 429 at once. The stream is closed: the waiting request is served, and ends
    after the default cap (finish 'length'); a request may ask for more."""
    import threading

    pause = tmp_path / "pause"
    pause.mkdir()
    s = Server(release_root, tmp_path, env={ENV_STAGE: "serve-stream", ENV_DIR: str(pause)},
               args=("--max-concurrent", "1", "--queue", "1", "--queue-timeout", "120", "--default-max-tokens", "5"))
    try:
        h = s.wait_ready()
        assert h["queue"] == {"size": 1, "timeout_s": 120.0}
        stream = s.client.chat.completions.create(model="tiny-llm", messages=MESSAGES, max_tokens=200,
                                                  temperature=1.0, seed=9, stream=True)
        it = iter(stream)
        next(it)
        _wait(lambda: os.path.exists(event_path("serve-stream", pause)), "the pause point", proc=s.proc)
        waited = {}
        waiter = threading.Thread(target=lambda: waited.update(r=s.client.chat.completions.create(
            model="tiny-llm", messages=MESSAGES, temperature=1.0, seed=2)))  # no max_tokens
        waiter.start()
        _wait(lambda: s.metric("sealfl_llm_requests_waiting") == 1, "a request in the queue", proc=s.proc)
        with pytest.raises(openai.RateLimitError) as err:
            s.client.chat.completions.create(model="tiny-llm", messages=MESSAGES, max_tokens=2)
        assert err.value.response.headers["retry-after"] == "1" and "queue (1) is full" in err.value.body["message"]
        assert s.metric("sealfl_llm_requests_rejected_total", {"reason": "busy"}) == 1
        stream.close()  # the slot is handed to the waiting request
        waiter.join(timeout=DEADLINE_S)
        r = waited["r"]
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        assert s.metric("sealfl_llm_requests_waiting") == 0
        more = s.client.chat.completions.create(model="tiny-llm", messages=MESSAGES, max_tokens=9, temperature=1.0,
                                                seed=2)
        assert more.usage.completion_tokens > 5  # same seed and prompt: the capped answer went on
    finally:
        s.kill()


def test_kind_health_is_503_until_loaded_and_sigterm_during_boot_leaves_no_child(release_root, tmp_path):
    pause = tmp_path / "pause"
    pause.mkdir()
    s = Server(release_root, tmp_path, env={ENV_STAGE: "serve-boot", ENV_DIR: str(pause)})
    try:
        _wait(lambda: os.path.exists(event_path("serve-boot", pause)), "the boot pause point", proc=s.proc)
        h = s.health()
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": MESSAGES}, timeout=DEADLINE_S)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded"
        code, log, _ = s.stop(signal.SIGTERM)
    finally:
        s.kill()
    assert code == 143 and "interrupted" in log and "Traceback" not in log, log
    assert not (tmp_path / "state" / "state.json").exists()


def test_kind_a_tampered_release_is_never_served(release_root, tmp_path):
    rel = tmp_path / "release"
    shutil.copytree(release_root / "release", rel)
    data = bytearray((rel / "tokenizer.json").read_bytes())
    data[len(data) // 2] ^= 0x20
    (rel / "tokenizer.json").write_bytes(bytes(data))
    s = Server(release_root, tmp_path, release=rel)
    seen = set()
    try:
        while s.proc.poll() is None:
            try:
                seen.add(s.health().status_code)
            except httpx.TransportError:  # the server closed its socket on the way out
                pass
        code = s.proc.wait(timeout=DEADLINE_S)
    finally:
        s.kill()
    log = s.log.read_text()
    assert code == 2 and 200 not in seen, (code, seen, log)
    assert "tokenizer.json" in log and "hash" in log and "nothing is served" in log


def test_kind_a_refused_update_keeps_serving_the_last_good_release(release_root, tmp_path):
    """v1 is served once, so the device state records it as last good. Then v2 -- signed by
    the same enclave, one byte of its tokenizer flipped -- is offered to the same device.
    The server refuses v2, counts the verification failure, and serves v1: the root digest
    the state recorded, answering chat requests."""
    from sealfl.enclave.release.enclave import ReleaseEnclave
    from tests.support.llm_tiny import tiny_release_files

    first = Server(release_root, tmp_path)
    try:
        v1 = first.wait_ready()["release"]
    finally:
        code, log, _ = first.stop()
    assert code == 143, log
    state_file = tmp_path / "state" / "state.json"
    good_root = json.loads(state_file.read_text())["last_good"]["root_digest"]
    assert v1["version"] == 1 and v1["root_digest"] == good_root

    payload, metadata = tiny_release_files()
    v2_dir = tmp_path / "release-v2"
    ReleaseEnclave.open(release_root / "enclave").write_release(v2_dir, payload, "tiny-llm", 2, metadata)
    data = bytearray((v2_dir / "tokenizer.json").read_bytes())
    data[len(data) // 3] ^= 0x01
    (v2_dir / "tokenizer.json").write_bytes(bytes(data))

    second = Server(release_root, tmp_path, release=v2_dir)
    try:
        h = second.wait_ready()
        assert h["release"]["version"] == 1 and h["release"]["root_digest"] == good_root
        assert second.metric("sealfl_llm_model_verification_failures_total") == 1
        r = second.client.chat.completions.create(model=v1["name"], messages=MESSAGES, max_tokens=4, seed=1)
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("length", "stop")
    finally:
        code, log, _ = second.stop()
    assert code == 143, log
    assert "refused" in log and "tokenizer.json" in log and "kept the last good release v1" in log, log
    assert json.loads(state_file.read_text())["last_good"]["root_digest"] == good_root

