"""The SuperNode launcher (sealfl.platform.supernode_main): Flower's own waits are where it
says, they are the ones replaced, and nothing else changes."""

from __future__ import annotations

import inspect
import subprocess
import sys
import time
import types

import pytest

from sealfl.platform import supernode_main as sm
from sealfl.platform.errors import DeploymentError


def _fresh_flower_module():
    """Flower's start_client_internal module, loaded again from its file (so a patch in this
    test touches nothing the rest of the session imported)."""
    import importlib.util

    from flwr.supernode import start_client_internal as real

    spec = importlib.util.spec_from_file_location("sci_copy_for_test", real.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flwr_still_has_the_waits_the_launcher_replaces():
    """Fails when a Flower upgrade moves or renames what is patched: then update the launcher."""
    import flwr
    from flwr.supernode import start_client_internal as sci

    assert flwr.__version__.startswith("1.42."), flwr.__version__  # the version the line numbers are for
    assert sci.time is time or isinstance(sci.time, sm.Waits)
    assert "time.sleep(3)" in inspect.getsource(sci.start_client_internal)
    assert inspect.getsource(sci._push_messages).count("time.sleep(0.5)") == 2
    assert sm.check_flower(sci) is sci


def test_patch_maps_exactly_flowers_fixed_waits_and_passes_others_through():
    mod = _fresh_flower_module()
    slept: list[float] = []
    now = [100.0]
    shim = sm.patch(mod, sleep=slept.append, clock=lambda: now[0])
    assert mod.time is shim
    mod.time.sleep(0.5)    # waiting for the ClientApp's reply, right after the last message
    mod.time.sleep(1.25)   # any other duration: unchanged
    assert slept == [sm.REPLY_POLL_S, 1.25] and sm.REPLY_POLL_S < 0.5
    assert mod.time.monotonic is time.monotonic and mod.time.time is time.time  # the rest is the real module


def test_the_idle_pull_is_fast_after_a_message_and_slows_down_to_the_idle_interval():
    """The empty pull's 3 s follows the time since the last message the node pulled."""
    mod = _fresh_flower_module()
    slept: list[float] = []
    now = [1000.0]
    runs = iter([None, 42, None])
    pulls = []

    def fake_pull(**kw):  # in place of Flower's pull: a run id when a message came, else None
        pulls.append(kw)
        return next(runs)

    mod._pull_and_store_message = fake_pull
    shim = sm.patch(mod, sleep=slept.append, clock=lambda: now[0])
    assert mod._pull_and_store_message.__wrapped__ is fake_pull
    now[0] += 100.0
    assert mod._pull_and_store_message(a=1) is None   # no message: nothing noted
    mod.time.sleep(3)
    assert slept[-1] == sm.PULL_IDLE_S and sm.PULL_IDLE_S < 3   # idle for long: the idle interval
    assert mod._pull_and_store_message(a=2) == 42      # a message
    mod.time.sleep(3)
    assert slept[-1] == sm.PULL_FAST_S                 # right after it: fast
    now[0] += 4.0
    mod.time.sleep(3)
    assert slept[-1] == pytest.approx(4.0 * sm.PULL_SLOPE)  # then slower, with the time since
    assert mod._pull_and_store_message(a=3) is None and pulls == [{"a": 1}, {"a": 2}, {"a": 3}]
    sm.patch(mod, sleep=slept.append, clock=lambda: now[0])  # patched again: Flower's function wrapped once
    assert mod._pull_and_store_message.__wrapped__ is fake_pull
    assert shim.reply_s == sm.REPLY_POLL_S


def test_the_reply_look_is_fast_after_a_message_and_slows_to_flowers_half_second():
    """A reply is pushed within ~1 % of the time its partner took; an idle node looks every 0.5 s."""
    mod = _fresh_flower_module()
    slept: list[float] = []
    now = [50.0]
    mod._pull_and_store_message = lambda **kw: 7  # every pull brings a message
    sm.patch(mod, sleep=slept.append, clock=lambda: now[0])
    mod._pull_and_store_message()
    for dt in (0.1, 0.4, 9.6, 130.0, 1e6):  # a heart reply (~0.5 s), then a LoRA round's training, then idle
        now[0] += dt
        mod.time.sleep(0.5)
    assert slept[:2] == [sm.REPLY_POLL_S, sm.REPLY_POLL_S]  # within the first half second: 5 ms
    assert slept[2] == pytest.approx(10.1 * sm.REPLY_SLOPE) and slept[3] == slept[4] == 0.5  # 10.1 s in
    mod._pull_and_store_message()  # the next message: fast again
    mod.time.sleep(0.5)
    assert slept[-1] == sm.REPLY_POLL_S
    assert [sm.reply_interval(t) for t in (0.0, 0.5, 10.0, 60.0)] == pytest.approx([0.005, 0.005, 0.1, 0.5])


def test_pull_interval_is_clamped_between_the_fast_and_the_idle_interval():
    assert sm.pull_interval(0.0) == sm.PULL_FAST_S
    assert sm.pull_interval(1e9) == sm.PULL_IDLE_S
    assert sm.pull_interval(2.0, fast_s=0.01, idle_s=5.0, slope=0.5) == 1.0


def test_a_flower_without_the_waits_is_refused_before_anything_runs(tmp_path):
    import importlib.util

    mod = _fresh_flower_module()
    gone = types.ModuleType("flwr.supernode.start_client_internal")
    gone.time = time
    with pytest.raises(DeploymentError, match="start_client_internal is gone"):
        sm.patch(gone)
    src = tmp_path / "moved.py"  # a Flower whose idle backoff changed to 5 s
    src.write_text("import time\ndef start_client_internal():\n    time.sleep(5)\n"
                   "def _push_messages():\n    time.sleep(0.5)\n")
    spec = importlib.util.spec_from_file_location("moved", src)
    moved = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moved)
    with pytest.raises(DeploymentError, match=r"no longer calls time.sleep\(3\)"):
        sm.patch(moved)
    assert moved.time is time  # refused: nothing replaced
    import datetime

    mod.time = datetime  # not the time module any more
    with pytest.raises(DeploymentError, match="no longer imports time"):
        sm.patch(mod)


