"""The device's OpenAI-compatible requests: body bytes in, a checked request out (pure).

Every request body is hostile until :func:`parse_chat_request` / :func:`parse_completion_request`
accepted it; both are pure functions over the bytes received (no I/O, no model), so each
refusal is tested directly. The order of checks:

1. size: at most :attr:`APILimits.max_body_bytes` bytes (before parsing);
2. strict JSON (:func:`sealfl.attestation.canonical.loads_strict`: UTF-8, one object, no
   duplicate keys, no NaN/Infinity, no string that is not Unicode text -- an unpaired
   surrogate escape such as ``"\ud800"`` is refused naming its parameter; a truncated body
   fails here);
3. every known parameter: its JSON type, then its range; unknown parameters and OpenAI
   features the device does not offer (tools, logprobs, ``n`` > 1, penalties, ...) are
   refused by name rather than silently ignored.

A refusal is :class:`~sealfl.enclave.errors.APIRequestError` (HTTP 400, OpenAI's error body
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``) naming the
parameter, e.g. ``messages[2].content`` or ``temperature``; ``param`` is ``"body"`` when the
body as a whole is at fault (too large, not JSON).

Parameters and ranges follow OpenAI's API reference for ``POST /v1/chat/completions`` and
``POST /v1/completions`` (platform.openai.com/docs/api-reference/chat/create and
.../completions/create): ``temperature`` in [0, 2] (default 1), ``top_p`` in (0, 1]
(default 1), ``stop`` a string or up to 4 strings, ``seed`` an integer (absent: a fresh
random seed per request), ``max_tokens`` (chat also ``max_completion_tokens``) a positive
integer, ``stream`` and ``stream_options.include_usage`` booleans. The context check
(:func:`fit_context`) needs the prompt's token count and runs after rendering.

**Completion cap.** A request without ``max_tokens`` gets at most
:attr:`APILimits.default_max_tokens` new tokens (chat; ``device serve --default-max-tokens``,
default 256 -- as llama.cpp's server caps with ``--n-predict``) or 16 (completions, OpenAI's
documented default), fewer when the context has less room; a request may ask for more, up
to the room its prompt leaves in the context (and :attr:`APILimits.max_new_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sealfl.attestation.canonical import JSONFormatError, loads_strict
from sealfl.common.fields import Fields
from sealfl.enclave.errors import EnclaveError
from sealfl.enclave.sandbox.decode import MAX_NEW_TOKENS_CAP

__all__ = ["APIRequestError", "APILimits", "GenerationRequest", "parse_chat_request", "parse_completion_request",
           "fit_context", "CHAT_ROLES"]


class APIRequestError(EnclaveError):
    """A request to the device's OpenAI-compatible API was refused. Rendered as OpenAI's
    error body ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``.

    (Defined here rather than in :mod:`sealfl.enclave.errors`: that module is part of the
    release enclave's measured code, and editing it would force every consortium to
    re-provision its enclave for an HTTP error type.)

    Attributes:
        status: HTTP status (400 invalid request, 404 unknown model, 429 busy, 503 not ready).
        param: the request parameter that failed (``"messages[0].content"``,
            ``"max_tokens"``, ``"body"`` for the body as a whole), or None.
        code: short machine-readable code (``"invalid_type"``, ``"out_of_range"``, ...).
        type: OpenAI error type (``"invalid_request_error"``, ``"rate_limit_error"``, ...).
    """

    def __init__(self, message: str, *, param: str | None, code: str, status: int = 400,
                 type: str = "invalid_request_error"):  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

#: Roles a chat message may have (OpenAI's ``developer`` is its newer name for ``system``).
CHAT_ROLES = ("system", "developer", "user", "assistant")

# OpenAI parameters the device accepts only at their no-op value: {name: test of the value}.
_NOOP = {
    "n": lambda v: v == 1 and not isinstance(v, bool),
    "presence_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "frequency_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None,
    "logit_bias": lambda v: v is None or v == {},
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "user": lambda v: v is None or isinstance(v, str) and len(v) <= 256,
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v is None,
    "best_of": lambda v: v is None or v == 1 and not isinstance(v, bool),
}
_CHAT_NOOP = ("n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "logit_bias", "tools",
              "tool_choice", "parallel_tool_calls", "response_format", "user")
_COMPLETION_NOOP = ("n", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "user", "echo",
                    "suffix", "best_of")
_COMMON = ("model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options")


@dataclass(frozen=True)
class APILimits:
    """Caps on what one request may ask for (one object, like TUF's ``UpdaterConfig``).

    Attributes:
        max_body_bytes: largest request body, bytes (default 1 MiB).
        max_messages: most chat messages in one request.
        max_content_chars: longest message content or prompt, characters.
        max_stop: most stop strings (OpenAI: 4).
        max_stop_chars: longest stop string, characters.
        max_new_tokens: largest ``max_tokens`` (:data:`~sealfl.enclave.sandbox.decode.MAX_NEW_TOKENS_CAP`).
        max_temperature: highest temperature (OpenAI: 2).
        default_max_tokens: new tokens of a chat request that gives no ``max_tokens``
            (module docstring).
    """

    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_content_chars: int = 200_000
    max_stop: int = 4
    max_stop_chars: int = 256
    max_new_tokens: int = MAX_NEW_TOKENS_CAP
    max_temperature: float = 2.0
    default_max_tokens: int = 256


DEFAULT_LIMITS = APILimits()


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request of either endpoint.

    Attributes:
        kind: ``"chat"`` or ``"completion"``.
        model: the model the client asked for (None: not given).
        messages: chat messages ``({"role", "content"}, ...)`` (``developer`` mapped to
            ``system``); empty for completions.
        prompt: completion prompt: text or token ids; None for chats.
        max_tokens: new tokens the client asked for at most (None: not given).
        default_max_tokens: the cap when ``max_tokens`` is None (limited by the context).
        temperature: sampling temperature in [0, max_temperature].
        top_p: nucleus mass in (0, 1].
        stop: stop strings.
        seed: sampler seed (None: the server draws one).
        stream: answer as server-sent events.
        include_usage: streamed answers end with a usage chunk.
    """

    kind: str
    model: str | None = None
    messages: tuple = ()
    prompt: str | tuple[int, ...] | None = None
    max_tokens: int | None = None
    default_max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = field(default=())
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False


def _err(param: str | None, message: str, code: str = "invalid_value") -> APIRequestError:
    return APIRequestError(f"{param}: {message}" if param else message, param=param, code=code)


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


def _load(body: bytes, limits: APILimits) -> dict:
    if not isinstance(body, (bytes, bytearray)):
        raise _err("body", "the request body must be bytes", "invalid_type")
    if len(body) > limits.max_body_bytes:
        raise _err("body", f"the request body has {len(body)} bytes; at most {limits.max_body_bytes} are accepted",
                   "request_too_large")
    try:
        return loads_strict(bytes(body))
    except JSONFormatError as exc:
        if exc.path:  # one value is at fault (e.g. a string that is not Unicode text)
            raise _err(exc.path, "is not valid Unicode text (an unpaired UTF-16 surrogate such as \\ud800); "
                                 "send valid UTF-8", "invalid_value") from exc
        raise _err("body", f"not a JSON object: {exc}; send one UTF-8 JSON object", "invalid_json") from exc


#: the field checker of requests (:mod:`sealfl.common.fields`): an OpenAI 400 naming the parameter
_API = Fields("request", lambda path, problem, code: _err(path, problem, code), detailed=True)


def _integer(v: Any, param: str, lo: int, hi: int) -> int:
    return _API.integer(v, param, lo=lo, hi=hi)


def _number(v: Any, param: str, lo: float, hi: float, lo_open: bool = False) -> float:
    return _API.number(v, param, lo=lo, hi=hi, lo_open=lo_open)


def _boolean(v: Any, param: str) -> bool:
    return _API.boolean(v, param)


def _text(v: Any, param: str, max_chars: int, allow_empty: bool = True) -> str:
    return _API.string(v, param, nonempty=not allow_empty, max_len=max_chars)


def _stop(v: Any, limits: APILimits) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise _err("stop", f"must be a string or an array of strings, got {_type_name(v)}", "invalid_type")
    if len(items) > limits.max_stop:
        raise _err("stop", f"has {len(items)} strings; at most {limits.max_stop} are accepted", "out_of_range")
    return tuple(_text(s, f"stop[{i}]" if not isinstance(v, str) else "stop", limits.max_stop_chars,
                       allow_empty=False) for i, s in enumerate(items))


def _content(v: Any, param: str, limits: APILimits) -> str:
    """A message's content: a string, or OpenAI's array of ``{"type": "text", "text"}`` parts."""
    if isinstance(v, list):
        if not v:
            raise _err(param, "must not be an empty array", "out_of_range")
        texts = []
        for j, part in enumerate(v):
            p = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise _err(p, f"must be an object, got {_type_name(part)}", "invalid_type")
            if part.get("type") != "text" or set(part) != {"type", "text"}:
                raise _err(p, "only {\"type\": \"text\", \"text\": ...} parts are supported", "unsupported_value")
            texts.append(_text(part["text"], f"{p}.text", limits.max_content_chars))
        v = "".join(texts)
    return _text(v, param, limits.max_content_chars)


def _messages(v: Any, limits: APILimits) -> tuple:
    if v is None:
        raise _err("messages", "is required", "missing_required_parameter")
    if not isinstance(v, list):
        raise _err("messages", f"must be an array of messages, got {_type_name(v)}", "invalid_type")
    if not v:
        raise _err("messages", "must hold at least one message", "out_of_range")
    if len(v) > limits.max_messages:
        raise _err("messages", f"has {len(v)} messages; at most {limits.max_messages} are accepted", "out_of_range")
    out, total = [], 0
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _err(p, f"must be an object, got {_type_name(m)}", "invalid_type")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise _err(f"{p}.{extra[0]}", "is not supported by this device (only role, content, name)",
                       "unsupported_parameter")
        role = m.get("role")
        if not isinstance(role, str):
            raise _err(f"{p}.role", f"must be a string, got {_type_name(role)}", "invalid_type")
        if role not in CHAT_ROLES:
            raise _err(f"{p}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role[:40]!r}", "invalid_value")
        if "name" in m:
            _text(m["name"], f"{p}.name", 64)
        if "content" not in m:
            raise _err(f"{p}.content", "is required", "missing_required_parameter")
        content = _content(m["content"], f"{p}.content", limits)
        total += len(content)
        if total > limits.max_content_chars:
            raise _err("messages", f"hold more than {limits.max_content_chars} characters", "out_of_range")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def _prompt(v: Any, limits: APILimits) -> str | tuple[int, ...]:
    if v is None:
        raise _err("prompt", "is required", "missing_required_parameter")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        v = v[0]
    if isinstance(v, str):
        return _text(v, "prompt", limits.max_content_chars, allow_empty=False)
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        if len(v) > limits.max_content_chars:
            raise _err("prompt", f"has {len(v)} tokens; too many", "out_of_range")
        for i, t in enumerate(v):
            _integer(t, f"prompt[{i}]", 0, 2**31 - 1)
        return tuple(v)
    if isinstance(v, list) and len(v) > 1 and all(isinstance(t, str) for t in v):
        raise _err("prompt", "one prompt per request (batches are not supported)", "unsupported_value")
    raise _err("prompt", f"must be a non-empty string or an array of token ids, got {_type_name(v)}",
               "invalid_type")


def _common(doc: Mapping, limits: APILimits, kind: str, allowed_noop: tuple[str, ...], extra_keys: tuple[str, ...],
            default_max_tokens: int) -> dict:
    unknown = sorted(set(doc) - set(_COMMON) - set(allowed_noop) - set(extra_keys))
    if unknown:
        raise _err(unknown[0], "unrecognized request argument (this device serves the OpenAI "
                               f"{'chat ' if kind == 'chat' else ''}completions parameters it documents)",
                   "unrecognized_parameter")
    for k in allowed_noop:
        if k in doc and not _NOOP[k](doc[k]):
            raise _err(k, f"is not supported by this device (got {str(doc[k])[:60]!r})", "unsupported_value")
    out: dict[str, Any] = {"kind": kind}
    model = doc.get("model")
    if model is not None:
        out["model"] = _text(model, "model", 256)
    max_tokens = doc.get("max_tokens")
    if kind == "chat" and doc.get("max_completion_tokens") is not None:
        if max_tokens is not None:
            raise _err("max_completion_tokens", "give max_tokens or max_completion_tokens, not both", "invalid_value")
        max_tokens = _integer(doc["max_completion_tokens"], "max_completion_tokens", 1, limits.max_new_tokens)
    elif max_tokens is not None:
        max_tokens = _integer(max_tokens, "max_tokens", 1, limits.max_new_tokens)
    out["max_tokens"] = max_tokens
    out["default_max_tokens"] = default_max_tokens
    if doc.get("temperature") is not None:
        out["temperature"] = _number(doc["temperature"], "temperature", 0.0, limits.max_temperature)
    if doc.get("top_p") is not None:
        out["top_p"] = _number(doc["top_p"], "top_p", 0.0, 1.0, lo_open=True)
    out["stop"] = _stop(doc.get("stop"), limits)
    if doc.get("seed") is not None:
        # OpenAI's seed is an int64; the sampler's PCG64 takes [0, 2**63)
        out["seed"] = _integer(doc["seed"], "seed", 0, 2**63 - 1)
    if doc.get("stream") is not None:
        out["stream"] = _boolean(doc["stream"], "stream")
    opts = doc.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _err("stream_options", f"must be an object, got {_type_name(opts)}", "invalid_type")
        if set(opts) - {"include_usage"}:
            raise _err(f"stream_options.{sorted(set(opts) - {'include_usage'})[0]}", "unrecognized option",
                       "unrecognized_parameter")
        if not out.get("stream"):
            raise _err("stream_options", "is only allowed with stream: true", "invalid_value")
        out["include_usage"] = _boolean(opts.get("include_usage", False), "stream_options.include_usage")
    return out


def parse_chat_request(body: bytes, limits: APILimits = DEFAULT_LIMITS) -> GenerationRequest:
    """Check a ``POST /v1/chat/completions`` body (module docstring).

    Args:
        body: the raw request body bytes.
        limits: the caps.

    Returns:
        the checked :class:`GenerationRequest` (kind ``"chat"``).

    Raises:
        APIRequestError: (400) the body is too large or not a JSON object, or a parameter is
            missing, of the wrong JSON type, out of range, unknown or unsupported; ``param``
            names it.
    """
    doc = _load(body, limits)
    out = _common(doc, limits, "chat", _CHAT_NOOP, ("messages", "max_completion_tokens"), limits.default_max_tokens)
    return GenerationRequest(messages=_messages(doc.get("messages"), limits), **out)


def parse_completion_request(body: bytes, limits: APILimits = DEFAULT_LIMITS) -> GenerationRequest:
    """Check a ``POST /v1/completions`` body (module docstring; ``max_tokens`` defaults to
    16 as in OpenAI's reference).

    Raises:
        APIRequestError: as :func:`parse_chat_request`; ``prompt`` must be a non-empty
            string (or a one-string array) or a non-empty array of token ids.
    """
    doc = _load(body, limits)
    out = _common(doc, limits, "completion", _COMPLETION_NOOP, ("prompt",), 16)
    return GenerationRequest(prompt=_prompt(doc.get("prompt"), limits), **out)


def fit_context(req: GenerationRequest, prompt_tokens: int, max_context: int, vocab_size: int | None = None,
                prompt_ids: tuple[int, ...] = ()) -> int:
    """The number of new tokens to allow: ``req.max_tokens``, or ``req.default_max_tokens``
    limited by what the context has left.

    Args:
        req: the checked request.
        prompt_tokens: tokens in the rendered prompt.
        max_context: the release's context limit (``generation_config.json``), tokens.
        vocab_size: the tokenizer's vocabulary size, to check token-id prompts.
        prompt_ids: the prompt's token ids when the client sent ids.

    Raises:
        APIRequestError: (400, code ``context_length_exceeded``) the prompt leaves no room
            or prompt + ``max_tokens`` exceeds the context; a token id outside the
            vocabulary (param ``prompt[i]``).
    """
    if vocab_size is not None:
        for i, t in enumerate(prompt_ids):
            if t >= vocab_size:
                raise _err(f"prompt[{i}]", f"token id {t} is outside the vocabulary of {vocab_size}", "out_of_range")
    where = "messages" if req.kind == "chat" else "prompt"
    room = max_context - prompt_tokens
    if room < 1:
        raise _err(where, f"the prompt has {prompt_tokens} tokens; this model's context is {max_context} tokens",
                   "context_length_exceeded")
    if req.max_tokens is None:
        return min(room, req.default_max_tokens, MAX_NEW_TOKENS_CAP)
    if req.max_tokens > room:
        raise _err("max_tokens", f"{prompt_tokens} prompt tokens + max_tokens {req.max_tokens} exceed this model's "
                                 f"context of {max_context} tokens; ask for at most {room}", "context_length_exceeded")
    return req.max_tokens
