"""The parent's side of the pipe protocol with a sandboxed child: requests with deadlines.

:class:`ChildChannel` is the half of :class:`sealfl.enclave.sandbox.runtime.SandboxedRuntime`
that talks to a running child (the other half starts, loads and stops it): every write and
read is bounded by a deadline; a child that does not answer in time, exits or sends a
malformed reply is killed by its pid and :class:`RuntimeSandboxError` names what it was doing
(with the tail of its stderr). Replies are parsed without pickle
(:mod:`sealfl.enclave.sandbox.child`'s protocol).

A subclass provides ``_proc`` (the ``subprocess.Popen``), ``_stderr`` (its stderr file),
``_lock``, ``_closed``, ``_loaded``, ``_max_reply``, ``timeout_s``, ``pid`` and
``input_names``.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence

import numpy as np

from sealfl.common.errors import plain_text
from sealfl.enclave.errors import RuntimeSandboxError
from sealfl.enclave.sandbox import child as _child
from sealfl.enclave.sandbox.pipe import read_exact_until, write_all
from sealfl.enclave.sandbox.setup import check_timeout

__all__ = ["ChildChannel"]


class ChildChannel:
    """Requests to a sandboxed child over its pipes (module docstring)."""

    # -- pipe I/O with deadlines -------------------------------------------------------

    def _fail(self, what: str, grace_s: float = 0.0) -> RuntimeSandboxError:
        """Kill the child (after ``grace_s`` seconds to exit by itself) and build the error."""
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - 2000))
        tail = plain_text(self._stderr.read().decode("utf-8", "replace"))  # no colour codes in a refusal
        msg = f"sandboxed runtime (pid {self.pid}) {what}; exit code {code}"
        if tail:
            msg += f"; child stderr: {tail}"
        self._closed = True
        return RuntimeSandboxError(msg)

    def _write_all(self, chunks: Sequence[bytes], deadline: float) -> None:
        write_all(self._proc.stdin.fileno(), chunks, deadline)

    def _read_exact_until(self, deadline: float):
        return read_exact_until(self._proc.stdout.fileno(), deadline)

    def _request(self, header: dict, blobs: Sequence[bytes], timeout: float) -> tuple[dict, list[bytes]]:
        if self._closed:
            raise RuntimeSandboxError("sandboxed runtime is closed; start a new one")
        op = header.get("op")
        if not self._loaded and op != "init":
            raise RuntimeSandboxError(f"cannot {op!r}: no model loaded yet (prestart() needs load())")
        timeout = check_timeout(timeout)
        # the whole message is built and checked before a byte is written: a bad argument
        # must not leave half a message in the pipe (the child would read the next as its rest)
        if isinstance(blobs, (bytes, bytearray, str)) or not all(isinstance(b, (bytes, bytearray)) for b in blobs):
            raise RuntimeSandboxError("request blobs must be a sequence of bytes objects")
        try:
            message = _child.encode_message(header, blobs)
        except (TypeError, ValueError, RecursionError) as exc:
            raise RuntimeSandboxError(f"request header {op!r} is not JSON-serialisable: {exc}") from exc
        deadline = time.monotonic() + timeout
        with self._lock:
            try:
                self._write_all(message, deadline)
                reply, out = _child.read_message(self._read_exact_until(deadline), self._max_reply)
            except TimeoutError as exc:
                raise self._fail(f"did not answer {op!r} within {timeout:.1f} s and was killed") from exc
            except (EOFError, BrokenPipeError) as exc:
                raise self._fail(f"exited during {op!r} (crash or memory limit)", 1.0) from exc
            except (ValueError, OSError) as exc:
                raise self._fail(f"sent a malformed reply to {op!r}: {exc}") from exc
        if not reply.get("ok"):
            error = plain_text(str(reply.get("error", "unknown error")))
            if op == "init":
                raise self._fail(f"could not load the model: {error}", 1.0)
            raise RuntimeSandboxError(f"sandboxed runtime (pid {self.pid}) failed {op!r}: {error}")
        return reply, out

    def request(self, header: dict, blobs: Sequence[bytes] = (), timeout: float | None = None) -> tuple[dict, list[bytes]]:
        """Send one protocol request and return ``(reply header, reply blobs)``.

        Raises:
            RuntimeSandboxError: ``op`` is ``init``/``shutdown`` (those are :meth:`load` and
                :meth:`close`), the child replied ``ok: false``, crashed, sent a malformed
                reply or did not answer within ``timeout`` (default ``timeout_s``).
        """
        if not isinstance(header, Mapping) or header.get("op") in ("init", "shutdown"):
            op = header.get("op") if isinstance(header, Mapping) else header
            raise RuntimeSandboxError(f"request op {op!r} is not allowed here: a model is given with load(), "
                                      "the child is stopped with close()")
        return self._request(header, blobs, self.timeout_s if timeout is None else timeout)

    def send(self, header: dict) -> dict:
        """:meth:`request` without blobs; returns the reply header."""
        return self.request(header)[0]

    def fail(self, what: str) -> RuntimeSandboxError:
        """Kill the child and return the error describing ``what`` went wrong."""
        return self._fail(what)

    # -- API ---------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run the model; returns the outputs in :attr:`output_names` order.

        Args:
            inputs: ``{input name: numpy array}``; dtypes/shapes as the model declares.

        Raises:
            RuntimeSandboxError: unknown input names, an inference error in the child (its
                message is included), a crash, or no reply within ``timeout_s``.
        """
        if self._closed:
            raise RuntimeSandboxError("sandboxed runtime is closed; start a new one")
        if not self._loaded:
            raise RuntimeSandboxError("cannot 'run': no model loaded yet (prestart() needs load())")
        if not isinstance(inputs, Mapping):
            raise RuntimeSandboxError(f"inputs must be a mapping of input name to array, got {type(inputs).__name__}")
        if not all(isinstance(k, str) for k in inputs):
            raise RuntimeSandboxError(f"input names must be strings; the model takes {self.input_names}")
        unknown = sorted(k for k in inputs if k not in self.input_names)
        if unknown:
            raise RuntimeSandboxError(f"unknown model inputs {unknown}; the model takes {self.input_names}")
        names = list(inputs)
        try:
            blobs = [_child.array_to_bytes(np.asarray(inputs[n])) for n in names]
        except ValueError as exc:
            raise RuntimeSandboxError(f"cannot send inputs to the sandbox: {exc}") from exc
        _, out = self._request({"op": "run", "inputs": names}, blobs, self.timeout_s)
        try:
            return [_child.bytes_to_array(b) for b in out]
        except ValueError as exc:
            raise self._fail(f"returned an unreadable output array: {exc}") from exc

    def health_check(self) -> dict:
        """Ping the child; returns ``{"ok": True, "pid": int, "network": str}``.

        Raises:
            RuntimeSandboxError: the child is gone or did not answer within ``timeout_s``.
        """
        reply, _ = self._request({"op": "ping"}, [], self.timeout_s)
        return {"ok": True, "pid": reply.get("pid"), "network": reply.get("network")}
