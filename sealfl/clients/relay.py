"""The ClientApp a SuperNode runs, relaying each message to the partner's long-lived process.

Why: Flower 1.42 starts a fresh ``flwr-clientapp`` process for every message (subprocess
isolation). Importing the partner's task (torch, ~4 s here), the HE library, unwrapping the
kit and loading the data in each of them dominated every deployed round. :data:`app` imports
only Flower; when the node config names ``partner-socket`` it hands the message to the
process ``sealfl partner start`` runs (:class:`PartnerRelay`, which has the kit, the task and
the data loaded once) and returns its reply. Without ``partner-socket`` (simulation,
``flwr run .`` in the local simulation federation) it runs the handlers of
:mod:`sealfl.clients.app` in-process.

Wire format over the Unix socket (one request per connection)::

    request:  u32 len | Message protobuf | u32 len | Context protobuf
    reply:    u8 status (0 ok, 1 error) | u32 len | Message protobuf (ok) or UTF-8 error text

Big-endian lengths, each at most :data:`MAX_FRAME` bytes. The socket lives in a directory
of mode 0700 and the server accepts only peers of its own uid (``SO_PEERCRED``); a frame
that is too long or cut short ends that connection and nothing else.

Process lifetime: the ``flwr-clientapp`` process running :data:`app` is a child of the
SuperNode's SuperExec, and Flower ends it only through a thread polling ``--parent-pid``
whose SIGINT handler first tries to push a status to the (dead) SuperNode; a ClientApp whose
SuperNode was killed with -9 mid-message was seen to outlive it (ppid 1). On the relayed
path, :func:`follow_superexec` has the kernel SIGKILL this process when its parent dies
(``PR_SET_PDEATHSIG``; SuperExec starts ClientApps from its main thread, which the signal
follows), and ends it at once if the parent named by ``--parent-pid`` is already gone.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

log = logging.getLogger(__name__)

__all__ = ["app", "PartnerRelay", "RelayError", "MAX_FRAME", "SOCKET_KEY", "follow_superexec"]

#: node_config key naming the partner process's socket
SOCKET_KEY = "partner-socket"
#: the largest frame either side reads (a causal-LM update is tens of MB)
MAX_FRAME = 1 << 30
_LEN = struct.Struct(">I")


class RelayError(Exception):
    """The partner process refused or failed a message; the text is its reason."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes is over the {MAX_FRAME}-byte cap")
    return _recv_exact(sock, n)


def _frame(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def relay(path: str, msg: Message, context: Context) -> Message:
    """Send ``msg`` and ``context`` to the partner process at ``path``; return its reply as
    a reply to ``msg``. Raises RelayError (the partner's reason) or ConnectionError."""
    from flwr.common.serde import context_to_proto, message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(_frame(message_to_proto(msg).SerializeToString())
                  + _frame(context_to_proto(context).SerializeToString()))
        status = _recv_exact(s, 1)
        body = _recv_frame(s)
    if status != b"\0":
        raise RelayError(body.decode("utf-8", "replace"))
    proto = ProtoMessage()
    proto.ParseFromString(body)
    reply = message_from_proto(proto)
    return Message(content=reply.content, reply_to=msg)


_following = False


def follow_superexec(argv: list[str] | None = None) -> None:
    """Make this process die with its parent (module docstring): ``PR_SET_PDEATHSIG`` =
    SIGKILL, then ``os._exit(1)`` if the parent is no longer the one ``--parent-pid`` in
    ``argv`` (default ``sys.argv``, Flower's ``flwr-clientapp`` command line) names. Once per
    process; Linux only (raises OSError if prctl fails)."""
    global _following
    if _following:
        return
    import sys

    from sealfl.common.procs import set_parent_death_signal

    args = sys.argv if argv is None else argv
    set_parent_death_signal()
    _following = True
    if "--parent-pid" in args[:-1]:
        try:
            expected = int(args[args.index("--parent-pid") + 1])
        except ValueError:
            return
        if os.getppid() != expected:  # SuperExec died before the signal was armed
            log.error("flwr-clientapp: its SuperExec (pid %d) is gone; exiting", expected)
            os._exit(1)


def _handle(msg: Message, context: Context) -> Message:
    path = context.node_config.get(SOCKET_KEY)
    if path:
        follow_superexec()
        return relay(str(path), msg, context)
    from sealfl.clients import app as partner

    return partner.app(message=msg, context=context)


app = ClientApp()


@app.query()
def _query(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.train()
def _train(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


class PartnerRelay:
    """The partner side: serves messages on a Unix socket with the handlers of
    :mod:`sealfl.clients.app` in this (long-lived) process, one at a time, in a daemon thread.

    ``node_config`` is what the handlers see as the node config (``kit-dir``); the
    Context's run config and ids come from the SuperNode with each message.
    """

    def __init__(self, path: str, node_config: dict):
        self.path = path
        self.node_config = dict(node_config)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._serve, name="partner-relay", daemon=True)
        self.served = 0

    def start(self) -> "PartnerRelay":
        self._thread.start()
        return self

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._one(conn)
                except Exception as exc:  # noqa: BLE001 - one bad connection never stops the partner
                    log.warning("relay connection dropped: %s", exc)

    def _one(self, conn: socket.socket) -> None:
        from flwr.common.serde import context_from_proto, message_from_proto, message_to_proto
        from flwr.proto.message_pb2 import Context as ProtoContext
        from flwr.proto.message_pb2 import Message as ProtoMessage

        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            raise ConnectionError(f"peer uid {uid} is not this partner's uid {os.getuid()}")
        pm, pc = ProtoMessage(), ProtoContext()
        pm.ParseFromString(_recv_frame(conn))
        pc.ParseFromString(_recv_frame(conn))
        msg, ctx = message_from_proto(pm), context_from_proto(pc)
        ctx = Context(run_id=ctx.run_id, node_id=ctx.node_id, node_config={**ctx.node_config, **self.node_config},
                      state=ctx.state, run_config=ctx.run_config, series_id=ctx.series_id)
        ctx.node_config.pop(SOCKET_KEY, None)
        from sealfl.clients import app as partner

        try:
            reply = partner.app(message=msg, context=ctx)
        except Exception as exc:  # the partner's refusal travels back as the reply's error
            log.error("message %s refused: %s", msg.metadata.message_type, exc)
            conn.sendall(b"\1" + _frame(f"{type(exc).__name__}: {exc}".encode()))
            return
        self.served += 1
        conn.sendall(b"\0" + _frame(message_to_proto(reply).SerializeToString()))

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass
