"""The Open Inference Protocol routes of ``sealfl device serve`` (KServe v2 REST) for a
tabular release; the parsing and bodies are :mod:`sealfl.enclave.device.serve.oip`.

Routes (``{name}`` is the release's name; the version, where given, must be the served one):

* ``GET /v2/health/live`` -- 200 ``{"live": true}`` while the process answers;
* ``GET /v2/health/ready`` -- 200 ``{"ready": true}`` once a verified tabular model serves,
  else 503 ``{"ready": false}`` (loading, refused, stopping, or the release is a causal LM);
* ``GET /v2`` -- server metadata ``{"name": "sealfl", "version", "extensions": []}``;
* ``GET /v2/models/{name}[/versions/{v}]`` -- the model's metadata
  (:func:`~sealfl.enclave.device.serve.oip.model_metadata`), 404 for another name;
* ``GET /v2/models/{name}[/versions/{v}]/ready`` -- 200 / 503;
* ``POST /v2/models/{name}[/versions/{v}]/infer`` -- scores the rows: body read up to
  ``--max-body-bytes`` (400 beyond), checked against the signed input spec (400 naming row
  and column), scored in the verified release's sandboxed child. One child serves one
  request at a time (a lock; scoring takes milliseconds); a request that cannot get it
  within the queue timeout gets 429 with ``Retry-After``. A child that died is restarted
  by the main thread from the kept verified bytes (503 meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import sealfl
from sealfl.enclave.device.serve.http_body import read_body
from sealfl.enclave.device.serve.oip import (
    DEFAULT_MAX_ROWS,
    OIPError,
    infer_response,
    model_metadata,
    parse_infer_request,
)
from sealfl.enclave.device.serve.state import ServeState
from sealfl.enclave.errors import RuntimeSandboxError

__all__ = ["add_oip_routes"]

log = logging.getLogger(__name__)

#: Seconds a client refused with 429 is told to wait (``Retry-After``).
RETRY_AFTER_S = 1


def _error(exc: OIPError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def add_oip_routes(app: FastAPI, state: ServeState, *, max_body_bytes: int, max_rows: int = DEFAULT_MAX_ROWS,
                   wait_s: float = 30.0) -> None:
    """Add the module docstring's routes to ``app``.

    Args:
        app: the server's FastAPI app (:func:`sealfl.enclave.device.serve.app.create_app`).
        state: the shared :class:`ServeState` (``state.tabular`` once a tabular model serves).
        max_body_bytes: largest request body, bytes.
        max_rows: most rows per request.
        wait_s: longest wait for the model's child, seconds (then 429).
    """
    lock = threading.Lock()

    def served(name: str, version: str | None):
        tab = state.tabular
        if tab is None or not state.serving():
            raise OIPError("no verified tabular model is being served (loading, refused, stopping, or the "
                           "release is a causal language model: use /v1)", status=503)
        if name != tab.name or (version is not None and version != str(tab.version)):
            raise OIPError(f"model {name[:80]!r}{' version ' + version[:20] if version else ''} is not served here; "
                           f"this device serves {tab.name!r} version {tab.version}", status=404)
        return tab

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        ok = state.tabular is not None and state.serving()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2")
    async def server_metadata():
        return {"name": "sealfl", "version": sealfl.__version__, "extensions": []}

    async def metadata(name: str, version: str | None = None):
        try:
            tab = served(name, version)
        except OIPError as exc:
            return _error(exc)
        return model_metadata(tab.name, tab.version, tab.input_name, tab.width, tab.spec, tab.output_names,
                              tab.root_digest)

    async def model_ready(name: str, version: str | None = None):
        try:
            served(name, version)
        except OIPError as exc:
            return JSONResponse({"name": name, "ready": False, "error": str(exc)},
                                status_code=404 if exc.status == 404 else 503)
        return {"name": name, "ready": True}

    def score(tab, req):
        slot = state.slots[0]
        if not lock.acquire(timeout=wait_s):
            return None
        try:
            t0 = time.perf_counter()
            try:
                outs = slot.runtime.run({slot.runtime.input_names[0]: req.rows})
            except RuntimeSandboxError as exc:
                log.error("inference failed: %s", exc)
                if not slot.runtime.alive:
                    state.request_restart(slot)
                raise OIPError("the model's sandboxed runtime failed; retry shortly", status=503) from exc
            state.metrics.infer_seconds.observe(time.perf_counter() - t0)
            return dict(zip(slot.runtime.output_names, outs))
        finally:
            lock.release()

    async def infer(request: Request, name: str, version: str | None = None):
        m = state.metrics
        try:
            tab = served(name, version)
            body = await read_body(request, max_body_bytes, OIPError)
            req = parse_infer_request(body, tab.input_name, tab.width, tab.spec, tab.output_names,
                                      max_rows=max_rows)
            outs = await asyncio.to_thread(score, tab, req)
            if outs is None:
                m.infer_requests.labels("429").inc()
                return JSONResponse({"error": f"the model is busy; retry in {RETRY_AFTER_S} s"}, status_code=429,
                                    headers={"Retry-After": str(RETRY_AFTER_S)})
            out = infer_response(tab.name, tab.version, req, outs)
        except OIPError as exc:
            m.infer_requests.labels(str(exc.status)).inc()
            return _error(exc)
        m.infer_requests.labels("200").inc()
        m.infer_rows.inc(req.rows.shape[0])
        return out

    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        app.add_api_route(prefix, metadata, methods=["GET"])
        app.add_api_route(prefix + "/ready", model_ready, methods=["GET"])
        app.add_api_route(prefix + "/infer", infer, methods=["POST"])

