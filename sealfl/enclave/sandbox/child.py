"""Child side of the sandboxed onnxruntime runtime, and the pipe protocol both sides share.

Run by :class:`sealfl.enclave.sandbox.runtime.SandboxedRuntime` as a standalone script
(``python -I .../sandbox_child.py --memory-limit N ...``) so it imports neither the sealfl
package nor anything but the standard library, numpy and onnxruntime. (It also works as
``python -m sealfl.enclave.sandbox.child``.) Before importing numpy/onnxruntime it:

* sets ``RLIMIT_AS`` (address-space cap, bytes) and ``RLIMIT_CORE = 0``;
* tries to enter a fresh, empty network namespace (``unshare(CLONE_NEWNET)``, falling back
  to ``CLONE_NEWUSER | CLONE_NEWNET``), so the model code has no network; where the kernel
  allows neither, it installs a seccomp filter that makes ``socket()`` fail with ``EACCES``
  (:func:`_deny_sockets`; ``--network seccomp`` uses only the filter). The parent logs which;
* moves the protocol onto a private dup of stdout and points fd 1 at stderr, so stray
  prints from native code cannot corrupt the protocol.

Protocol (both directions): a message is ``u64be(len(h)) || h || (u64be(len(b)) || b)*``
where ``h`` is a UTF-8 JSON header ``{..., "nblobs": k}`` followed by ``k`` blobs. Arrays
travel as ``.npy`` bytes (``np.save``/``np.load`` with ``allow_pickle=False``; never pickle).
The first request is ``{"op": "init"}`` with one blob, the model bytes -- or, for a child
started with ``--stage-fd``, ``{"op": "init", "staged": <size>}`` with none: the parent
copied the bytes into that sealed memory file while it verified them
(:mod:`sealfl.enclave.sandbox.stage`) and the child reads them only now; then ``"run"``
(blobs = input arrays, header ``"inputs"`` = their names), ``"ping"``, ``"probe"`` (a
self-check: the child tries a TCP connect to header ``"host"``/``"port"`` and replies
``"connected"`` and ``"error"``) and ``"shutdown"``.
Replies carry ``"ok": true`` or ``"ok": false, "error": "<Type>: <message>"``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import struct
import sys
from collections.abc import Callable, Sequence

__all__ = ["MAX_HEADER_BYTES", "FORBIDDEN_MODULES", "encode_message", "read_message",
           "array_to_bytes", "bytes_to_array", "release_model_bytes", "trim_heap", "main"]

MAX_HEADER_BYTES = 1 << 20
#: Top-level packages that must never be loaded in the child (device installs lack them).
FORBIDDEN_MODULES = ("torch", "tenseal", "flwr")
_LEN = struct.Struct(">Q")
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000


def encode_message(header: dict, blobs: Sequence[bytes] = ()) -> list[bytes]:
    """Encode one protocol message as a list of byte chunks (write them in order)."""
    head = json.dumps({**header, "nblobs": len(blobs)}, separators=(",", ":")).encode("utf-8")
    chunks = [_LEN.pack(len(head)) + head]
    for blob in blobs:
        chunks.append(_LEN.pack(len(blob)))
        chunks.append(blob)
    return chunks


def read_message(read_exact: Callable[[int], bytes], max_blob_bytes: int) -> tuple[dict, list[bytes]]:
    """Read one message with ``read_exact(n) -> exactly n bytes`` (raises EOFError at end).

    Raises:
        EOFError: the stream ended before a message began or mid-message.
        ValueError: header too large or not a JSON object, blob over ``max_blob_bytes``.
    """
    (hlen,) = _LEN.unpack(read_exact(_LEN.size))
    if hlen > MAX_HEADER_BYTES:
        raise ValueError(f"protocol header of {hlen} bytes exceeds {MAX_HEADER_BYTES}")
    header = json.loads(read_exact(hlen).decode("utf-8"))
    if not isinstance(header, dict) or not isinstance(header.get("nblobs"), int):
        raise ValueError("protocol header must be a JSON object with an integer 'nblobs'")
    blobs = []
    for _ in range(header["nblobs"]):
        (blen,) = _LEN.unpack(read_exact(_LEN.size))
        if blen > max_blob_bytes:
            raise ValueError(f"protocol blob of {blen} bytes exceeds cap {max_blob_bytes}")
        blobs.append(read_exact(blen))
    return header, blobs


def array_to_bytes(array) -> bytes:
    """Serialise a numpy array to ``.npy`` bytes (no pickle; object arrays raise ValueError)."""
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def bytes_to_array(data: bytes):
    """Parse ``.npy`` bytes into a numpy array (``allow_pickle=False``)."""
    import numpy as np

    return np.load(io.BytesIO(data), allow_pickle=False)


# ---- child process -------------------------------------------------------------------


def _set_limits(memory_limit: int) -> None:
    import resource

    if memory_limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _die_with_parent(parent_pid: int) -> None:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (prctl(2)): the kernel kills this child when the
    parent thread that started it exits, however it exits. If the parent is already gone
    (it died before the call: ``getppid()`` no longer names it), exit at once."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1 (linux/prctl.h)
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(2)


def _isolate_network() -> str:
    """Enter an empty network namespace; return how (``"netns"``, ``"userns+netns"``) or an error."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as exc:
        return f"unavailable: {exc}"
    for flags, how in ((_CLONE_NEWNET, "netns"), (_CLONE_NEWUSER | _CLONE_NEWNET, "userns+netns")):
        if libc.unshare(flags) == 0:
            return how
    return f"unavailable: {os.strerror(ctypes.get_errno())}"


