"""Child side of the sandboxed LLM runtime (run as a script by :class:`sealfl.enclave.sandbox.llm_runtime.LLMRuntime`).

Same sandbox as :mod:`sealfl.enclave.sandbox.child` (whose protocol, limits and network
isolation it reuses, loaded by path from this directory): ``python -I``, minimal environment, cwd ``/``,
``RLIMIT_AS``, no core dumps, an empty network namespace where the kernel allows it (else a
seccomp filter denying ``socket()``),
protocol on a private dup of stdout. It imports only the standard library, numpy,
onnxruntime and :mod:`sealfl.enclave.sandbox.decode` (by path, like the sandbox child); never
torch, tokenizers or sealfl. The model never exists as a file: ``init`` either carries it as
one blob (``onnxruntime.InferenceSession(bytes)``), or -- what the parent does -- says
``"model_pipe": <size>`` and the parent writes the bytes into a pipe of their own
(``--model-fd``), which onnxruntime reads to EOF as the file ``/proc/self/fd/N``: no copy of
the model in this process but onnxruntime's own (a ``bytes`` object cost two more while
onnxruntime parsed it: 478 vs 358 MiB peak for the 125 MB INT4 release).

Requests after ``init`` (reply: inputs/outputs, pid, network):

* ``{"op": "generate", "prompt": [ids], "params": {...}, "stop_ids": [ids]}`` -- prefill
  the prompt, then **stream**: one reply ``{"ok": true, "token": id, "eos": bool, "last":
  bool}`` per token, without waiting for the parent, until ``"last": true`` (a token in
  ``stop_ids`` -- ``"eos": true`` --, ``max_tokens`` or the context limit) or an error reply.
  Between two tokens the child looks (without blocking) whether the parent wrote: a
  ``{"op": "stop"}`` ends the generation with ``{"ok": true, "stopped": true}``, a
  ``shutdown`` ends the child. A ``stop`` that arrives after the last token is answered
  the same way, so the parent reads up to exactly one ``stopped`` reply per stop it sends.
  The parent owns stop strings, detokenisation and client disconnects (it sends ``stop``).
  The tokens of a stream are the tokens the lock-step protocol of earlier versions gave
  (same prefill, same steps, same choice); only the waiting is gone.
* the decoder runs the graph with one preallocated KV buffer bound as past and present
  (:class:`~sealfl.enclave.sandbox.decode.KVDecoder`), the last position's logits in one
  preallocated row, greedy argmax on that float32 row: per step one token id crosses the
  pipe and nothing is copied in Python.
* ``{"op": "score", "sequences": [[ids]...], "prefill": [n...], "top_k": k}`` -- teacher-
  forced logits computed as a generation computes them (prefill, then token by token);
  replies the top ``k`` ids and logits of every position (two .npy blobs per sequence).
* ``ping``, ``shutdown`` as in the tabular child.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name: str):
    """The module ``name``.py of this directory, loaded by path under a private name (the
    child runs as a script with ``-I``: no sealfl package, and nothing added to sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_sealfl_sandbox_{name}", os.path.join(_HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if __package__:  # imported as sealfl.enclave.sandbox.llm_child (tests)
    from sealfl.enclave.sandbox import child as rc
    from sealfl.enclave.sandbox import decode as _decode
else:  # run as a script by the parent: sealfl/enclave/sandbox/child.py, protocol, limits, network isolation
    rc = _sibling("child")
    _decode = None

__all__ = ["main"]


def _top_k(logits, k: int):
    import numpy as np

    idx = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    return idx.astype(np.int64), np.take_along_axis(logits, idx, axis=-1).astype(np.float32)


class _Requests:
    """The parent's requests after ``init``, read from the raw pipe with a buffer of our own,
    so the decode loop can ask :meth:`pending` without blocking. (Until ``init`` is answered
    the parent writes nothing more, so the buffered stdin that read ``init`` holds nothing
    beyond it.)"""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, bytearray()

    def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = os.read(self.fd, max(n - len(self.buf), 1 << 16))
            if not chunk:
                raise EOFError("parent closed the pipe")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def pending(self) -> bool:
        """True if a request has (begun to) arrive(d)."""
        return bool(self.buf) or bool(select.select([self.fd], [], [], 0)[0])


def main(argv: Sequence[str] | None = None) -> int:
    """Child entry point; 0 after shutdown/EOF, 2 if the model does not load."""
    parser = argparse.ArgumentParser(description="sealfl sandboxed LLM child")
    parser.add_argument("--memory-limit", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--network", choices=("isolate", "best-effort", "inherit"), default="best-effort")
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=0, help="attention head size when the graph leaves it symbolic")
    parser.add_argument("--parent-pid", type=int, default=0, help="die with this parent (PR_SET_PDEATHSIG)")
    parser.add_argument("--model-fd", type=int, default=-1, help="the pipe the parent writes the model into")
    args = parser.parse_args(argv)
    if args.parent_pid:
        rc._die_with_parent(args.parent_pid)

    stdin = sys.stdin.buffer
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)

    def send(header: dict, blobs: Sequence[bytes] = ()) -> None:
        for chunk in rc.encode_message(header, blobs):
            proto.write(chunk)

    network = rc.apply_network_mode(args.network)  # no namespace: a seccomp filter denying socket()
    if network.startswith("unavailable") and args.network == "isolate":
        send({"ok": False, "error": f"SandboxError: network isolation required but {network}"})
        return 2
    rc._set_limits(args.memory_limit)
    read_exact = rc._reader(stdin)
    cap = args.memory_limit or (1 << 40)
    try:
        header, blobs = rc.read_message(read_exact, cap)
        size = header.get("model_pipe")
        if header.get("op") == "init" and not blobs and args.model_fd >= 0 and isinstance(size, int) \
                and not isinstance(size, bool) and 0 < size <= cap:
            model = f"/proc/self/fd/{args.model_fd}"  # the parent is writing the verified bytes into it
        elif header.get("op") == "init" and len(blobs) == 1:
            model = blobs[0]
        else:
            raise ValueError("first request must be 'init' with exactly one blob (the model bytes), or none and "
                             "'model_pipe': <size> with --model-fd")
        import numpy as np
        import onnxruntime as ort

        dec = _decode or _sibling("decode")  # sealfl/enclave/sandbox/decode.py

        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        # no busy-waiting between ops: a device's cores are shared (the HTTP front, the parent,
        # other services); spinning threads steal them (issue 24: 76 ms/step spinning vs 40 ms
        # not, SmolLM2 INT4 on 2 busy cores; outputs are identical either way)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        del blobs, model
        if args.model_fd >= 0:
            os.close(args.model_fd)
        rc.release_model_bytes(session)
        decoder = dec.KVDecoder(session, max_context=args.max_context, head_dim=args.head_dim or None)
    except EOFError:
        return 2
    except Exception as exc:  # noqa: BLE001 -- every failure goes back to the parent
        send(rc._error(exc))
        return 2
    forbidden = sorted(m for m in sys.modules if m.split(".")[0] in rc.FORBIDDEN_MODULES + ("tokenizers", "sealfl"))
    send({"ok": True, "pid": os.getpid(), "inputs": rc._io_meta(session.get_inputs()),
          "outputs": rc._io_meta(session.get_outputs()), "network": network, "forbidden_modules": forbidden,
          "onnxruntime": ort.__version__, "max_context": args.max_context,
          "shared_kv_buffer": decoder.shared_buffer})
    requests = _Requests(stdin.fileno())
    read_exact = requests.read_exact
    while True:
        try:
            header, blobs = rc.read_message(read_exact, cap)
        except EOFError:
            return 0
        except Exception as exc:  # noqa: BLE001
            send(rc._error(exc))
            return 3
        op = header.get("op")
        try:
            if op == "ping":
                send({"ok": True, "pid": os.getpid(), "network": network})
            elif op == "generate":
                if _generate(header, decoder, dec, np, send, requests, cap) == "shutdown":
                    return 0
            elif op == "stop":  # it arrived after the generation's last token
                send({"ok": True, "stopped": True})
            elif op == "score":
                seqs, prefill, k = header.get("sequences"), header.get("prefill"), int(header.get("top_k", 8))
                if not isinstance(seqs, list) or not isinstance(prefill, list) or len(seqs) != len(prefill) \
                        or not 1 <= k <= 64:
                    raise ValueError("'score' needs equal-length lists 'sequences' and 'prefill' and 1 <= top_k <= 64")
                out = []
                for ids, p in zip(seqs, prefill):
                    idx, val = _top_k(decoder.teacher_forced(ids, int(p)), k)
                    out += [rc.array_to_bytes(idx), rc.array_to_bytes(val)]
                send({"ok": True}, out)
            elif op == "shutdown":
                send({"ok": True})
                return 0
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # noqa: BLE001 -- errors go back to the parent
            decoder.reset()
            send(rc._error(exc))


