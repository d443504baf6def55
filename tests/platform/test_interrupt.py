"""Long commands interrupted at named stages: the real CLI in a subprocess, a test pause
point (sealfl.common.testpoints) instead of a guessed delay, then SIGINT / SIGTERM /
SIGKILL. Each test checks the exit code, the files, stderr, and that no process of the
run survives."""

import json
import os
import re
import signal
from pathlib import Path

import pytest

from sealfl.clients.heart.data import HOSPITALS, load_partitions
from sealfl.clients.heart.stats import local_sums
from sealfl.clients.heart.task import HeartTask
from sealfl.he.framed import WIDE
from sealfl.platform.consortium import create_consortium
from sealfl.platform.register import read_register
from sealfl.platform.release import provision_release_enclave
from sealfl.server.bookkeeping import CampaignDir
from tests.support.faults import assert_tree_gone, hidden_files, run_cli, start_cli, wait_until
from tests.support.releases import commit_round

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    cons, codec = create_consortium(tmp_path_factory.mktemp("consortium") / "c", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    return cons, codec


@pytest.fixture
def cli(tmp_path):
    """``cli(args, pause_at)`` starts the CLI paused at a stage; whatever a failing test
    leaves running is SIGKILLed at teardown (its worker tree follows it)."""
    runs = []

    def start(args, pause_at):
        runs.append(start_cli(args, pause_at, tmp_path))
        return runs[-1]

    yield start
    for run in runs:
        run.kill()


def _assert_one_line_no_traceback(stderr: str, signame: str) -> None:
    # sealfl's own warnings (e.g. "SimTEE ... is an INSECURE simulation") may precede it;
    # nothing else: no traceback, no line from Ray or Flower
    # and its plain progress lines off a terminal ("[  2.0 s] export ONNX", "round 1/3 done: ...")
    progress = re.compile(r"^(\[\s*[\d.]+ s\] |campaign started \(|round \d+/\d+ done: )")
    lines = [ln for ln in stderr.splitlines()
             if ln.strip() and not ln.startswith("WARNING sealfl.") and not progress.match(ln)]
    assert len(lines) == 1 and lines[0].startswith("interrupted:"), stderr[-3000:]
    assert signame in lines[0]


def _interrupt(run, sig: int = signal.SIGINT) -> tuple[int, str]:
    """Wait for ``run``'s pause point, send ``sig``, and check it ended in one line with
    exit 128 + sig. Returns (worker pid, run token) for :func:`assert_tree_gone`."""
    run.wait_paused()
    worker, token = run.tree()
    run.proc.send_signal(sig)
    rc, stderr = run.finish()
    assert rc == 128 + sig, stderr[-3000:]
    _assert_one_line_no_traceback(stderr, signal.Signals(sig).name)
    return worker, token


def _assert_campaign_interrupted(out, finished: int, sig: int) -> None:
    cd = CampaignDir(out)
    status = cd.read_status()
    assert status["status"] == "interrupted" and status["round"] == finished
    assert signal.Signals(sig).name in status["error"]
    rounds = cd.rounds()
    assert [r["round"] for r in rounds] == list(range(1, finished + 1))
    if finished:
        ck = cd.read_checkpoint()  # loads, and it is that round's
        assert ck.round == finished and ck.record == rounds[-1]
    else:
        assert not cd.checkpoint_path.exists()
    assert hidden_files(out) == []
    assert cd.view().state == "interrupted"


@pytest.mark.parametrize("stage, sig, finished", [
    ("before-ray", signal.SIGINT, 0),       # worker up, Ray not started yet
    ("aggregate@2", signal.SIGINT, 1),      # aggregator thread adding round 2's ciphertexts
    ("checkpoint@2", signal.SIGTERM, 1),    # round 2's checkpoint written to a temp file, not renamed
])
def test_kind_campaign_interrupted_at_any_stage_leaves_the_last_finished_round(consortium, cli, tmp_path, stage,
                                                                                sig, finished):
    cons, _ = consortium
    out = tmp_path / "camp"
    run = cli(["campaign", "run", "-c", cons.dir, "-o", out, "--rounds", 2], stage)
    run.wait_paused()
    worker, token = run.tree()
    if stage.startswith("checkpoint"):
        assert [p.name for p in (out / "checkpoint").iterdir() if p.name.endswith(".tmp")]  # mid-write indeed
    run.proc.send_signal(sig)
    rc, stderr = run.finish()
    assert rc == 128 + sig, stderr[-3000:]
    _assert_one_line_no_traceback(stderr, signal.Signals(sig).name)
    _assert_campaign_interrupted(out, finished, sig)
    assert_tree_gone(token, worker)


def test_kind_embedded_ray_listens_on_loopback_only_and_demands_the_token(consortium, cli, tmp_path):
    from sealfl.common.procs import listening_sockets, non_loopback
    from sealfl.platform.simulate import probe_auth
    from tests.support.faults import environ, run_processes

    cons, _ = consortium
    out = tmp_path / "camp"
    run = cli(["campaign", "run", "-c", cons.dir, "-o", out, "--rounds", 2], "train@1")
    paused = run.wait_paused()  # a partner is training: Ray, its agents and the actors are all up
    worker, token = run.tree()
    assert paused["pid"] in run_processes(token, worker)  # the pause is inside a Ray worker of this run
    socks = listening_sockets(run_processes(token, worker))
    assert len(socks) >= 3, socks  # GCS, raylet, actors at least
    assert non_loopback(socks) == [], socks
    gcs = CampaignDir(out).read_status()["ray"]["gcs_address"]
    assert gcs.startswith("127.0.0.1:")
    ray_token = environ(worker)["RAY_AUTH_TOKEN"]
    assert probe_auth(gcs) == "token"  # refused without the token ...
    assert probe_auth(gcs, "0" * 64) == "token"  # ... and with a wrong one
    assert probe_auth(gcs, ray_token) == "none"  # the same call with the run's token is answered
    code = ("import ray, logging\n"
            f"ray.init(address='{gcs}', logging_level=logging.ERROR)\n"
            "print('RAN', ray.get(ray.remote(lambda: 6 * 7).remote()))\n")
    import subprocess
    import sys

    # a driver without the token, on this machine (the loopback is the only way in): it
    # must use 127.0.0.1 as its own node address too, else Ray maps 127.0.0.1 to the
    # outward IP, where nothing listens
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert second.returncode != 0 and "RAN" not in second.stdout, second.stdout + second.stderr[-2000:]
    assert "Unauthenticated" in second.stderr, second.stderr[-2000:]  # refused for want of the token
    run.proc.send_signal(signal.SIGTERM)
    rc, stderr = run.finish()
    assert rc == 143, stderr[-3000:]
    _assert_one_line_no_traceback(stderr, "SIGTERM")
    _assert_campaign_interrupted(out, 0, signal.SIGTERM)
    assert_tree_gone(token, worker)


def test_kind_worker_killed_with_sigkill_is_reported_with_the_files_it_left(consortium, cli, tmp_path):
    """The worker dies without a result: the CLI says so in one line, naming the log and the
    run directory it keeps for that log's Ray session files (a new user found it left unnamed)."""
    import shutil

    cons, _ = consortium
    out = tmp_path / "camp"
    run = cli(["campaign", "run", "-c", cons.dir, "-o", out, "--rounds", 2], "checkpoint@2")
    run.wait_paused()
    worker, token = run.tree()
    run_dir = Path(open(f"/proc/{worker}/cmdline").read().split("\0")[3]).parent
    os.kill(worker, signal.SIGKILL)
    rc, stderr = run.finish()
    try:
        text = " ".join(stderr.split())
        assert rc == 1 and "killed by signal 9" in text and str(run_dir) in text, stderr[-3000:]
        assert "Traceback" not in stderr and run_dir.is_dir() and (run_dir / "job.json").is_file()
        assert_tree_gone(token, worker)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_kind_supervisor_killed_with_sigkill_takes_its_tree_and_leaves_a_dead_campaign(consortium, cli, tmp_path):
    cons, _ = consortium
    out = tmp_path / "camp"
    run = cli(["campaign", "run", "-c", cons.dir, "-o", out, "--rounds", 2], "checkpoint@2")
    run.wait_paused()
    worker, token = run.tree()
    run_dir = Path(open(f"/proc/{worker}/cmdline").read().split("\0")[3]).parent  # worker ... JOB.json
    assert run_dir.name.startswith("sealfl-run-") and (run_dir / "ray").is_dir()
    run.proc.send_signal(signal.SIGKILL)  # no handler runs
    run.finish()
    assert_tree_gone(token, worker)  # worker: PR_SET_PDEATHSIG; Ray's processes: the reaper
    wait_until(lambda: not run_dir.exists(), "the reaper to remove the run directory")
    cd = CampaignDir(out)
    assert cd.read_status()["status"] == "running"  # nobody could record anything ...
    assert cd.read_checkpoint().round == 1  # ... yet the committed state is round 1, whole
    assert [r["round"] for r in cd.rounds()] == [1]
    view = cd.view()
    assert view.state == "dead" and view.round == 1
    shown = run_cli(["campaign", "status", out])
    assert shown.returncode == 0 and "dead" in " ".join(shown.stdout.split()), shown.stdout + shown.stderr
    scripted = run_cli(["campaign", "status", out, "--json"])
    doc = json.loads(scripted.stdout)  # what a script reads: the same decision, with the file's word beside it
    assert doc["state"] == "dead" and doc["recorded_status"] == "running" and doc["round"] == 1
    assert doc["started_iso"].endswith("+00:00") and doc["owner"]["pid"] == run.proc.pid
    assert doc["rounds_log_complete"] is True
    (out / "rounds.jsonl").write_bytes((out / "rounds.jsonl").read_bytes()[:20])  # a truncated round log
    damaged = run_cli(["campaign", "status", out, "--json"])
    assert json.loads(damaged.stdout)["rounds_log_complete"] is False and "round log is damaged" in " ".join(
        damaged.stderr.split())
    again = run_cli(["campaign", "run", "-c", cons.dir, "-o", out, "--rounds", 2])
    assert again.returncode == 1 and "--overwrite" in " ".join(again.stderr.split()), again.stderr
    assert "Traceback" not in again.stderr


@pytest.fixture(scope="module")
def finished_campaign(consortium, tmp_path_factory):
    """A finished 3-round campaign as the aggregator leaves it (zero model: the gate's
    verdict does not matter to these tests, only that the pipeline reaches it)."""
    cons, codec = consortium
    camp = tmp_path_factory.mktemp("finished") / "camp"
    parts = load_partitions()
    n = float(sum(p.n_train for p in parts))
    commit_round(camp, 3, codec.encrypt(HeartTask().init_params()), n,
                 codec.encrypt(sum(local_sums(p.x_train) for p in parts), WIDE), [p.name for p in parts])
    CampaignDir(camp, 3).set_status(status="finished", round=3, stats_declared_n=int(n))
    return camp


def test_kind_release_build_interrupted_in_the_gate_query_writes_nothing(consortium, finished_campaign, cli, tmp_path):
    cons, _ = consortium
    out = tmp_path / "rel" / "release-v7"
    out.parent.mkdir()
    before = read_register(cons.dir)
    run = cli(["release", "build", "-c", cons.dir, "--campaign", finished_campaign, "-o", out,
                     "--version", 7, "--max-drop", 1.0], "gate-query")
    worker, token = _interrupt(run)
    assert list(out.parent.iterdir()) == []  # no release directory, no temporary one
    assert read_register(cons.dir) == before  # version 7 neither issued nor reserved
    assert_tree_gone(token, worker)


def test_kind_release_build_runs_its_gate_in_a_worker_and_registers_once(consortium, finished_campaign, tmp_path):
    cons, _ = consortium
    out = tmp_path / "release-v9"
    r = run_cli(["release", "build", "-c", cons.dir, "--campaign", finished_campaign, "-o", out, "--version", 9,
                 "--max-drop", 1.0, "--json"])
    assert r.returncode == 0, r.stderr[-3000:]
    (entry,) = [e for e in read_register(cons.dir) if e["version"] == 9]
    manifest = json.loads((out / "manifest.json").read_text())
    assert entry["state"] == "issued" and manifest["version"] == 9
    doc = json.loads(r.stdout)  # --json: one object on stdout
    assert doc["ok"] is True and doc["root_digest"] == entry["root_digest"] and doc["dir"] == str(out)
    phases = [ln.split("] ", 1)[1] for ln in r.stderr.splitlines() if ln.startswith("[") and " s] " in ln]
    assert phases[0].startswith("decrypt") and any(p.startswith("export ONNX") for p in phases) and phases[-1].startswith("sign"), r.stderr
    again = run_cli(["release", "build", "-c", cons.dir, "--campaign", finished_campaign, "-o", tmp_path / "again",
                     "--version", 9, "--max-drop", 1.0])
    assert again.returncode == 1 and "use --version 10" in " ".join(again.stderr.split())
    assert not (tmp_path / "again").exists()


def test_kind_demo_interrupted_records_its_campaign_and_writes_no_report(cli, tmp_path):
    out = tmp_path / "demo-out"
    run = cli(["demo", "--out", out, "--rounds", 2], "before-ray")
    worker, token = _interrupt(run)
    _assert_campaign_interrupted(out / "campaign", 0, signal.SIGINT)
    assert not (out / "report.json").exists() and not (out / "release").exists()
    assert_tree_gone(token, worker)


def test_kind_pause_points_wait_for_an_event_not_a_delay(cli, tmp_path):
    # the harness itself: an unknown stage fails fast instead of never pausing
    run = cli(["campaign", "run", "-c", tmp_path / "nothing", "-o", tmp_path / "o"], "no-such-stage")
    rc, stderr = run.finish()
    assert rc == 1 and "unknown stage" in " ".join(stderr.split()) and "Traceback" not in stderr
