"""An in-process stand-in for Flower's Grid: real flwr Message objects, real partner
handlers (tests/support/faults_partner.py), no Ray -- so a whole campaign
(:func:`sealfl.server.app.run_server`) runs in a few seconds and a test can make nodes
leave, stay silent, or have the SuperLink answer for them.

It is a Flower ``Grid``, so the ServerApp reads its replies through
:class:`sealfl.server.streaming.ReplyStream`: :meth:`FakeGrid.push_messages` delivers the
messages (handlers run at once) and :meth:`FakeGrid.pull_messages` hands their replies
out, each once, as flwr's grids do.
Like flwr 1.42's ``InMemoryGrid.push_messages``, pushing sets each message's id in place; replies are built by the handlers with
``Message(content, reply_to=msg)``; a node that is not connected gets the error reply
the SuperLink itself writes (``create_message_error_unavailable_res_message``, source
node id 1).
"""

from __future__ import annotations

from typing import Callable
from uuid import uuid4

from flwr.app import Context, Message, RecordDict
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message
from flwr.serverapp import Grid

from tests.support import faults_partner


class StubGrid(Grid):
    """flwr's ``Grid`` with the parts a ServerApp here does not use left unimplemented."""

    def set_run(self, run):  # pragma: no cover
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # pragma: no cover
        raise NotImplementedError


class FakeGrid(StubGrid):
    """Nodes ``node_ids[i]`` run partition ``i``.

    Attributes:
        connected: node ids the SuperLink sees (tests remove ids to make partners leave).
        unreachable: node ids listed as connected whose messages the SuperLink answers
            itself with "node unavailable" (source node id 1).
        silent: node ids that never reply (their messages time out).
        on_round: optional callback ``(grid, message_type) -> None`` before each delivery.
        after_round: the same, after each delivery (e.g. a partner leaving between rounds).
        sent: every message pushed so far.
    """

    def __init__(self, consortium_dir: str, n: int, faults: dict[int, str] | None = None, pad_bytes: int = 64 << 20,
                 handler: Callable[[Message, Context], Message] | None = None):
        self.cdir = consortium_dir
        self.node_ids = [101 + 7 * i for i in range(n)]
        self.connected = set(self.node_ids)
        self.silent: set[int] = set()
        self.unreachable: set[int] = set()
        self.faults = dict(faults or {})
        self.pad_bytes = pad_bytes
        self.handler = handler
        self.sent: list[Message] = []
        self.on_round: Callable[["FakeGrid", str], None] | None = None
        self.after_round: Callable[["FakeGrid", str], None] | None = None
        self.pull_interval = 0.01  # seconds between a ReplyStream's pulls
        self.pulls = 0
        self._ready: dict[str, list[Message]] = {}
        self._ctx = {nid: Context(run_id=1, node_id=nid, node_config={"partition-id": i}, state=RecordDict(),
                                  run_config={}) for i, nid in enumerate(self.node_ids)}

    def get_node_ids(self):
        return sorted(self.connected)

    def push_messages(self, messages):
        """Deliver ``messages`` (see :meth:`_deliver`); their replies wait for :meth:`pull_messages`."""
        messages = list(messages)
        for reply in self._deliver(messages):
            self._ready.setdefault(reply.metadata.reply_to_message_id, []).append(reply)
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids):
        """The waiting replies to ``message_ids``, each handed out once."""
        self.pulls += 1
        return [r for mid in list(message_ids) for r in self._ready.pop(mid, [])]

    def send_and_receive(self, messages, *, timeout=None):
        """Deliver ``messages`` and return their replies at once (no pull; ``timeout``
        unused: handlers run synchronously). A ServerApp here reads replies by push/pull."""
        return self._deliver(list(messages))

    def _deliver(self, messages):
        if messages and self.on_round is not None:
            self.on_round(self, messages[0].metadata.message_type)
        out = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid4().hex  # as InMemoryGrid.push_messages does
            self.sent.append(msg)
            nid = msg.metadata.dst_node_id
            if nid not in self.connected or nid in self.unreachable:
                out.append(create_message_error_unavailable_res_message(msg.metadata, "node_unavail"))
                continue
            if nid in self.silent:
                continue
            try:
                if self.handler is not None:
                    out.append(self.handler(msg, self._ctx[nid]))
                else:
                    out.append(faults_partner.reply(msg, self._ctx[nid], self.cdir, self.faults, self.pad_bytes))
            except Exception as exc:  # as Flower's simulation engine reports a ClientApp exception
                from flwr.app import Error

                out.append(Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg))
        if messages and self.after_round is not None:
            self.after_round(self, messages[0].metadata.message_type)
        return out
