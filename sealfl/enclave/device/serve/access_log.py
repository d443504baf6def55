"""One access-log line per HTTP request of ``sealfl device serve`` (an ASGI middleware).

A line, logfmt (``key=value``; values that are not plain are quoted)::

    method=POST path=/v1/chat/completions status=200 prompt_tokens=12 completion_tokens=30 ttft_ms=85.2 total_ms=1203.4

``path`` is the URL path only (no query string: the attestation nonce stays out), cut to
200 characters with anything not printable escaped; the token counts and the time to
first token (from the request's arrival) are there for generation requests, ``rows`` for
``/v2/.../infer``; the prompt, the messages and the generated text never are. ``status``
is what the client got (499 when it went away before the response began), ``total_ms``
runs to the last byte sent (a streamed answer's end).
"""

from __future__ import annotations

import logging
import time

__all__ = ["AccessLog", "ACCESS_LOGGER", "note"]

#: the logger the lines go to (``device serve --access-log`` gives it its handler)
ACCESS_LOGGER = "sealfl.access"
_MAX_PATH = 200
_log = logging.getLogger(ACCESS_LOGGER)


def note(scope: dict, **fields) -> None:
    """Add figures (token counts, rows, ...) to the request's access-log line; only
    numbers are kept (never text the client sent)."""
    extra = scope.setdefault("state", {}).setdefault("sealfl_access", {})
    for key, value in fields.items():
        if type(value) in (int, float):
            extra[key] = value


def _value(v) -> str:
    if type(v) is float:
        return f"{v:.1f}"
    s = str(v)
    if s and all(c.isalnum() or c in "/-_.:%+" for c in s):
        return s
    return '"' + s.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'


def _job_fields(extra: dict) -> dict:
    job = extra.pop("job", None)
    if job is None:
        return {}
    out = {"prompt_tokens": len(job.ids), "completion_tokens": job.completion_tokens}
    if job.first_token_s is not None:
        out["ttft_ms"] = job.first_token_s * 1000
    return out


class AccessLog:
    """ASGI middleware: after each HTTP response is sent, one INFO line on
    :data:`ACCESS_LOGGER` (module docstring)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [499]

        async def send_and_note(message):
            if message.get("type") == "http.response.start":
                status[0] = int(message.get("status", 0))
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            if _log.isEnabledFor(logging.INFO):
                state = scope.get("state") or {}
                extra = dict(state.get("sealfl_access") or {})
                job = state.get("sealfl_job")
                fields = {"method": scope.get("method", "?"), "path": str(scope.get("path", ""))[:_MAX_PATH],
                          "status": status[0], **_job_fields({"job": job}), **extra,
                          "total_ms": (time.perf_counter() - t0) * 1000}
                _log.info(" ".join(f"{k}={_value(v)}" for k, v in fields.items()))
