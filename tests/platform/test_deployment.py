"""Flower's deployment engine with real processes on loopback (issue 19, items 3 and 6):
``sealfl superlink start`` (TLS, SuperNode authentication, database) and four ``sealfl
partner start`` SuperNodes, each given only its own kit; ``sealfl campaign run --superlink``.

One SuperLink + 4 SuperNodes are shared by the module (start-up ~15 s); each partner process
takes its SuperNode's tasks itself (sealfl.clients.executor). The last test stops
everything with SIGTERM and checks exit 143 and that no process of theirs is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sealfl.clients.heart.data import HOSPITALS
from sealfl.clients.kit import kit_dir, load_kit
from sealfl.platform import flwr_cli
from sealfl.platform.campaign import CampaignSpec, run_campaign
from sealfl.platform.consortium import create_consortium
from sealfl.platform.startup_kits import supernode_key_pair
from sealfl.server.bookkeeping import CampaignDir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([old] if old else []))}


def _sealfl(args, out: Path) -> subprocess.Popen:
    fh = open(out, "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], stdout=fh, stderr=fh,
                                stdin=subprocess.DEVNULL, env=_env(), cwd=out.parent)
    finally:
        fh.close()


def _wait(cond, what: str, timeout_s: float):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        got = cond()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _descendants(pid: int) -> set[int]:
    """Every live process whose parent chain reaches ``pid`` (read from /proc)."""
    parent = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                stat = Path(f"/proc/{p}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
                parent[int(p)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, pp in parent.items() if pp in frontier and c not in out}
        out |= frontier
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _online(home: Path) -> int:
    doc = flwr_cli.flwr_json(["supernode", "ls", flwr_cli.CONNECTION], home)
    return sum(1 for n in doc.get("nodes", []) if n.get("status") == "online")


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    d = tmp_path_factory.mktemp("deploy")
    cons, _ = create_consortium(d / "c", "heart", list(HOSPITALS))
    port = _free_port()
    state = d / "superlink-state"
    sl = _sealfl(["superlink", "start", cons.dir / "superlink", "--port", port, "--state", state], d / "superlink.out")
    _wait(lambda: "SuperLink on" in (d / "superlink.out").read_text() or sl.poll() is not None, "the SuperLink", 90)
    assert sl.poll() is None, (d / "superlink.out").read_text()
    home = state / "flwr-home"
    nodes = {}
    for p in HOSPITALS:  # each partner in its own directory with a copy of only its own kit
        site = d / "sites" / p.replace(" ", "_")
        site.mkdir(parents=True)
        kit = shutil.copytree(kit_dir(cons.dir, p), site / kit_dir(cons.dir, p).name)
        nodes[p] = _sealfl(["partner", "start", kit, "--superlink", f"127.0.0.1:{port}"], site / "partner.out")
    _wait(lambda: _online(home) == len(HOSPITALS), "4 SuperNodes online", 90)
    procs = {"superlink": sl, **nodes}
    yield {"dir": d, "cons": cons, "port": port, "home": home, "procs": procs}
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def _intruder_kits(fed) -> dict[str, Path]:
    """Three SuperNodes that must be refused: a kit whose CA is another consortium's, a kit
    with an authentication key the SuperLink never registered, one with another partner's key."""
    d, cons = fed["dir"] / "intruders", fed["cons"]
    other, _ = create_consortium(d / "other", "heart", ["Cleveland", "Hungary"])
    kits = {}
    for label, partner in (("other-ca", "Switzerland"), ("unregistered", "Hungary"), ("stolen", "Cleveland")):
        kits[label] = Path(shutil.copytree(kit_dir(cons.dir, partner), d / label / kit_dir(cons.dir, partner).name))
    shutil.copy(other.dir / "superlink" / "ca.crt", kits["other-ca"] / "ca.crt")
    priv, pub = supernode_key_pair()
    (kits["unregistered"] / "supernode_auth_key").write_bytes(priv)
    (kits["unregistered"] / "supernode_auth_key.pub").write_bytes(pub)
    for f in ("supernode_auth_key", "supernode_auth_key.pub"):  # VA Long Beach's key, presented by "Cleveland"
        shutil.copy(kit_dir(cons.dir, "VA Long Beach") / f, kits["stolen"] / f)
    return kits