def test_the_launcher_runs_flowers_own_supernode_cli():
    """``--help`` comes from Flower's argparse, under Flower's program name."""
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.supernode_main", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: flower-supernode" in out.stdout and "--auth-supernode-private-key" in out.stdout


def _fresh(name: str):
    """A fresh copy of Flower module ``name`` (a patch of it touches nothing else of the session)."""
    import importlib
    import importlib.util

    real = importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, real.__file__)  # its own name: relative imports resolve
    # (the copy is not put in sys.modules: the session keeps the real module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flwr_still_declares_and_keeps_the_heartbeat_interval_the_launcher_replaces():
    from flwr.common import constant as c
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection

    assert (c.HEARTBEAT_DEFAULT_INTERVAL, c.HEARTBEAT_PATIENCE, c.HEARTBEAT_CALL_TIMEOUT) == (30, 2, 5)
    assert sm.heartbeat_bounds() == (10.0, 1800.0)
    assert inspect.getsource(fleet_http_connection).count("heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL") == 2
    assert "HEARTBEAT_DEFAULT_INTERVAL - HEARTBEAT_CALL_TIMEOUT" in inspect.getsource(heartbeat.HeartbeatSender._run)


def test_set_heartbeat_changes_what_the_supernode_declares_and_how_often_it_beats():
    import threading

    mods = {n: _fresh(n) for n in ("flwr.supernode.fleet_http_connection", "flwr.supercore.heartbeat")}
    sm.set_heartbeat(10, mods)
    assert mods["flwr.supernode.fleet_http_connection"].HEARTBEAT_DEFAULT_INTERVAL == 10
    waits: list[float] = []

    class StopAfterOne(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            self.set()
            return True

    sender = mods["flwr.supercore.heartbeat"].HeartbeatSender(lambda: True)
    sender._stop_event = StopAfterOne()
    sender._run()  # one heartbeat, then the wait before the next one
    assert len(waits) == 1 and (10 - 5) * 0.7 <= waits[0] <= (10 - 5) * 0.9  # Flower's 30 s would wait 17.5..22.5 s


def test_a_heartbeat_the_superlink_would_refuse_or_a_flower_without_the_constant_is_refused():
    mods = {n: _fresh(n) for n in ("flwr.supernode.fleet_http_connection", "flwr.supercore.heartbeat")}
    for bad in (5, 1801, float("nan")):
        with pytest.raises(DeploymentError, match="accepts 10 to 1800"):
            sm.set_heartbeat(bad, mods)
    gone = types.ModuleType("flwr.supercore.heartbeat")  # no source, no constant
    with pytest.raises(DeploymentError, match="flwr.supercore.heartbeat"):
        sm.set_heartbeat(10, {**mods, "flwr.supercore.heartbeat": gone})
    assert mods["flwr.supernode.fleet_http_connection"].HEARTBEAT_DEFAULT_INTERVAL == 30  # refused: nothing patched


def test_the_heartbeat_option_is_taken_off_flowers_arguments():
    assert sm.split_heartbeat(["--heartbeat-interval", "10", "--superlink", "h:1"]) == (10.0, ["--superlink", "h:1"])
    assert sm.split_heartbeat(["--superlink", "h:1", "--heartbeat-interval=12.5"]) == (12.5, ["--superlink", "h:1"])
    assert sm.split_heartbeat(["--superlink", "h:1"]) == (None, ["--superlink", "h:1"])
    with pytest.raises(DeploymentError, match="expected seconds"):
        sm.split_heartbeat(["--heartbeat-interval", "soon"])
