"""The pure parts of the deployment runtime: command lines, addresses, Flower's answers and logs."""

from __future__ import annotations

import sys
import tomllib

import pytest

from sealfl.platform import flwr_cli
from sealfl.platform.consortium import create_consortium
from sealfl.platform.deployed import run_state
from sealfl.platform.errors import DeploymentError
from sealfl.platform.services import parse_hostport, superlink_command, supernode_command, supernode_refusal


def test_hostport_is_parsed_and_nonsense_refused():
    assert parse_hostport("127.0.0.1:9092") == ("127.0.0.1", 9092)
    assert parse_hostport("[::1]:443") == ("::1", 443)
    for bad in ("127.0.0.1", ":9092", "host:0", "host:65536", "host:x"):
        with pytest.raises(DeploymentError, match="HOST:PORT"):
            parse_hostport(bad)


def test_command_lines_use_the_kit_tls_auth_database_and_no_runtime_installs(tmp_path):
    cons, _ = create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])
    sl = superlink_command(cons.dir / "superlink", "127.0.0.1", 9092, tmp_path / "db")
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--enable-supernode-auth", "--database",
                 "--disable-runtime-dependency-installation"):
        assert flag in sl
    assert "--insecure" not in sl and sl[sl.index("--host") + 1] == "127.0.0.1"
    kit = cons.dir / "partners" / "hungary"
    sn = supernode_command(kit, "127.0.0.1:9092", 9300, executor_secret=tmp_path / "secret")
    assert sn[:3] == [sys.executable, "-m", "sealfl.platform.supernode_main"]  # Flower's CLI, shorter waits
    assert sn[sn.index("--root-certificates") + 1] == str((kit / "ca.crt").resolve())
    assert sn[sn.index("--auth-supernode-private-key") + 1] == str((kit / "supernode_auth_key").resolve())
    node = tomllib.loads(sn[sn.index("--node-config") + 1].replace(" ", "\n"))
    assert node == {"kit-dir": str(kit.resolve())}
    # the partner process takes the tasks itself: Flower starts no ClientApp process
    assert sn[sn.index("--isolation") + 1] == "process"
    assert sn[sn.index("--superexec-auth-secret-file") + 1] == str((tmp_path / "secret").resolve())
    assert "--heartbeat-interval" not in sn  # Flower's own heartbeat unless asked
    beat = supernode_command(kit, "127.0.0.1:9092", 9300, executor_secret=tmp_path / "secret", heartbeat_s=10)
    assert beat == [*sn[:3], "--heartbeat-interval", "10", *sn[3:]]  # the launcher's option, before Flower's
    with pytest.raises(DeploymentError, match="accepts 10 to 1800"):
        supernode_command(kit, "127.0.0.1:9092", 9300, heartbeat_s=5)
    with pytest.raises(DeploymentError, match="no ca.crt"):
        (kit / "ca.crt").unlink()
        supernode_command(kit, "127.0.0.1:9092", 9300)


def test_toml_config_quotes_strings_so_flower_reads_them_back():
    text = flwr_cli.toml_config({"campaign-dir": '/a b/"c"', "n": 3, "on": True})
    assert tomllib.loads(text.replace('" ', '"\n').replace("3 ", "3\n")) == {"campaign-dir": '/a b/"c"', "n": 3,
                                                                              "on": True}


def test_run_state_and_supernode_refusals():
    doc = {"runs": [{"run-id": "12", "status": "finished:completed", "status-details": "N/A"}]}
    assert run_state(doc, 12) == ("finished:completed", "N/A")
    with pytest.raises(DeploymentError, match="run 13"):
        run_state(doc, 13)
    tls = "ERROR : SSL/TLS handshake error detected.\n[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"
    assert "TLS refused" in supernode_refusal(tls)
    assert "node authentication refused" in supernode_refusal("[code: 2004] Failed to activate SuperNode.")
    assert supernode_refusal("\x1b[91mERROR \x1b[0m: something odd") == "something odd"


def test_a_partner_killed_with_9_leaves_a_private_directory_the_next_start_sweeps():
    from sealfl.platform.cli.partner import stale_private_dir

    dead = {(123, 456)}

    def alive(ident):
        return (ident["pid"], ident["start"]) not in dead

    assert stale_private_dir("sealfl-partner-123-456-ab_cd", alive)       # its process is gone
    assert not stale_private_dir("sealfl-partner-124-456-ab_cd", alive)   # still running
    for other in ("sealfl-partner-abc", "sealfl-partner-123-x-ab", "sealfl-run-123-456-ab", "sealfl-partner-1-2-3-4"):
        assert not stale_private_dir(other, alive), other                 # not ours to judge: never removed


def test_the_run_look_falls_back_to_flwr_ls_when_flowers_client_cannot_be_made(tmp_path, monkeypatch, caplog):
    """A FLWR_HOME without the connection: the in-process client is refused (DeploymentError
    naming the connection) and each look is one `flwr ls` answer instead (here a recorded one)."""
    from sealfl.platform import deployed
    from sealfl.platform.control_api import RunWatcher, status_text

    with pytest.raises(DeploymentError, match="connection 'sealfl'"):
        RunWatcher(tmp_path, flwr_cli.CONNECTION)
    asked = []

    def fake_flwr_json(args, home, timeout_s=60.0):
        asked.append((args, home))
        return {"runs": [{"run-id": "7", "status": "finished:failed", "status-details": "ServerApp raised"}]}

    monkeypatch.setattr(flwr_cli, "flwr_json", fake_flwr_json)
    with caplog.at_level("WARNING"):
        look = deployed._RunLook(tmp_path)
    assert look.watcher is None and "asking with 'flwr ls' instead" in caplog.text
    assert look(7) == ("finished:failed", "ServerApp raised")
    assert asked == [(["ls", flwr_cli.CONNECTION, "--run-id", "7"], tmp_path)]
    with pytest.raises(DeploymentError, match="does not list run 8"):
        look(8)
    look.close()
    assert status_text("running", "") == "running" and status_text("finished", "stopped") == "finished:stopped"