def test_four_tls_supernodes_run_the_encrypted_campaign_to_the_simulations_model_and_refuse_intruders(federation):
    fed = federation
    d, cons = fed["dir"], fed["cons"]
    superlink = f"127.0.0.1:{fed['port']}"
    camp = _sealfl(["campaign", "run", "-c", cons.dir, "--out", d / "deployed", "--rounds", ROUNDS,
                    "--superlink", superlink], d / "campaign.out")
    intruders = {label: _sealfl(["partner", "start", kit, "--superlink", superlink, "--log", kit.parent / "sn.log"],
                                kit.parent / "partner.out")
                 for label, kit in _intruder_kits(fed).items()}
    for label, proc in intruders.items():
        assert proc.wait(timeout=120) == 1, label
    said = {label: (d / "intruders" / label / "partner.out").read_text() for label in intruders}
    assert "TLS refused" in said["other-ca"] and "ca.crt" in said["other-ca"]
    assert "node authentication refused" in said["unregistered"]
    assert "node authentication refused" in said["stolen"]
    for label in intruders:
        assert f"intruders/{label}/sn.log" in said[label].replace("\n", "")  # the log it names
    assert camp.wait(timeout=600) == 0, (d / "campaign.out").read_text()
    assert "campaign finished: 2 rounds" in (d / "campaign.out").read_text()
    assert "asking with 'flwr ls' instead" not in (d / "campaign.out").read_text()  # looks made in-process

    dep = CampaignDir(d / "deployed")
    status = dep.read_status()
    assert status["status"] == "finished" and status["server_has_secret_key"] is False
    assert status["deployment"]["tls"] is True and status["deployment"]["superlink"] == superlink
    rounds = dep.rounds()
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["accepted"] == sorted(HOSPITALS) and not r["rejected"] for r in rounds)

    sim = run_campaign(CampaignSpec(str(cons.dir), str(d / "simulated"), rounds=ROUNDS))
    for a, b in zip(rounds, sim.rounds):  # same seeds, same codec: the same numbers
        assert a["pooled_test_accuracy"] == b["pooled_test_accuracy"]
        assert a["train_loss"] == b["train_loss"]
        assert a["total_weight"] == b["total_weight"]
    codec = load_kit(str(kit_dir(cons.dir, "Cleveland"))).codec
    ck_dep, ck_sim = dep.read_checkpoint(), CampaignDir(d / "simulated").read_checkpoint()
    assert ck_dep.round == ck_sim.round == ROUNDS and ck_dep.model_weight == ck_sim.model_weight
    n = len(json.loads((d / "deployed" / "server_config.json").read_text())["initial_params"])
    m_dep, m_sim = codec.decrypt(ck_dep.model_ct, n), codec.decrypt(ck_sim.model_ct, n)
    assert np.array_equal(m_dep, m_sim) and np.any(m_dep != 0)  # BFV: bit for bit


_OUTSIDER_PYPROJECT = """\
[project]
name = "probe"
version = "1.0.0"
dependencies = ["flwr>=1.42,<1.43"]

[tool.flwr.app]
publisher = "outsider"

[tool.flwr.app.components]
serverapp = "probe_app:server"
clientapp = "probe_app:client"

[tool.flwr.app.config]
out = ""
marker = ""
"""

#: an app of another publisher: its ServerApp asks every SuperNode once and writes what came
#: back; its ClientApp, if any partner ran it, would leave a marker file
_OUTSIDER_APP = """\
import json
from pathlib import Path
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid, context):
    cfg = context.run_config
    msgs = [Message(content=RecordDict({"config": ConfigRecord({"query": "stats", "marker": cfg["marker"]})}),
                    dst_node_id=n, message_type="query") for n in grid.get_node_ids()]
    replies = list(grid.send_and_receive(msgs, timeout=120))
    Path(cfg["out"]).write_text(json.dumps([r.error.reason if r.has_error() else "content" for r in replies]))


@client.query()
def query(msg, context):
    Path(msg.content["config"]["marker"]).write_text("the SuperLink's code ran on a partner")
    return Message(content=RecordDict(), reply_to=msg)
"""


