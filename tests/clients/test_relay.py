"""The SuperNode's relay ClientApp and the partner process behind it (sealfl.clients.relay)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from sealfl.clients.kit import kit_dir, load_kit
from sealfl.clients.relay import MAX_FRAME, PartnerRelay, RelayError, relay
from sealfl.common import protocol as P
from sealfl.he.framed import WIDE
from sealfl.platform.consortium import create_consortium

ROOT = Path(__file__).resolve().parents[2]


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


# -- the relayed ClientApp dies with its SuperExec ------------------------------------------

_GRANDCHILD = r"""
import os, sys, time
sys.argv = ["flwr-clientapp", "--token", "t", "--parent-pid", str(os.getppid())]
if {follow}:
    from sealfl.clients.relay import follow_superexec
    follow_superexec()
open({ready!r}, "w").close()
time.sleep(120)
"""

_SUPEREXEC = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {code!r}])
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _superexec_with_clientapp(tmp_path: Path, follow: bool) -> tuple[subprocess.Popen, int]:
    ready = tmp_path / f"ready-{follow}"
    code = _GRANDCHILD.format(follow=follow, ready=str(ready))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    sup = subprocess.Popen([sys.executable, "-c", _SUPEREXEC.format(code=code)], stdout=subprocess.PIPE, text=True,
                           env=env)
    pid = int(sup.stdout.readline())
    t0 = time.monotonic()
    while not ready.exists() and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    assert ready.exists(), "the stand-in ClientApp never started"
    return sup, pid


@pytest.mark.parametrize("follow", [True, False], ids=["following", "without"])
def test_a_relayed_clientapp_dies_when_its_superexec_is_killed(tmp_path, follow):
    sup, pid = _superexec_with_clientapp(tmp_path, follow)
    try:
        sup.kill()  # kill -9 of the SuperExec stand-in
        sup.wait()
        t0 = time.monotonic()
        while _alive(pid) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        # following: the kernel's PR_SET_PDEATHSIG ends it; without it, it lives on (ppid 1):
        # the orphan this guards against
        assert _alive(pid) is not follow
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_clientapp_whose_superexec_is_already_gone_exits_at_once():
    out = subprocess.run([sys.executable, "-c", "from sealfl.clients.relay import follow_superexec; "
                          "follow_superexec(['flwr-clientapp', '--parent-pid', '1']); print('ran on')"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                       os.environ.get("PYTHONPATH")]))})
    assert out.returncode == 1 and "ran on" not in out.stdout, out
