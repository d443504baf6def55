"""A deployed campaign whose coordinator directory holds no partner secret and no partner
data (issue 19, item 4): two partners make their keys on their own machines (``partner
keygen``), the coordinator creates the consortium from the public halves and ships each kit
away, keeping only the public keys; each partner starts its SuperNode with its own key and
its own CSV (``partner start KIT --key K --data CSV``); the campaign runs to the end over TLS.

Real processes on loopback, as tests/platform/test_deployment.py (whose helpers it reuses);
~1 minute here (one SuperLink, two SuperNodes, one round).
"""

from __future__ import annotations

import csv
import io
import json
import shutil

import pytest
from cryptography.hazmat.primitives import serialization

from sealfl.clients.heart.data import csv_path, n_test_for
from sealfl.clients.kit import kit_dir
from sealfl.server.bookkeeping import CampaignDir
from tests.platform.test_deployment import _free_port, _online, _sealfl, _wait
from tests.platform.test_own_keys_data import _complete_count

pytestmark = pytest.mark.slow

PARTNERS = {"Hôpital Nord": "Cleveland", "Clinic 7": "Hungary"}  # name -> whose rows its own CSV takes


def _is_private_key(data: bytes) -> bool:
    for load in (lambda b: serialization.load_pem_private_key(b, None), lambda b: serialization.load_ssh_private_key(b, None)):
        try:
            load(data)
            return True
        except Exception:  # noqa: BLE001 - any refusal means "not this form"
            pass
    return b"PRIVATE KEY" in data


def test_a_campaign_whose_coordinator_holds_no_partner_secret_and_no_partner_data_runs_to_the_end(tmp_path):
    d = tmp_path
    rows = list(csv.reader(io.StringIO(csv_path().read_text(encoding="utf-8-sig"), newline="")))
    sites, expected_n = {}, 0
    for i, (p, source) in enumerate(PARTNERS.items()):
        site = d / f"site-{i}"
        proc = _sealfl(["partner", "keygen", site / "keys"], d / f"keygen-{i}.out")
        assert proc.wait(timeout=120) == 0, (d / f"keygen-{i}.out").read_text()
        buf = io.StringIO()
        own = [r for r in rows[1:] if r[rows[0].index("dataset")] == source][::2]
        csv.writer(buf).writerows([rows[0], *own])
        neg, pos = _complete_count(rows[0], own)  # its training examples, counted from the raw rows
        expected_n += neg + pos - n_test_for(neg) - n_test_for(pos)
        (site / "own.csv").write_text(buf.getvalue(), encoding="utf-8")
        sites[p] = site
    coord = d / "coordinator"
    coord.mkdir()
    args = ["consortium", "create", coord / "cons"]
    for p, site in sites.items():
        args += ["--partner-key", f"{p}={site / 'keys' / 'partner_key.pub.pem'}"]
    proc = _sealfl(args, coord / "create.out")
    assert proc.wait(timeout=300) == 0, (coord / "create.out").read_text()
    cons = coord / "cons"
    kits = {}
    for p, site in sites.items():  # ship each kit; the coordinator keeps only the partner's public key
        slug_dir = kit_dir(cons, p)
        assert json.loads((slug_dir / "kit.json").read_text())["partner"] == p
        kits[p] = shutil.copytree(slug_dir, site / slug_dir.name)
        for f in slug_dir.iterdir():
            if f.name != "partner_key.pub.pem":
                f.unlink()
    own_private = [(s / "keys" / "partner_key.pem").read_bytes() for s in sites.values()]
    own_data = [(s / "own.csv").read_bytes()[200:400] for s in sites.values()]
    for f in cons.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert not any(k in data for k in own_private) and not any(x in data for x in own_data), f
            assert not f.name.endswith(".wrapped"), f
            if f.relative_to(cons).parts[0] == "partners":  # what is left of the partners: public keys only
                assert f.name == "partner_key.pub.pem" and not _is_private_key(data), f
            elif _is_private_key(data):  # the coordinator's own: CA, SuperLink TLS, (simulated) release-enclave TEE
                assert f.relative_to(cons).parts[0] in ("authority", "superlink", "enclave"), f

    port = _free_port()
    state = d / "superlink-state"
    procs = [_sealfl(["superlink", "start", cons / "superlink", "--port", port, "--state", state], d / "superlink.out")]
    try:
        _wait(lambda: "SuperLink on" in (d / "superlink.out").read_text() or procs[0].poll() is not None,
              "the SuperLink", 90)
        assert procs[0].poll() is None, (d / "superlink.out").read_text()
        for p, site in sites.items():
            procs.append(_sealfl(["partner", "start", kits[p], "--superlink", f"127.0.0.1:{port}", "--key",
                                  site / "keys" / "partner_key.pem", "--data", site / "own.csv"], site / "partner.out"))
        _wait(lambda: _online(state / "flwr-home") == len(sites) or any(x.poll() is not None for x in procs),
              "2 SuperNodes online", 120)
        assert all(x.poll() is None for x in procs), [(s / "partner.out").read_text() for s in sites.values()]
        camp = _sealfl(["campaign", "run", "-c", cons, "--out", d / "campaign", "--rounds", 1, "--superlink",
                        f"127.0.0.1:{port}"], d / "campaign.out")
        assert camp.wait(timeout=600) == 0, (d / "campaign.out").read_text()
    finally:
        for x in procs:
            if x.poll() is None:
                x.kill()
                x.wait()
    cd = CampaignDir(d / "campaign")
    status = cd.read_status()
    assert status["status"] == "finished" and status["server_has_secret_key"] is False
    rounds = cd.rounds()
    assert [r["round"] for r in rounds] == [1]
    assert rounds[0]["accepted"] == sorted(PARTNERS) and not rounds[0]["rejected"]
    assert rounds[0]["total_weight"] == expected_n  # the partners trained on their own CSVs
