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
    shim = sm.patch(mod, sleep=slept.append)
    assert mod.time is shim
    mod.time.sleep(3)      # the idle pull's backoff
    mod.time.sleep(0.5)    # waiting for the ClientApp's reply
    mod.time.sleep(1.25)   # any other duration: unchanged
    assert slept == [sm.IDLE_PULL_S, sm.REPLY_POLL_S, 1.25]
    assert sm.IDLE_PULL_S < 3 and sm.REPLY_POLL_S < 0.5
    assert mod.time.monotonic is time.monotonic and mod.time.time is time.time  # the rest is the real module


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