def _generate(header, decoder, dec, np, send, requests: _Requests, cap) -> str:
    """Run one streamed generation (module docstring); returns "done" or "shutdown"."""
    prompt = header.get("prompt")
    stop_ids = set(int(i) for i in header.get("stop_ids", []))
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("'generate' needs a non-empty 'prompt' list of token ids")
    params = dec.SamplingParams.from_dict(header.get("params") or {})
    rng = np.random.default_rng(params.seed)
    decoder.reset()
    try:
        logits = decoder.feed(prompt, last_only=True, copy=False)[-1]
        for n in range(params.max_tokens):
            tok = dec.choose_token(logits, params, rng)
            last = tok in stop_ids or n + 1 == params.max_tokens or decoder.length + 1 > decoder.max_context
            send({"ok": True, "token": tok, "eos": tok in stop_ids, "last": last})
            if last:
                return "done"
            if requests.pending():
                msg, _ = rc.read_message(requests.read_exact, cap)
                if msg.get("op") == "stop":
                    send({"ok": True, "stopped": True})
                    return "done"
                if msg.get("op") == "shutdown":
                    send({"ok": True})
                    return "shutdown"
                raise ValueError(f"during a generation only stop/shutdown are allowed, got {msg.get('op')!r}")
            logits = decoder.feed([tok], last_only=True, copy=False)[-1]
        return "done"
    finally:
        decoder.reset()


if __name__ == "__main__":
    sys.exit(main())
