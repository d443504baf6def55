"""The HTTP front of ``sealfl device serve``: an OpenAI-compatible API over a verified
causal LM, the Open Inference Protocol over a verified tabular model
(:mod:`sealfl.enclave.device.serve.oip_routes`), FastAPI on uvicorn.

Routes:

* ``GET /health`` -- 503 ``{"status": "loading" | "refused" | "stopping", ...}`` until a
  verified model serves, then 200 ``{"status": "ok", "release": {name, version,
  root_digest, variant, statement_digest}, "tee": {backend, insecure, ak_keyid}, "slots",
  "queue"}`` (``tee.insecure`` is true on the ``sim`` simulation);
* ``GET /metrics`` -- Prometheus text format (:mod:`sealfl.enclave.device.serve.metrics`);
* ``GET /v1/models`` -- the one verified release;
* ``GET /attestation?nonce=HEX`` -- the device's evidence for the verifier's nonce (1..64
  bytes): quote, PCR values and event log (:func:`sealfl.enclave.device.evidence.attest_device`;
  checked by ``sealfl attest verify``); 400 naming ``nonce`` for a bad one, 503 while no
  verified model serves or when the TEE cannot quote;
* ``POST /v1/chat/completions`` and ``POST /v1/completions`` -- plain JSON, or server-sent
  events (``stream: true``) of ``chat.completion.chunk`` / ``text_completion`` objects
  ending with ``data: [DONE]`` (OpenAI's API reference, "Streaming").

A generation request: body read up to the cap (400 beyond, without reading more) ->
checked (:mod:`sealfl.enclave.device.serve.openai_api`, 400 naming the parameter) -> model id (404) ->
prompt rendered with the release's chat template and tokenized, context checked (400) ->
a free slot, else a place in the bounded queue (:class:`~sealfl.enclave.device.serve.state.SlotQueue`: ``--queue`` places, at
most ``--queue-timeout`` s, first come first served), else 429 with ``Retry-After`` -> generation on a worker thread
whose text pieces reach the client as they are decoded (a piece never ends inside a
UTF-8 character or a possible stop string: :func:`~sealfl.enclave.sandbox.llm_runtime.emit_limit`).
A client that disconnects (stream or not) sets the request's cancel event; the runtime's
callback then stops the child's generation at the next token and the slot is freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sealfl.common.testpoints import testpoint
from sealfl.enclave.device.serve.access_log import AccessLog
from sealfl.enclave.device.serve.http_body import read_body
from sealfl.enclave.device.serve.metrics import CONTENT_TYPE
from sealfl.enclave.device.serve.oip_routes import add_oip_routes
from sealfl.enclave.device.serve.openai_api import (
    DEFAULT_LIMITS,
    APILimits,
    APIRequestError,
    GenerationRequest,
    fit_context,
    parse_chat_request,
    parse_completion_request,
)
from sealfl.enclave.device.serve.state import ServeState, Slot, SlotQueue
from sealfl.enclave.errors import RuntimeSandboxError
from sealfl.enclave.sandbox.decode import SamplingParams

__all__ = ["create_app", "RETRY_AFTER_S"]

log = logging.getLogger(__name__)

#: Seconds a client refused with 429 is told to wait (``Retry-After``).
RETRY_AFTER_S = 1
_END = object()   # the generation finished
_GONE = object()  # the client disconnected


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def _usage(res) -> dict:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens}


class _Job:
    """One generation on a worker thread, feeding an asyncio queue with text pieces."""

    def __init__(self, state: ServeState, slot: Slot, endpoint: str, ids: list[int], params: SamplingParams,
                 t_arrival: float, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.state, self.slot, self.endpoint, self.ids, self.params = state, slot, endpoint, ids, params
        self.t_arrival, self.loop, self.stream = t_arrival, loop, stream
        self.cancel = threading.Event()
        self.queue: asyncio.Queue = asyncio.Queue()
        self._last = t_arrival
        self._sent = 0
        self.completion_tokens = 0  # tokens generated so far (the access log reads them)
        self.first_token_s: float | None = None  # arrival -> first token, seconds

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is stopping
            self.cancel.set()

    def _on_token(self, n: int) -> None:
        m, now = self.state.metrics, time.perf_counter()
        (m.ttft if n == 1 else m.itl).observe(now - self._last)
        self.completion_tokens = n
        if n == 1:
            self.first_token_s = now - self.t_arrival
        self._last = now
        m.generation_tokens.inc()
        m.kv_tokens(self.slot.index, len(self.ids) + n)

    def _on_text(self, piece: str) -> bool:
        if self.cancel.is_set():
            return False
        if self.stream:
            self._put(piece)
            self._sent += 1
            if self._sent == 1:
                testpoint("serve-stream", until=self.cancel)
        return not self.cancel.is_set()

    def run(self):
        """Worker-thread body: generate, then free the slot (always)."""
        state, slot, m = self.state, self.slot, self.state.metrics
        m.prompt_tokens.inc(len(self.ids))
        state.track(self.cancel, True)
        if state.status != "ready":  # stopping: close() may have run before track()
            self.cancel.set()
        try:
            res = slot.runtime.generate(self.ids, self.params, on_text=self._on_text, on_token=self._on_token)
        except RuntimeSandboxError as exc:
            state.track(self.cancel, False)
            m.finished(self.endpoint, "error")
            log.error("generation failed in slot %d: %s", slot.index, exc)
            if not slot.runtime.alive:
                state.request_restart(slot)
            state.release_slot(slot)
            self._put(exc)
            raise
        except BaseException as exc:
            state.track(self.cancel, False)
            m.finished(self.endpoint, "error")
            state.release_slot(slot)
            self._put(exc)
            raise
        state.track(self.cancel, False)
        m.finished(self.endpoint, res.finish_reason)
        state.release_slot(slot)
        self._put(_END)
        return res


async def _disconnected(request) -> None:
    """Return when the client has gone (ASGI ``http.disconnect``)."""
    while (await request.receive()).get("type") != "http.disconnect":
        pass


def _error_response(exc: APIRequestError, headers: dict | None = None):
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _read_body(request, cap: int) -> bytes:
    """The body, refused (400, param ``body``) as soon as it is longer than ``cap`` bytes."""
    return await read_body(request, cap, lambda msg: APIRequestError(f"body: {msg}", param="body",
                                                                     code="request_too_large"))


def parse_nonce(value: str) -> bytes:
    """The ``nonce`` query parameter of ``GET /attestation``: hex of 1..64 bytes.

    Raises:
        APIRequestError: (400, param ``nonce``) not hex, odd length, empty or over 64 bytes.
    """
    if (not isinstance(value, str) or not 2 <= len(value) <= 128 or len(value) % 2
            or any(c not in "0123456789abcdefABCDEF" for c in value)):
        raise APIRequestError("nonce: must be 2..128 hex digits (1..64 bytes)", param="nonce", code="invalid_value")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise APIRequestError("nonce: must be hex digits", param="nonce", code="invalid_value") from None


def create_app(state: ServeState, limits: APILimits = DEFAULT_LIMITS):
    """The FastAPI application over ``state`` (module docstring)."""
    app = FastAPI(title="sealfl device", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(AccessLog)
    executor = ThreadPoolExecutor(max_workers=max(1, state.max_concurrent), thread_name_prefix="sealfl-gen")
    queues: dict[int, SlotQueue] = {}

    def slot_queue() -> SlotQueue:
        loop = asyncio.get_running_loop()
        if id(loop) not in queues:
            queues.clear()
            queues[id(loop)] = SlotQueue(state, loop)
        return queues[id(loop)]

    add_oip_routes(app, state, max_body_bytes=limits.max_body_bytes, wait_s=state.queue_timeout_s)

    @app.get("/health")
    async def health():
        if state.serving():
            return {"status": "ok", "release": state.release.to_dict(), "tee": dict(state.tee),
                    "slots": state.max_concurrent,
                    "queue": {"size": state.queue_size, "timeout_s": state.queue_timeout_s}}
        body = {"status": state.status if state.status != "ready" else "no-working-slot"}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        if state.release is None:
            return _error_response(APIRequestError("no verified model is loaded yet", param=None,
                                                   code="model_not_loaded", status=503, type="server_error"))
        r = state.release
        return {"object": "list", "data": [{"id": r.name, "object": "model", "created": 0, "owned_by": "sealfl",
                                            "version": r.version, "root_digest": r.root_digest,
                                            "variant": r.variant}]}

    @app.get("/attestation")
    async def attestation(nonce: str = ""):
        try:
            raw = parse_nonce(nonce)
            if not state.serving():
                raise APIRequestError("no verified model is loaded yet; retry when /health answers 200", param=None,
                                      code="model_not_loaded", status=503, type="server_error")
        except APIRequestError as exc:
            return _error_response(exc)
        from sealfl.enclave.device.evidence import attest_device
        from sealfl.enclave.errors import EnclaveError as _EnclaveError

        try:  # the TEE calls block (tpm2-tools processes): off the event loop
            return await asyncio.get_running_loop().run_in_executor(None, attest_device, state.state_dir, raw)
        except _EnclaveError as exc:
            log.warning("attestation for nonce %s failed: %s", nonce[:16], exc)
            return _error_response(APIRequestError(f"the device cannot attest: {exc}", param=None,
                                                   code="attestation_failed", status=503, type="server_error"))

    async def generate(request: Request, endpoint: str):
        t_arrival = time.perf_counter()
        try:
            if not state.serving():
                raise APIRequestError("no verified model is loaded yet; retry when /health answers 200", param=None,
                                      code="model_not_loaded", status=503, type="server_error")
            if state.tabular is not None:
                raise APIRequestError(f"model: the served release {state.model_id!r} is a tabular model, not a "
                                      f"language model; score rows with POST /v2/models/{state.model_id}/infer",
                                      param="model", code="model_not_supported", status=400)
            body = await _read_body(request, limits.max_body_bytes)
            req = (parse_chat_request if endpoint == "chat" else parse_completion_request)(body, limits)
            if req.model is not None and req.model != state.model_id:
                raise APIRequestError(f"model: this device serves only its verified release {state.model_id!r}, "
                                      f"not {req.model[:80]!r}", param="model", code="model_not_found", status=404)
            ids, n_new = _prompt_ids(state, req)
        except APIRequestError as exc:
            state.metrics.reject({503: "not_ready", 404: "unknown_model"}.get(exc.status, "context" if exc.code
                                 == "context_length_exceeded" else "invalid"))
            return _error_response(exc)
        slot, why = await slot_queue().acquire(lambda: _disconnected(request))
        if slot is None:
            if why == "gone":
                return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
            state.metrics.reject(why)
            waited = (f"; it waited {state.queue_timeout_s:g} s in the queue" if why == "queue_timeout" else
                      f" and the queue ({state.queue_size}) is full" if state.queue_size else "")
            exc = APIRequestError(f"all {state.max_concurrent} generation slots are busy{waited}; retry after "
                                  f"{RETRY_AFTER_S} s", param=None, code="too_many_requests", status=429,
                                  type="rate_limit_error")
            return _error_response(exc, {"Retry-After": str(RETRY_AFTER_S)})
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, max_tokens=n_new,
                                seed=req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "big") >> 1,
                                stop=req.stop)
        loop = asyncio.get_running_loop()
        job = _Job(state, slot, endpoint, ids, params, t_arrival, loop, req.stream)
        request.scope.setdefault("state", {})["sealfl_job"] = job  # the access log reads its counts
        try:
            future = loop.run_in_executor(executor, job.run)
        except BaseException:
            state.release_slot(slot)
            raise
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        fingerprint = fingerprint_of(slot.release or state.release)
        if req.stream:
            return StreamingResponse(_stream(job, future, watcher, req, rid, created, state.model_id, fingerprint),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _plain(job, future, watcher, req, rid, created, state.model_id, fingerprint)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    app.state.executor = executor
    return app


def _prompt_ids(state: ServeState, req: GenerationRequest) -> tuple[list[int], int]:
    """Token ids of the request's prompt and the number of new tokens allowed (400s)."""
    rt = state.tokenizer_runtime
    if req.kind == "chat":
        try:
            text = rt.render_chat(list(req.messages))
        except ValueError as exc:
            raise APIRequestError(f"messages: {exc}", param="messages", code="invalid_value") from exc
        ids = rt.encode(text)
    elif isinstance(req.prompt, str):
        ids = rt.encode(req.prompt)
    else:
        ids = list(req.prompt)
    if not ids:
        raise APIRequestError("prompt: the prompt has no tokens", param="prompt" if req.kind != "chat" else "messages",
                              code="invalid_value")
    n = fit_context(req, len(ids), state.max_context, rt.tokenizer.get_vocab_size(),
                    tuple(ids) if not isinstance(req.prompt, str) and req.kind != "chat" else ())
    return ids, n


