"""The device's LLM runtime: verified bytes in, streamed text out.

:class:`LLMRuntime` is built once from a verified release (model bytes, tokenizer, chat
template, generation settings -- all from :class:`~sealfl.attestation.release.VerifiedRelease`
payload bytes, never re-read from disk) and then answers any number of requests:

* the model runs in a **sandboxed child process** (:mod:`sealfl.enclave.sandbox.llm_child`): the
  parent sends it the verified model bytes over a pipe and the child builds
  ``onnxruntime.InferenceSession(bytes)``. Why the child and not a private read-only copy
  in-process: the model is parsed by onnxruntime's native code (protobuf, custom
  operators) -- in the child a fault or exploit stays in a process with no network, no
  secrets, a memory cap and nothing but the pipe; and with bytes over the pipe there is no
  model file at all for another process to swap between verification and load. The KV
  cache and the decode loop live in the child (a cache is ~46 KB per token for
  SmolLM2-135M; shipping it over the pipe per step would cost more than the step);
* the tokenizer (``tokenizers``, the release's ``tokenizer.json``) and the chat template
  (Jinja in a sandboxed environment, configured as transformers' ``apply_chat_template``
  configures it) run in the parent; the child sees only token ids;
* per request: :class:`~sealfl.enclave.sandbox.decode.SamplingParams` (temperature, top-p,
  max tokens, seed, stop strings); a callback receives text pieces as they are decoded
  (a piece never ends inside a multi-byte character or inside a possible stop string) and
  may return False to stop; the result carries prompt and completion token counts and
  the finish reason (``"stop"``: EOS or a stop string, ``"length"``: max tokens or the
  context limit, ``"cancelled"``: the callback stopped it).

One request at a time per runtime (a lock serialises them); a server runs one runtime
per concurrent slot.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sealfl.common.errors import plain_text
from sealfl.enclave.errors import LLMInputError, RuntimeSandboxError
from sealfl.enclave.sandbox import child as _rc
from sealfl.enclave.sandbox.chat_template import ChatTemplate
from sealfl.enclave.sandbox.decode import SamplingParams
from sealfl.enclave.sandbox.detokenize import IncrementalDetokenizer
from sealfl.enclave.sandbox.pipe import widen_pipe, write_all
from sealfl.enclave.sandbox.runtime import DEFAULT_MEMORY_LIMIT_BYTES, SandboxedRuntime
from sealfl.enclave.sandbox.threads import choose_threads

#: the child script (:mod:`sealfl.enclave.sandbox.llm_child`), run by path, never imported here
_LLM_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llm_child.py")

__all__ = ["ChatTemplate", "GenerationResult", "LLMRuntime", "emit_limit"]

log = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """Outcome of :meth:`LLMRuntime.generate`.

    Attributes:
        text: the generated text (stop string excluded).
        token_ids: generated token ids (including an EOS token if one ended it).
        prompt_tokens: tokens in the prompt.
        completion_tokens: tokens generated.
        finish_reason: ``"stop"``, ``"length"`` or ``"cancelled"``.
        seconds_to_first_token: wall time until the first token arrived.
        seconds: wall time of the whole request.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    seconds_to_first_token: float
    seconds: float


def emit_limit(text: str, done: bool, hold: int) -> int:
    """How much of the decoded ``text`` may be streamed now: all of it when the generation is
    done; otherwise not the trailing U+FFFD characters (bytes of a UTF-8 character whose
    remaining bytes have not been generated yet) and not the last ``hold`` characters (they
    could begin a stop string; ``hold`` = longest stop string - 1)."""
    if done:
        return len(text)
    return max(0, len(text.rstrip("\ufffd")) - hold)