def test_the_coordinator_asks_for_its_runs_state_in_process_as_flwr_ls_answers(federation, tmp_path, capsys):
    """The deployed campaign's looks at its run are Control API requests from the coordinator's
    process (RunWatcher), not one `flwr ls` process each (~1 CPU-s apiece, every 3 s). Uses
    the run of the first test of this module."""
    from sealfl.platform.control_api import RunWatcher
    from sealfl.platform.deployed import run_state
    from sealfl.platform.errors import DeploymentError

    d = federation["dir"]
    assert (d / "deployed" / "status.json").is_file(), "needs the campaign of the first test of this module"
    run_id = CampaignDir(d / "deployed").read_status()["deployment"]["run_id"]
    home = d / "deployed" / "flwr" / "home"
    via_cli = run_state(flwr_cli.flwr_json(["ls", flwr_cli.CONNECTION, "--run-id", str(run_id)], home), run_id)
    before = os.environ.get("FLWR_HOME")
    capsys.readouterr()
    with RunWatcher(home, flwr_cli.CONNECTION) as look:
        assert os.environ.get("FLWR_HOME") == before  # Flower's helpers read it; it is put back
        assert capsys.readouterr().out == ""  # Flower's "Using SuperLink: ..." stays out of our CLI's stdout
        status, _details = look.run_status(run_id)
        assert status == via_cli[0] == "finished:completed"
        with pytest.raises(DeploymentError, match="run 12345|12345"):
            look.run_status(12345)
    # a connection whose CA is another consortium's: the TLS handshake fails, named as the run's state
    other = flwr_cli.write_flwr_home(tmp_path / "home", f"127.0.0.1:{federation['port']}",
                                     d / "intruders" / "other" / "superlink" / "ca.crt")
    with RunWatcher(other, flwr_cli.CONNECTION) as look, pytest.raises(DeploymentError, match="no answer about run"):
        look.run_status(run_id)
    with pytest.raises(DeploymentError, match="no-such-connection"):
        RunWatcher(home, "no-such-connection")


def test_partners_answer_only_sealfls_app_and_never_run_code_the_superlink_sends(federation, tmp_path):
    """A run of another publisher's app on the consortium's SuperLink (a coordinator, or
    anyone holding its Control API, submitting it): every partner refuses it with a reason,
    and the ClientApp in the app bundle is never executed on a partner's machine (Flower's
    own SuperNode would install and run it)."""
    fed = federation
    app = tmp_path / "outsider"
    app.mkdir()
    (app / "pyproject.toml").write_text(_OUTSIDER_PYPROJECT)
    (app / "probe_app.py").write_text(_OUTSIDER_APP)
    out, marker = tmp_path / "replies.json", tmp_path / "marker"
    flwr_cli.flwr_json(["run", str(app), flwr_cli.CONNECTION, "--run-config",
                        flwr_cli.toml_config({"out": str(out), "marker": str(marker)})], fed["home"])
    _wait(out.exists, "the outsider's ServerApp to write its replies", 300)
    reasons = json.loads(out.read_text())
    assert len(reasons) == len(HOSPITALS)
    assert all("answers only sealfl's app" in r and "outsider" in r for r in reasons), reasons
    assert not marker.exists()


def test_ctrl_c_stops_a_deployed_campaign_after_a_round_and_the_run_on_the_superlink(federation):
    fed = federation
    d, cons = fed["dir"], fed["cons"]
    camp = _sealfl(["campaign", "run", "-c", cons.dir, "--out", d / "stopped", "--rounds", 20,
                    "--superlink", f"127.0.0.1:{fed['port']}"], d / "stopped.out")
    cd = CampaignDir(d / "stopped")
    _wait(lambda: cd.rounds_path.exists() and cd.rounds() or camp.poll() is not None, "round 1", 300)
    camp.send_signal(signal.SIGINT)
    assert camp.wait(timeout=120) == 130, (d / "stopped.out").read_text()
    said = (d / "stopped.out").read_text()
    assert "interrupted:" in said and "checkpoint of round" in said
    status = cd.read_status()
    assert status["status"] == "interrupted" and status["round"] == cd.read_checkpoint().round >= 1
    run_id = status["deployment"]["run_id"]
    doc = flwr_cli.flwr_json(["ls", flwr_cli.CONNECTION, "--run-id", str(run_id)], fed["home"])
    assert doc["runs"][0]["status"].startswith("finished:"), doc  # stopped on the SuperLink, not left running



def test_sigterm_stops_the_superlink_and_every_supernode_leaving_no_process(federation):
    procs = federation["procs"]
    trees = {name: _descendants(p.pid) for name, p in procs.items()}
    assert all(trees[name] for name in procs), trees  # each runs a Flower process (and Flower runs its own)
    for p in procs.values():
        p.send_signal(signal.SIGTERM)
    for name, p in procs.items():
        assert p.wait(timeout=60) == 143, name
    out = (federation["dir"] / "superlink.out").read_text()
    assert "interrupted" in out and out.strip().count("\n") <= 3
    left = {name: [pid for pid in tree if _alive(pid)] for name, tree in trees.items()}
    assert all(not pids for pids in left.values()), left