def _server_error(exc: BaseException) -> dict:
    return {"error": {"message": f"generation failed: {exc}", "type": "server_error", "param": None,
                      "code": "generation_failed"}}


async def _watch_disconnect(request, job: _Job) -> None:
    """Wait for the client to go away (ASGI ``http.disconnect``; uvicorn sends it when the
    connection closes, the body having been read), then cancel the job. Event-driven: with
    ASGI spec 2.4 Starlette's StreamingResponse notices a disconnect only when a send
    fails, which a paused or silent generation never attempts."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            job.cancel.set()
            job.queue.put_nowait(_GONE)
            return


def fingerprint_of(release) -> str:
    """``system_fingerprint`` of an answer: the release whose model generated it,
    ``v<version>-<root digest, 16 hex>`` (a switch while serving changes it only for
    requests that start after the switch)."""
    return f"v{release.version}-{release.root_digest[:16]}" if release is not None else ""


async def _plain(job: _Job, future, watcher, req: GenerationRequest, rid: str, created: int, model: str,
                 fingerprint: str = ""):
    try:
        res = await future
    except Exception as exc:  # noqa: BLE001 -- the worker's failure becomes a 500 body
        return JSONResponse(_server_error(exc), status_code=500)
    finally:
        job.cancel.set()
        watcher.cancel()
    if req.kind == "chat":
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "system_fingerprint": fingerprint,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text},
                             "finish_reason": res.finish_reason, "logprobs": None}],
                "usage": _usage(res)}
    else:
        body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": fingerprint,
                "choices": [{"index": 0, "text": res.text, "finish_reason": res.finish_reason, "logprobs": None}],
                "usage": _usage(res)}
    return JSONResponse(body)


async def _stream(job: _Job, future, watcher, req: GenerationRequest, rid: str, created: int, model: str,
                  fingerprint: str = ""):
    """Server-sent events of one generation; leaving early (client gone) cancels it."""
    chat = req.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
        if chat:
            delta = ({"role": "assistant", "content": ""} if first else {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": fingerprint,
                "choices": [choice]}

    try:
        if chat:
            yield _sse(chunk(None, None, first=True))
        while True:
            item = await job.queue.get()
            if item is _END:
                break
            if item is _GONE:
                return
            if isinstance(item, BaseException):
                yield _sse(_server_error(item))
                yield b"data: [DONE]\n\n"
                return
            yield _sse(chunk(item, None))
        res = await future
        yield _sse(chunk(None, res.finish_reason))
        if req.include_usage:
            yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": _usage(res)})
        yield b"data: [DONE]\n\n"
    finally:
        job.cancel.set()
        watcher.cancel()
