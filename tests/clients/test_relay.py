"""The SuperNode's relay ClientApp and the partner process behind it (sealfl.clients.relay)."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from sealfl.clients.kit import kit_dir, load_kit
from sealfl.clients.relay import MAX_FRAME, PartnerRelay, RelayError, relay
from sealfl.common import protocol as P
from sealfl.he.framed import WIDE
from sealfl.platform.consortium import create_consortium


@pytest.fixture()
def served(tmp_path):
    cons, _ = create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])
    kit = kit_dir(cons.dir, "Hungary")
    r = PartnerRelay(str(tmp_path / "r.sock"), {"kit-dir": str(kit)}).start()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 0, 1
    yield r, kit
    r.close()
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None


def _query(what: str) -> tuple[Message, Context]:
    msg = Message(content=RecordDict({P.CONFIG: ConfigRecord({P.QUERY: what})}), dst_node_id=42,
                  message_type=MessageType.QUERY)
    ctx = Context(run_id=7, node_id=42, node_config={"partner-socket": "ignored"}, state=RecordDict(), run_config={})
    return msg, ctx


def test_a_relayed_message_is_answered_by_the_partner_process_with_its_own_kit(served):
    r, kit = served
    msg, ctx = _query(P.QUERY_STATS)
    reply = relay(r.path, msg, ctx)
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id
    assert reply.content[P.PARTNER][P.NAME] == "Hungary"  # the relay's kit-dir, not anything the message said
    k = load_kit(str(kit))
    stats = k.codec.decrypt(P.from_u8(reply.content[P.STATS][P.STATS_CT].numpy()), 27, WIDE)
    assert stats[0] == reply.content[P.METRICS][P.NUM_EXAMPLES] and np.all(np.isfinite(stats))
    assert r.served == 1


def test_a_refusal_comes_back_as_its_reason_and_bad_frames_end_only_their_connection(served):
    r, _ = served
    with pytest.raises(RelayError, match="unknown query 'nonsense'"):
        relay(r.path, *_query("nonsense"))
    for junk in (struct.pack(">I", MAX_FRAME + 1), struct.pack(">I", 100) + b"short", b"\xff\xff"):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(r.path)
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            assert s.recv(10) == b""  # dropped without an answer
    reply = relay(r.path, *_query(P.QUERY_STATS))  # still serving
    assert reply.content[P.PARTNER][P.NAME] == "Hungary"