def apply_network_mode(mode: str) -> str:
    """The child's network for ``--network mode`` (``inherit``, ``best-effort``, ``isolate``,
    ``seccomp``): an empty network namespace, else (or for ``seccomp`` only) the filter of
    :func:`_deny_sockets`. Returns what is active (``"inherited"``, ``"netns"``, ...,
    ``"seccomp"``) or ``"unavailable: <why>"``; the caller decides whether that is fatal.
    Shared by this child and :mod:`sealfl.enclave.sandbox.llm_child`."""
    if mode == "inherit":
        return "inherited"
    network = _isolate_network() if mode != "seccomp" else "unavailable: not tried"
    if network.startswith("unavailable"):
        denied = _deny_sockets()
        network = denied if denied == "seccomp" else f"{network}; {denied}"
    return network


#: seccomp (Linux ``seccomp(2)``, ``linux/filter.h``): audit arch and socket() number per machine.
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}


def _deny_sockets() -> str:
    """Install a seccomp-BPF filter: ``socket()`` (and any syscall of a foreign ABI, e.g.
    i386 ``socketcall`` or x32) fails with ``EACCES``; everything else is allowed.
    Returns ``"seccomp"`` or ``"unavailable: <why>"``."""
    import ctypes
    import platform

    arch = _SECCOMP_ARCH.get(platform.machine())
    if arch is None:
        return f"unavailable: no seccomp filter for {platform.machine()}"
    audit_arch, nr_socket = arch

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    deny, allow = 0x00050000 | 13, 0x7FFF0000  # SECCOMP_RET_ERRNO | EACCES, SECCOMP_RET_ALLOW
    program = [Insn(ld, 0, 0, 4), Insn(jeq, 0, 4, audit_arch), Insn(ld, 0, 0, 0), Insn(jeq, 2, 0, nr_socket),
               Insn(jge, 1, 0, 0x40000000), Insn(ret, 0, 0, allow), Insn(ret, 0, 0, deny)]
    insns = (Insn * len(program))(*program)
    prog = Prog(len(program), insns)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as exc:
        return f"unavailable: {exc}"
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return f"unavailable: PR_SET_NO_NEW_PRIVS: {os.strerror(ctypes.get_errno())}"
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        return f"unavailable: seccomp: {os.strerror(ctypes.get_errno())}"
    return "seccomp"


def _probe(host: str, port: int) -> dict:
    import socket

    try:
        with socket.create_connection((str(host), int(port)), timeout=2.0):
            return {"ok": True, "connected": True, "error": ""}
    except OSError as exc:
        return {"ok": True, "connected": False, "error": f"{type(exc).__name__}: {exc}"}


