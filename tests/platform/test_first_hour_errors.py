"""Mistakes of a first hour, each refused up front in one line that says what the path is
and what to give instead (real CLI processes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sealfl.clients.heart.data import HOSPITALS
from sealfl.platform.consortium import create_consortium


def _cli(*args, timeout=300):
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], capture_output=True,
                         text=True, timeout=timeout)
    return out.returncode, " ".join(out.stderr.split())


@pytest.fixture(scope="module")
def cons(tmp_path_factory):
    c, _ = create_consortium(tmp_path_factory.mktemp("c") / "cons", "heart", list(HOSPITALS))
    return c


def test_kind_partner_check_says_what_the_path_is_instead_of_incomplete(cons, tmp_path):
    code, msg = _cli("partner", "check", tmp_path / "nope")
    assert code == 1 and "does not exist" in msg and "incomplete" not in msg
    code, msg = _cli("partner", "check", cons.dir)
    assert code == 1 and "is a consortium directory, not a partner's startup kit" in msg
    assert f"{cons.dir}/partners/<name>" in msg and "cleveland" in msg
    code, msg = _cli("partner", "check", cons.dir / "consortium.json")
    assert code == 1 and "is a file, not a directory" in msg


def test_kind_partner_check_refuses_a_kit_partner_start_could_not_use(cons, tmp_path):
    import shutil

    from sealfl.clients.kit import kit_dir

    for missing in ("ca.crt", "supernode_auth_key"):
        site = tmp_path / missing / "kit"
        shutil.copytree(kit_dir(cons.dir, "Cleveland"), site)
        (site / missing).unlink()
        code, msg = _cli("partner", "check", site)
        assert code == 1 and f"has no {missing}" in msg, msg


def test_kind_a_campaign_is_never_written_into_a_directory_holding_something_else(cons, tmp_path):
    for marker, what in (("manifest.json", "a release"), ("consortium.json", "a consortium"),
                         ("notes.txt", "files that are not a campaign's")):
        out = tmp_path / marker.replace(".", "-")
        out.mkdir()
        (out / marker).write_text("{}")
        code, msg = _cli("campaign", "run", "-c", cons.dir, "-o", out, "--rounds", 1)
        assert code == 1 and f"holds {what}" in msg and marker in msg, msg
        assert sorted(p.name for p in out.iterdir()) == [marker]  # nothing was written beside it


def test_kind_consortium_create_where_it_cannot_says_so(tmp_path):
    code, msg = _cli("consortium", "create", tmp_path / "no" / "such" / "parent")
    assert code == 1 and "its parent" in msg and "does not exist" in msg and "Errno" not in msg
    code, msg = _cli("consortium", "create", tmp_path / "x", "--tee", "sgx")
    assert code == 1 and "--tee must be 'sim' or 'tpm'" in msg and not (tmp_path / "x").exists()


def test_kind_a_consortium_create_that_fails_midway_leaves_no_half_written_consortium(tmp_path):
    import os

    # every check passes and the key ceremony writes its files; then the release enclave's
    # TPM does not answer: nothing of the consortium may stay behind (a new one, an empty one)
    env = {**os.environ, "SEALFL_TPM_TCTI": f"device:{tmp_path / 'no-tpm'}"}
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (tmp_path / "new", empty):
        out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "consortium", "create", str(target),
                              "--tee", "tpm"], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 1 and "TPM" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "new").exists() and list(empty.iterdir()) == []


def test_kind_a_superlink_refused_for_its_kit_leaves_no_state_directory(cons, tmp_path):
    for kit in (tmp_path / "nope", cons.dir, cons.dir / "partners" / "cleveland"):
        code, msg = _cli("superlink", "start", kit, "--port", 1, "--state", tmp_path / "state")
        assert code == 1 and "kit" in msg, msg
        assert not (tmp_path / "state").exists()
    import socket

    (tmp_path / "afile").write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    code, msg = _cli("superlink", "start", cons.dir / "superlink", "--port", free, "--state",
                     tmp_path / "afile" / "state")
    assert code == 1 and "cannot create the state directory" in msg and "Errno" not in msg, msg
    import shutil

    kit = tmp_path / "kit"
    shutil.copytree(cons.dir / "superlink", kit)
    (kit / "supernodes.json").write_text('{"partners": [{"name": "x", "public_key": "not a key"}]}')
    code, msg = _cli("superlink", "start", kit, "--port", free, "--state", tmp_path / "state")
    assert code == 1 and "partners[0] is not an OpenSSH ECDSA public key" in msg and "SuperLink on" not in msg, msg
    assert not (tmp_path / "state").exists()


def test_kind_a_superlink_on_a_host_it_cannot_listen_on_says_so_not_busy_port(cons, tmp_path):
    for host, why in (("no-such-host.invalid", "is not an address or a name of this machine"),
                      ("192.0.2.1", "is not an address of this machine"), ("[::1]", "without brackets")):
        code, msg = _cli("superlink", "start", cons.dir / "superlink", "--host", host, "--state", tmp_path / "s")
        assert code == 1 and why in msg and "another SuperLink" not in msg and "--port" not in msg, msg
        assert not (tmp_path / "s").exists()


def test_kind_a_malformed_superlink_address_is_refused_before_anything_starts(cons, tmp_path):
    kit = cons.dir / "partners" / "cleveland"
    for bad in ("127.0.0.1:99999", ":80", "[::1]", "nohost", ""):
        out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "partner", "start", str(kit),
                              "--superlink", bad, "--log", str(tmp_path / "sn.log")], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert out.returncode == 1 and "expected HOST:PORT" in out.stderr and not out.stdout, out.stderr
        assert not (tmp_path / "sn.log").exists()
        out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "campaign", "run", "-c", str(cons.dir),
                              "-o", str(tmp_path / "camp"), "--rounds", "1", "--superlink", bad],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 1 and "expected HOST:PORT" in out.stderr and "campaign started" not in out.stdout
        assert not (tmp_path / "camp").exists()


def test_kind_a_superlink_that_does_not_answer_is_refused_before_campaign_started_is_printed(cons, tmp_path):
    """Nothing listens there (and a consortium whose aggregator kit lacks ca.crt): the error
    alone, not "campaign started" and a progress bar first; nothing written."""
    import shutil
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    no_ca = shutil.copytree(cons.dir, tmp_path / "no-ca")
    (no_ca / "aggregator" / "ca.crt").unlink()
    for c, why in ((cons.dir, "cannot use the SuperLink at"), (no_ca, "has no ca.crt")):
        out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "campaign", "run", "-c", str(c),
                              "-o", str(tmp_path / "camp"), "--rounds", "1", "--superlink", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 1 and why in out.stderr, out.stderr
        assert "campaign started" not in out.stdout and "encrypted rounds" not in out.stdout, out.stdout
        assert not (tmp_path / "camp").exists()


def test_kind_a_superlink_refuses_a_busy_port_and_a_state_directory_in_use(cons, tmp_path):
    import fcntl
    import os
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, msg = _cli("superlink", "start", cons.dir / "superlink", "--port", port, "--state", tmp_path / "s1")
        assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in msg and "SuperLink on" not in msg
    state = tmp_path / "s2"
    state.mkdir()
    fd = os.open(state / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a running SuperLink holds it
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        code, msg = _cli("superlink", "start", cons.dir / "superlink", "--port", free, "--state", state)
        assert code == 1 and "another SuperLink uses the state directory" in msg
    finally:
        os.close(fd)


def test_kind_partner_check_shows_each_phase_off_a_terminal_then_the_result(cons, tmp_path):
    import shutil

    from sealfl.clients.kit import kit_dir

    site = tmp_path / "site" / "kit"  # the README's partner quickstart: the kit copied under any name
    shutil.copytree(kit_dir(cons.dir, "Cleveland"), site)
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "partner", "check", str(site)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    phases = [ln.split("] ", 1)[1] for ln in out.stderr.splitlines() if ln.startswith("[") and " s] " in ln]
    assert [p.split()[0] for p in phases] == ["open", "round-trip", "load"], out.stderr
    assert "partner Cleveland" in " ".join(out.stdout.split()) and "training examples" in out.stdout


def test_kind_cpus_per_partner_is_for_simulated_partners_only(cons, tmp_path):
    out = tmp_path / "camp"
    code, msg = _cli("campaign", "run", "-c", cons.dir, "-o", out, "--superlink", "127.0.0.1:1",
                     "--cpus-per-partner", 0.5)
    assert code == 1 and "--cpus-per-partner" in msg and "SuperNode" in msg and not out.exists()
    for bad in (0, -1, "nan", "abc"):
        code, msg = _cli("campaign", "run", "-c", cons.dir, "-o", out, "--cpus-per-partner", bad)
        assert code in (1, 2) and "--cpus-per-partner" in msg and not out.exists(), (bad, msg)


def test_kind_a_path_that_cannot_be_written_is_named_not_errno(cons, tmp_path):
    (tmp_path / "afile").write_text("")
    code, msg = _cli("campaign", "run", "-c", cons.dir, "-o", tmp_path / "afile" / "sub" / "camp", "--prepare-only")
    assert code == 1 and "afile" in msg and "Errno" not in msg and "check that the path exists" in msg, msg


def test_kind_a_superlink_nothing_answers_at_is_refused_before_the_campaign_is_written(cons, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    for address in (f"127.0.0.1:{closed}", "nohost.invalid:9092"):
        code, msg = _cli("campaign", "run", "-c", cons.dir, "-o", tmp_path / "camp", "--rounds", 1, "--superlink",
                         address)
        assert code == 1 and f"cannot use the SuperLink at {address}" in msg and "nothing was written" in msg, msg
        assert not (tmp_path / "camp").exists()  # a retry needs no --overwrite


def test_kind_partner_start_refuses_a_superlink_name_that_does_not_resolve(cons, tmp_path):
    # the SuperNode would retry it silently forever
    code, msg = _cli("partner", "start", cons.dir / "partners" / "cleveland", "--superlink", "nohost.invalid:9092",
                     "--log", tmp_path / "sn.log")
    assert code == 1 and "'nohost.invalid' does not resolve" in msg and "SuperNode of" not in msg, msg
    assert not (tmp_path / "sn.log").exists()


def test_kind_campaign_status_shows_refusals_of_every_phase(cons, tmp_path):
    import json

    code, msg = _cli("campaign", "run", "-c", cons.dir, "-o", tmp_path / "camp", "--rounds", 2, "--prepare-only")
    assert code == 0, msg
    rec = {"round": 1, "accepted": ["Cleveland"], "rejected": {"Hungary": "late"},
           "stats_rejected": {"Cleveland? (node-7)": "partner.signature: does not verify"},
           "eval_rejected": {"Switzerland": "bad metrics"}}
    (tmp_path / "camp" / "rounds.jsonl").write_text(json.dumps(rec) + "\n")
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "campaign", "status", str(tmp_path / "camp")],
                         capture_output=True, text=True, timeout=300)
    cells = " ".join(w for w in out.stdout.split() if w not in "│┃")  # the table wraps long cells
    for words in ("statistics: Cleveland?", "(node-7): partner.signature:", "Hungary: late", "evaluation:",
                  "Switzerland: bad"):
        assert words in cells, out.stdout
