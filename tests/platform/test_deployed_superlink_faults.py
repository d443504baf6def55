"""``sealfl campaign run --superlink`` when the SuperLink itself stops answering, with real
processes on loopback: ``sealfl superlink start`` and the ``sealfl campaign run`` command
(no partners are needed: the run is submitted and its ServerApp waits for them).

Each test starts its own SuperLink (start-up ~10 s) and stops every process it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sealfl.clients.heart.data import HOSPITALS
from sealfl.platform.consortium import create_consortium
from sealfl.server.bookkeeping import CampaignDir
from tests.platform.test_deployment import _alive, _descendants, _free_port, _sealfl, _wait

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cons(tmp_path_factory):
    c, _ = create_consortium(tmp_path_factory.mktemp("cons") / "c", "heart", list(HOSPITALS))
    return c


def _superlink_and_campaign(d: Path, cons):
    """A SuperLink of ``cons`` and a campaign submitted to it; returns (launcher, its
    flower-superlink pid, the campaign command, its directory)."""
    port = _free_port()
    sl = _sealfl(["superlink", "start", cons.dir / "superlink", "--port", port, "--state", d / "state"],
                 d / "superlink.out")
    _wait(lambda: "SuperLink on" in (d / "superlink.out").read_text() or sl.poll() is not None, "the SuperLink", 90)
    assert sl.poll() is None, (d / "superlink.out").read_text()
    flower = [p for p in _descendants(sl.pid) if "flower-superlink" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(flower) == 1, flower
    camp = _sealfl(["campaign", "run", "-c", cons.dir, "--out", d / "camp", "--rounds", 3,
                    "--superlink", f"127.0.0.1:{port}"], d / "camp.out")
    cd = CampaignDir(d / "camp")

    def submitted():
        try:
            return isinstance((cd.read_status().get("deployment") or {}).get("run_id"), int)
        except Exception:  # noqa: BLE001 - not written yet
            return False

    _wait(lambda: submitted() or camp.poll() is not None, "the run's submission", 120)
    assert camp.poll() is None, (d / "camp.out").read_text()
    time.sleep(4.0)  # at least one look at the run has been answered
    return sl, flower[0], camp, cd


def _stop_all(procs: list[subprocess.Popen], pids: list[int]) -> None:
    """SIGKILL ``procs``, ``pids`` and every descendant of theirs (a stopped one first
    continued), and wait until none is left."""
    tree = set(pids)
    for p in procs:
        tree |= _descendants(p.pid)
    for pid in tree | {p.pid for p in procs}:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()
    _wait(lambda: not [pid for pid in tree if _alive(pid)], "the processes' end", 30)


def test_ctrl_c_ends_a_deployed_campaign_promptly_while_its_superlink_does_not_answer(cons, tmp_path):
    """SIGSTOP the flower-superlink: its port still accepts connections but nothing answers.
    Each look at the run used to block for Flower's 30-s request timeout and the stop for
    `flwr stop`'s 30 s and another look: Ctrl-C took ~80 s. Now it exits 130 within seconds,
    the directory levelled and marked interrupted."""
    sl, flower, camp, cd = _superlink_and_campaign(tmp_path, cons)
    try:
        os.kill(flower, signal.SIGSTOP)
        time.sleep(5.0)  # a look is under way against the stopped SuperLink
        t0 = time.monotonic()
        camp.send_signal(signal.SIGINT)
        rc = camp.wait(timeout=120)
        took = time.monotonic() - t0
        said = (tmp_path / "camp.out").read_text()
        assert rc == 130, said
        assert took < 20.0, (took, said)
        assert "interrupted:" in said and cd.read_status()["status"] == "interrupted"
    finally:
        _stop_all([camp, sl], [flower])


def test_a_campaign_whose_superlink_was_killed_stops_following_it_and_says_how_to_resume(cons, tmp_path):
    """kill -9 of the SuperLink (flower-superlink and its launcher) mid-campaign: `campaign run`
    used to warn every 3 s forever. Now it warns once, gives up after UNANSWERED_S (lowered
    to 12 s here; 120 s by default) without an answer, marks the campaign failed (resumable,
    the stale run fenced out by a new epoch), says how to resume and exits 1."""
    import sys

    from tests.platform.test_deployment import ROOT, _env

    port = _free_port()
    sl = _sealfl(["superlink", "start", cons.dir / "superlink", "--port", port, "--state", tmp_path / "state"],
                 tmp_path / "superlink.out")
    camp = None
    tree: set[int] = set()
    try:
        _wait(lambda: "SuperLink on" in (tmp_path / "superlink.out").read_text() or sl.poll() is not None,
              "the SuperLink", 90)
        main = ("import sys; import sealfl.platform.deployed as d; d.UNANSWERED_S = 12.0; "
                "from sealfl.platform.cli import main; sys.argv[0] = 'sealfl'; main()")
        with open(tmp_path / "camp.out", "wb") as fh:
            camp = subprocess.Popen([sys.executable, "-c", main, "campaign", "run", "-c", str(cons.dir), "--out",
                                     str(tmp_path / "camp"), "--rounds", "3", "--superlink", f"127.0.0.1:{port}"],
                                    stdout=fh, stderr=fh, stdin=subprocess.DEVNULL, env=_env(), cwd=ROOT)
        cd = CampaignDir(tmp_path / "camp")
        _wait(lambda: camp.poll() is not None or (cd.status_path.exists()
                                                  and "deployment" in cd.status_path.read_text()),
              "the run's submission", 120)
        assert camp.poll() is None, (tmp_path / "camp.out").read_text()
        epoch = cd.read_status()["epoch"]
        time.sleep(4.0)
        tree = _descendants(sl.pid)
        for pid in [p for p in tree if "flower-superlink" in Path(f"/proc/{p}/cmdline").read_text()] + [sl.pid]:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        rc = camp.wait(timeout=90)
        took = time.monotonic() - t0
        said = (tmp_path / "camp.out").read_text()
        assert rc == 1, said
        assert 12.0 <= took < 45.0, (took, said)
        assert "has not answered for" in said and "sealfl campaign resume" in said, said
        assert said.count("waiting up to 12 s for the SuperLink to answer") == 1, said  # not a warning per look
        status = cd.read_status()
        assert status["status"] == "failed" and "has not answered" in status["error"], status
        assert status["epoch"] == epoch + 1  # the run, should its SuperLink come back, cannot write here
    finally:
        _stop_all([p for p in (camp, sl) if p is not None], list(tree))