def _reader(stream) -> Callable[[int], bytes]:
    def read_exact(n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            chunk = stream.read(n - got)
            if not chunk:
                raise EOFError("parent closed the pipe")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    return read_exact


def _stage_path(fd: int, size: int) -> str:
    """The path onnxruntime opens the staged model by (``/proc/self/fd/<fd>``), after
    checking that the parent sealed the memory file against writes and resizing and that
    it holds exactly ``size`` bytes (:mod:`sealfl.enclave.sandbox.stage`). Raises ValueError
    otherwise."""
    import fcntl

    need = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & need != need:
        raise ValueError("the stage file is not sealed against writing and resizing")
    if os.fstat(fd).st_size != size:
        raise ValueError(f"the stage file holds {os.fstat(fd).st_size} bytes, {size} were staged")
    return f"/proc/self/fd/{fd}"


def _error(exc: BaseException) -> dict:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _io_meta(nodes) -> list[dict]:
    return [{"name": n.name, "shape": [d if isinstance(d, int) else str(d) for d in (n.shape or [])],
             "type": n.type} for n in nodes]


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim(0)``); a no-op elsewhere.

    Large ``bytes`` freed by Python go back at once (mmap'd), but onnxruntime's and
    protobuf's freed pieces stay in the malloc arenas and keep counting as resident
    memory: measured on the INT4 SmolLM2 release, ~75 MB of the child's ~330 MB."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def release_model_bytes(session) -> None:
    """Drop the model bytes an ``onnxruntime.InferenceSession`` keeps, then :func:`trim_heap`.

    onnxruntime's Python ``InferenceSession`` holds the bytes it was built from in
    ``_model_bytes`` only to re-create the session on an execution-provider fallback
    (``onnxruntime/capi/onnxruntime_inference_collection.py``, whose comment reads "This is
    bad as we're holding the memory indefinitely"); the CPU provider has no fallback. For
    the 125 MB INT4 SmolLM2 release the child's resident memory after load falls from
    ~515 MB to ~330 MB with both."""
    if getattr(session, "_model_bytes", None) is not None:
        session._model_bytes = None
    trim_heap()


def main(argv: Sequence[str] | None = None) -> int:
    """Child entry point; returns the process exit code (0 after shutdown/EOF, 2 on bad model)."""
    parser = argparse.ArgumentParser(description="sealfl sandboxed onnxruntime child")
    parser.add_argument("--memory-limit", type=int, default=0, help="RLIMIT_AS in bytes (0 = none)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    parser.add_argument("--network", choices=("isolate", "best-effort", "seccomp", "inherit"), default="best-effort")
    parser.add_argument("--parent-pid", type=int, default=0, help="die with this parent (PR_SET_PDEATHSIG)")
    parser.add_argument("--stage-fd", type=int, default=-1,
                        help="a sealed memory file the parent may stage the verified model in (sandbox_stage.py)")
    args = parser.parse_args(argv)
    if args.parent_pid:
        _die_with_parent(args.parent_pid)

    stdin = sys.stdin.buffer
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)

    def send(header: dict, blobs: Sequence[bytes] = ()) -> None:
        for chunk in encode_message(header, blobs):
            proto.write(chunk)

    network = apply_network_mode(args.network)
    if network.startswith("unavailable") and args.network in ("isolate", "seccomp"):
        send({"ok": False, "error": f"SandboxError: network isolation required but {network}"})
        return 2
    _set_limits(args.memory_limit)
    read_exact = _reader(stdin)
    cap = args.memory_limit or (1 << 40)
    try:
        # imported before the model arrives: a prestarted child (SandboxedRuntime.prestart)
        # does this while the parent is still verifying the release
        import onnxruntime as ort

        header, blobs = read_message(read_exact, cap)
        if header.get("op") == "shutdown":  # a prestarted child closed before any model came
            return 0
        if header.get("op") != "init":
            raise ValueError("the first request must be 'init'")
        staged = header.get("staged")
        if staged is None and len(blobs) == 1:
            model = blobs[0]
        elif (not blobs and args.stage_fd >= 0 and isinstance(staged, int) and not isinstance(staged, bool)
              and 0 < staged <= cap):
            # the parent verified these bytes, then said so; onnxruntime reads the sealed file
            # itself (~0.1 s less than bytes: no Python copy). Its directory (/proc/self/fd)
            # would only matter for external data, which verification refused (check 10)
            model = _stage_path(args.stage_fd, staged)
        elif isinstance(staged, int) and not isinstance(staged, bool) and staged > cap:
            raise ValueError(f"the staged model of {staged} bytes exceeds this child's memory limit of {cap} bytes")
        else:
            raise ValueError("'init' needs exactly one blob (the model bytes), or none and 'staged': <size> "
                             "with a stage file")
        del blobs
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        # no busy-waiting between ops: a device's cores are shared (the HTTP front, the parent,
        # other services); spinning threads steal them (issue 24: 76 ms/step spinning vs 40 ms
        # not, SmolLM2 INT4 on 2 busy cores; outputs are identical either way)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        del model
        if args.stage_fd >= 0:
            os.close(args.stage_fd)
            args.stage_fd = -1
        release_model_bytes(session)
    except EOFError:
        return 2
    except Exception as exc:  # noqa: BLE001 -- every failure goes back to the parent
        send(_error(exc))
        return 2
    forbidden = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN_MODULES)
    send({"ok": True, "pid": os.getpid(), "inputs": _io_meta(session.get_inputs()),
          "outputs": _io_meta(session.get_outputs()), "network": network,
          "forbidden_modules": forbidden, "onnxruntime": ort.__version__})
    output_names = [o.name for o in session.get_outputs()]
    while True:
        try:
            header, blobs = read_message(read_exact, cap)
        except EOFError:
            return 0
        except Exception as exc:  # noqa: BLE001 -- a corrupt stream: report and stop
            send(_error(exc))
            return 3
        op = header.get("op")
        try:
            if op == "ping":
                send({"ok": True, "pid": os.getpid(), "network": network})
            elif op == "run":
                names = header.get("inputs")
                if not isinstance(names, list) or len(names) != len(blobs):
                    raise ValueError("'run' needs one blob per name in 'inputs'")
                feed = {name: bytes_to_array(blob) for name, blob in zip(names, blobs)}
                del blobs
                outputs = session.run(output_names, feed)
                send({"ok": True}, [array_to_bytes(o) for o in outputs])
            elif op == "probe":
                send(_probe(header.get("host", ""), header.get("port", 0)))
            elif op == "shutdown":
                send({"ok": True})
                return 0
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # noqa: BLE001 -- inference errors go back to the parent
            send(_error(exc))


if __name__ == "__main__":
    sys.exit(main())