class _Child(SandboxedRuntime):
    """A :class:`SandboxedRuntime` whose child runs :mod:`sealfl.enclave.sandbox.llm_child`.

    The model crosses on a pipe of its own, which onnxruntime in the child reads as a file
    (``/proc/self/fd/N``) while this process writes the verified bytes into it: the child
    never holds them as a Python ``bytes`` object, which onnxruntime would copy twice more
    while parsing (its Python binding makes a ``std::string`` and an ``istringstream`` of
    it). Measured on the 125 MB INT4 release (``bench/llm_session_memory.py``): the child's
    peak while building its session 478 MiB from bytes, 357-358 MiB from the pipe, the same
    logits; no memory file or disk copy is involved.
    """

    STAGE_FD = False  # the model comes on its own pipe (below)

    def __init__(self, model_bytes: bytes, *, max_context: int, head_dim: int, **kw) -> None:
        self._max_context = int(max_context)
        self._head_dim = int(head_dim)
        self._model_r, self._model_w = os.pipe()  # both close-on-exec; the child gets the read end by pass_fds
        try:
            super().__init__(model_bytes, **kw)
        finally:
            for fd in (self._model_r, self._model_w):
                try:
                    os.close(fd)
                except OSError:
                    pass  # already closed by _send_model

    def _command(self, memory_limit_bytes: int, intra_op_threads: int, network: str) -> list[str]:
        cmd = [sys.executable, "-I", _LLM_CHILD, "--memory-limit",
               str(int(memory_limit_bytes)), "--threads", str(int(intra_op_threads)), "--network", network,
               "--max-context", str(self._max_context), "--head-dim", str(self._head_dim),
               "--model-fd", str(self._model_r)]
        return cmd + self._parent_args()

    def _pass_fds(self) -> tuple[int, ...]:
        return (self._model_r,)

    def _send_model(self, model_bytes: bytes, staged: bool) -> dict:
        """``init`` names the model pipe; a thread writes the bytes into it (then closes it:
        the child reads to EOF) while this one waits for the reply."""
        os.close(self._model_r)  # the child has its own copy of the read end
        self._model_r = -1
        os.set_blocking(self._model_w, False)
        widen_pipe(self._model_w)
        deadline = time.monotonic() + self._start_timeout_s
        failed: list[BaseException] = []

        def feed() -> None:
            try:
                write_all(self._model_w, [model_bytes], deadline)
            except (OSError, TimeoutError) as exc:  # the child is gone or stuck: the reply says why
                failed.append(exc)
            finally:
                os.close(self._model_w)
                self._model_w = -1

        writer = threading.Thread(target=feed, name="sandbox-model-pipe", daemon=True)
        writer.start()
        try:
            reply, _ = self._request({"op": "init", "model_pipe": len(model_bytes)}, [], self._start_timeout_s)
        finally:
            writer.join()
        if failed:
            raise self._fail(f"did not read the whole model from its pipe ({type(failed[0]).__name__})")
        return reply

    # -- a streamed reply (generate): one request, then replies until the stream ends --

    def post(self, header: dict) -> None:
        """Write one request without waiting for a reply (read the replies with
        :meth:`receive`). Raises RuntimeSandboxError if the child is closed, gone or does
        not take the bytes within ``timeout_s`` (it is then killed)."""
        if self._closed:
            raise RuntimeSandboxError("sandboxed runtime is closed; start a new one")
        message = _rc.encode_message(header)
        with self._lock:
            try:
                self._write_all(message, time.monotonic() + self.timeout_s)
            except TimeoutError as exc:
                raise self._fail(f"did not read {header.get('op')!r} within {self.timeout_s:.1f} s and was killed") \
                    from exc
            except OSError as exc:
                raise self._fail(f"exited before {header.get('op')!r} (crash or memory limit)", 1.0) from exc

    def receive(self) -> dict:
        """Read one reply header, waiting at most ``timeout_s``; an ``ok: false`` reply is
        returned, not raised (the caller knows whether a stream ends with it).

        Raises:
            RuntimeSandboxError: the child is closed, exited, sent a malformed reply or none
                in time (it is then killed).
        """
        if self._closed:
            raise RuntimeSandboxError("sandboxed runtime is closed; start a new one")
        with self._lock:
            try:
                reply, _ = _rc.read_message(self._read_exact_until(time.monotonic() + self.timeout_s),
                                            self._max_reply)
            except TimeoutError as exc:
                raise self._fail(f"sent no generation reply within {self.timeout_s:.1f} s and was killed") from exc
            except (EOFError, BrokenPipeError) as exc:
                raise self._fail("exited during 'generate' (crash or memory limit)", 1.0) from exc
            except (ValueError, OSError) as exc:
                raise self._fail(f"sent a malformed reply to 'generate': {exc}") from exc
        return reply


