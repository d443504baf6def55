"""One app, two runtimes (issue 19, item 1): Flower's own ``flwr run .`` from the source tree
runs a campaign in the local simulation federation (a ``flower-superlink --simulation``
started here on a free loopback port), with the module-level apps pyproject.toml declares,
from a campaign directory ``sealfl campaign run --prepare-only`` wrote."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from sealfl.clients.heart.data import HOSPITALS
from sealfl.platform import flwr_cli
from sealfl.platform.consortium import create_consortium
from sealfl.server.bookkeeping import CampaignDir
from tests.platform.test_deployment import _alive, _descendants

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_declares_the_module_level_apps():
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app["publisher"] == "sealfl"
    assert app["components"] == {"serverapp": flwr_cli.SERVERAPP, "clientapp": flwr_cli.CLIENTAPP}
    assert set(app["config"]) == {"campaign-dir", "consortium-dir"}
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    import sealfl.clients.app
    import sealfl.server.app

    assert isinstance(sealfl.server.app.app, ServerApp) and isinstance(sealfl.clients.app.app, ClientApp)


def test_flwr_run_dot_runs_a_campaign_in_the_local_simulation_federation(tmp_path):
    cons, _ = create_consortium(tmp_path / "c", "heart", list(HOSPITALS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "campaign", "run", "-c", str(cons.dir), "--out",
                          str(tmp_path / "camp"), "--rounds", "2", "--prepare-only"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "flwr run . CONNECTION --federation-config num-supernodes=4" in out.stdout.replace("\n", "")
    assert "where CONNECTION names a [superlink.CONNECTION] table" in " ".join(out.stdout.split())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = flwr_cli.write_flwr_home(tmp_path / "home", f"127.0.0.1:{port}", None)
    # Flower's simulation calls ray.init(), which joins the last Ray cluster started on this
    # machine (another user's, on a shared host): a Ray of its own, on loopback
    senv = {**flwr_cli.flower_env(env, flwr_home=home), "RAY_ADDRESS": "local", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with open(tmp_path / "superlink.log", "wb") as log:
        sl = subprocess.Popen([flwr_cli.flower_bin("flower-superlink"), "--insecure", "--simulation",
                               "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port)],
                              stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=senv, start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert sl.poll() is None and time.monotonic() - t0 < 60, (tmp_path / "superlink.log").read_text()
                time.sleep(0.5)
        run_config = flwr_cli.toml_config({"campaign-dir": str((tmp_path / "camp").resolve()),
                                           "consortium-dir": str(cons.dir.resolve())})
        run = subprocess.run([flwr_cli.flower_bin("flwr"), "run", ".", flwr_cli.CONNECTION, "--federation-config",
                              "num-supernodes=4", "--run-config", run_config, "--format", "json"], cwd=ROOT,
                             capture_output=True, text=True, env=senv, timeout=120)
        assert run.returncode == 0, run.stderr
        cd = CampaignDir(tmp_path / "camp")
        t0 = time.monotonic()
        while cd.read_status().get("status") not in ("finished", "failed"):
            assert time.monotonic() - t0 < 300, cd.read_status()
            time.sleep(1)
        status = cd.read_status()
        assert status["status"] == "finished", status
        assert status["server_has_secret_key"] is False
        assert [r["round"] for r in cd.rounds()] == [1, 2]
        assert all(r["accepted"] == sorted(HOSPITALS) for r in cd.rounds())
    finally:
        tree = _descendants(sl.pid)
        sl.send_signal(signal.SIGTERM)
        try:
            sl.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sl.kill()
            sl.wait()
        for pid in tree:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