class LLMRuntime:
    """Generate text with a verified causal-LM release (module docstring).

    Args:
        model_bytes: the verified ONNX model bytes.
        tokenizer_json: the verified ``tokenizer.json`` bytes.
        chat_template: the verified chat template (str).
        generation: the verified generation settings (``eos_token_ids``, ``max_context``,
            ``head_dim`` when the graph leaves it symbolic, optional ``special_tokens`` for
            the template).
        memory_limit_bytes, timeout_s, start_timeout_s, network: as for
            :class:`~sealfl.enclave.sandbox.runtime.SandboxedRuntime`.
        intra_op_threads: onnxruntime threads of the child; None: the cores really free
            (:func:`sealfl.enclave.sandbox.threads.choose_threads`).
        die_with_parent: the child gets ``PR_SET_PDEATHSIG`` (SIGKILL): it dies when the
            thread that created this runtime exits -- create it on a thread that lives as
            long as the runtime (a server's main thread).

    Raises:
        RuntimeSandboxError: the child could not load the model.
        ValueError: the tokenizer, template or generation settings do not parse.
    """

    def __init__(self, model_bytes: bytes, tokenizer_json: bytes, chat_template: str, generation: Mapping, *,
                 memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES, timeout_s: float = 60.0,
                 start_timeout_s: float = 120.0, intra_op_threads: int | None = None,
                 network: str = "best-effort", die_with_parent: bool = False) -> None:
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_str(bytes(tokenizer_json).decode("utf-8"))
        except Exception as exc:  # tokenizers raises its own Exception type
            raise LLMInputError(f"tokenizer.json does not parse: {exc}") from exc
        eos = generation.get("eos_token_ids")
        if not isinstance(eos, list) or not eos or any(isinstance(e, bool) or not isinstance(e, int) for e in eos):
            raise LLMInputError("generation settings need a non-empty list of integer eos_token_ids")
        self.eos_token_ids = [int(e) for e in eos]
        self.max_context = int(generation.get("max_context", 2048))
        head_dim = generation.get("head_dim", 0)
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 0:
            raise LLMInputError("generation setting head_dim must be a non-negative integer")
        special = generation.get("special_tokens") or {}
        if not isinstance(special, Mapping) or any(not isinstance(v, str) for v in special.values()):
            raise LLMInputError("generation special_tokens must map names to strings")
        self.chat_template = ChatTemplate(chat_template, special)
        threads = choose_threads(1, intra_op_threads)  # the cores really free (sealfl.enclave.sandbox.threads)
        self._child = _Child(model_bytes, max_context=self.max_context, head_dim=head_dim,
                             memory_limit_bytes=memory_limit_bytes,
                             timeout_s=timeout_s, start_timeout_s=start_timeout_s, intra_op_threads=threads,
                             network=network, die_with_parent=die_with_parent)
        self.pid = self._child.pid
        self.network = self._child.network
        self._lock = threading.Lock()

    # -- text <-> tokens ------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added; the chat template writes them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens skipped)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[Mapping]) -> str:
        """The prompt text for a chat (generation prompt appended)."""
        return self.chat_template.render(messages, add_generation_prompt=True)

    # -- generation -----------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 on_text: Callable[[str], bool | None] | None = None,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """Generate a continuation of ``prompt`` (text, or token ids).

        ``on_text(piece)`` is called with each new piece of text; returning False stops the
        generation (finish reason ``"cancelled"``). ``on_token(n)`` is called as each
        generated token arrives from the child, ``n`` = tokens generated so far (for
        latency and KV-cache accounting; it cannot stop the generation).

        Raises:
            ValueError: empty prompt, or prompt + max_tokens beyond the context limit.
            RuntimeSandboxError: the child failed, crashed or timed out.
        """
        params = params or SamplingParams()
        ids = list(prompt) if not isinstance(prompt, str) else self.encode(prompt)
        if not ids:
            raise LLMInputError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise LLMInputError(f"the prompt has {len(ids)} tokens; the context limit is {self.max_context}")
        with self._lock:
            return self._generate(ids, params, on_text, on_token)

    def _generate(self, ids, params, on_text, on_token) -> GenerationResult:
        child = self._child
        t0 = time.perf_counter()
        first = None
        out: list[int] = []
        detok = IncrementalDetokenizer(self.tokenizer)
        text, emitted, finish = "", 0, "length"
        stop_strings = params.stop
        longest = max((len(s) for s in stop_strings), default=1)
        child.post({"op": "generate", "prompt": ids, "params": params.to_dict(), "stop_ids": self.eos_token_ids})
        streaming = True  # the child sends tokens until its "last" one, an error, or our "stop"
        try:
            while True:
                reply = child.receive()
                if not reply.get("ok"):
                    streaming = False  # an error reply ends the stream
                    raise RuntimeSandboxError(f"sandboxed runtime (pid {child.pid}) failed 'generate': "
                                              f"{plain_text(str(reply.get('error', 'unknown error')))}")
                streaming = not reply.get("last")
                tok = reply.get("token")
                if isinstance(tok, bool) or not isinstance(tok, int):
                    raise child.fail(f"sent a generation reply without a token: {reply}")
                first = first if first is not None else time.perf_counter() - t0
                out.append(tok)
                if on_token is not None:
                    on_token(len(out))
                if reply.get("eos"):
                    finish = "stop"
                piece = detok.add(tok)
                if finish == "stop" or not streaming:
                    piece += detok.flush()
                # only the new text (and the longest stop string's length before it) can hold
                # the first occurrence: the text before it held none
                start = max(0, len(text) - longest + 1)
                text += piece
                cut = min((i for i in (text.find(s, start) for s in stop_strings) if i >= 0), default=-1)
                if cut >= 0:
                    text = text[:cut]
                    finish = "stop"
                done = finish == "stop" or not streaming
                safe = emit_limit(text, done, longest - 1 if stop_strings else 0)
                if on_text is not None and safe > emitted:
                    keep_going = on_text(text[emitted:safe])
                    emitted = safe
                    if keep_going is False and not done:
                        finish = "cancelled"
                        break
                if done:
                    if cut < 0 and not reply.get("eos"):
                        finish = "length"
                    break
        except BaseException:
            if streaming and child.alive:
                try:
                    self._stop_stream()
                except RuntimeSandboxError:
                    pass
            raise
        if streaming:  # a stop string or the caller ended it: the child may be a few tokens ahead
            self._stop_stream()
        if finish == "cancelled":
            text += detok.flush()  # the held-back bytes too, as the whole sequence decodes
        return GenerationResult(text, out, len(ids), len(out), finish, first or 0.0, time.perf_counter() - t0)

    def _stop_stream(self) -> None:
        """Tell the child to end the generation and read what it sent meanwhile up to its
        ``stopped`` reply (it answers a stop exactly once, also one that arrives after its
        last token)."""
        child = self._child
        child.post({"op": "stop"})
        while not child.receive().get("stopped"):
            pass

    def score(self, sequences: Sequence[Sequence[int]], prefill: Sequence[int], top_k: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
        """Teacher-forced top-``k`` ids (int64 (L, k)) and logits (float32 (L, k)) of each
        sequence, computed as a generation computes them (prefill, then token by token)."""
        with self._lock:
            _, blobs = self._child.request({"op": "score", "sequences": [list(map(int, s)) for s in sequences],
                                            "prefill": [int(p) for p in prefill], "top_k": int(top_k)})
        arrays = [_rc.bytes_to_array(b) for b in blobs]
        return list(zip(arrays[0::2], arrays[1::2]))

    def health_check(self) -> dict:
        """Ping the child (see :meth:`SandboxedRuntime.health_check`); waits for a running
        generation to end (its replies share the pipe)."""
        with self._lock:
            return self._child.health_check()

    @property
    def alive(self) -> bool:
        """True while the child runs."""
        return self._child.alive

    def close(self) -> None:
        """Stop the child. Idempotent."""
        self._child.close()

    def __enter__(self) -> "LLMRuntime":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
