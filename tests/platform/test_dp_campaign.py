"""A DP campaign end to end on the in-process grid (the real ServerApp body, the real partner
handlers and BFV codec; tests/support/fakegrid.py): ε and δ after every round in
rounds.jsonl and `campaign status`, the release enclave opens the final DP aggregate (count
slot checked), the privacy block the release metadata carries; and the CLI refuses nonsense
DP settings before anything runs (issue 23)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sealfl.clients.heart.data import HOSPITALS, N_FEATURES
from sealfl.clients.heart.task import HeartTask
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.enclave.release.keyholder import KeyHolder
from sealfl.he.dp import DPConfig
from sealfl.platform.campaign_outcome import campaign_privacy, finished_checkpoint
from sealfl.platform.consortium import create_consortium
from sealfl.platform.partner_keys import partner_public_keys
from sealfl.platform.release import enclave_dir, open_final_model, provision_release_enclave
from sealfl.server.app import ServerConfig, run_server
from sealfl.server.bookkeeping import CampaignDir
from tests.support.fakegrid import FakeGrid

ROUNDS = 3
DP = DPConfig(noise_multiplier=1.0, clip=1.0, min_partners=4, trust=1, sampling_rate=0.5)


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    cons, codec = create_consortium(tmp_path_factory.mktemp("cons") / "c", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    return cons, codec


def test_dp_campaign_records_epsilon_every_round_and_the_release_opens_it(consortium, tmp_path, server_identity):
    cons, _ = consortium
    task = HeartTask()
    out = tmp_path / "camp"
    grid = FakeGrid(str(cons.dir), len(cons.partners))
    decrypted: list[np.ndarray] = []
    phases: list[str] = []
    gone = grid.node_ids[1]

    def after(g, mtype):
        phases.append(mtype)
        if mtype == "train" and phases.count("train") == 1:
            g.unreachable.add(gone)  # partner 1's round-2 update never arrives: 3 < k = 4 count ...
        elif mtype == "train" and phases.count("train") == 2:
            g.unreachable.discard(gone)  # ... and it is back for round 3
        # what partner 0 decrypts: round k's global model, evaluated in round k+1's train message
        # (the last one in its own evaluate message)
        if (mtype == "train" and phases.count("train") >= 2) or mtype == "evaluate":
            from sealfl.clients.app import round_dp
            from sealfl.clients.global_record import decode_global
            from sealfl.clients.kit import kit_dir, load_kit

            msg = next(m for m in reversed(g.sent) if m.metadata.dst_node_id == g.node_ids[0])
            kit = load_kit(str(kit_dir(str(cons.dir), cons.partners[0])))
            decrypted.append(decode_global(msg.content["global"], kit, task, None, round_dp(msg.content["config"]))[0])

    grid.after_round = after
    train = {"lr": 0.5, "seed": 0, **DP.to_config(), "dp-delta": 1e-5, "dp-epsilon": 50.0}
    cfg = ServerConfig(
        campaign_dir=str(out), public_context=str(cons.public_context), context_id=cons.context_id,
        he=cons.he_params.to_dict(), num_partners=4, min_partners=4, num_rounds=ROUNDS, n_params=task.n_params,
        stats_length=1 + 2 * N_FEATURES, initial_params=task.init_params().tolist(), train=train, timeout_s=30.0,
        partners=list(cons.partners), partner_keys=partner_public_keys(cons))
    run_server(grid, cfg)
    CampaignDir(out).write_config(cfg.to_dict())
    assert json.loads((out / "status.json").read_text())["status"] == "finished"
    recs = CampaignDir(out, ROUNDS).rounds()
    eps = [r["privacy"]["epsilon"] for r in recs]
    # round 2 is not published (too little noise) and costs no privacy; the campaign goes on
    assert "skipped" not in recs[0] and "skipped" not in recs[2]
    assert "too little noise: only 3 partner update(s)" in recs[1]["skipped"] and "k=4" in recs[1]["skipped"]
    assert [r["privacy"]["rounds"] for r in recs] == [1, 1, 2]
    assert 0 < eps[0] == eps[1] < eps[2] <= 50.0
    assert all(r["privacy"]["delta"] == 1e-5 and r["privacy"]["min_partners"] == 4 and r["privacy"]["trust"] == 1
               for r in recs)
    # every round moved the model (noisy DP-SGD steps), and the accuracy is a real figure
    assert len(decrypted) == ROUNDS and not np.allclose(decrypted[0], decrypted[-1])
    np.testing.assert_array_equal(decrypted[0], decrypted[1])  # the skipped round left the model as it was
    assert 0.0 <= recs[-1]["pooled_test_accuracy"] <= 1.0

    keys = KeyHolder(ReleaseEnclave.open(enclave_dir(cons)), cons.he_params, bytes.fromhex(cons.context_id))
    params, _, _ = open_final_model(keys, finished_checkpoint(out), task, out)
    np.testing.assert_array_equal(params, decrypted[-1])
    block = campaign_privacy(out)  # what the release metadata carries as "privacy"
    assert block == recs[-1]["privacy"] and block["accountant"] == "dp-accounting PLD"

    from tests.support.faults import run_cli

    shown = " ".join(run_cli(["campaign", "status", out], timeout_s=120).stdout.split())
    assert f"ε = {eps[-1]:.4f}, δ = 1e-05 after 2 rounds (budget ε = 50)" in shown
    assert "k = 4, t = 1" in shown


@pytest.mark.parametrize("args, what", [
    (["--dp-noise-multiplier", "1", "--dp-trust", "3", "--min-partners", "3"], "trust t"),
    (["--dp-noise-multiplier", "1", "--dp-delta", "0"], "DP delta must be in (0, 1)"),
    (["--dp-noise-multiplier", "-1"], "DP noise multiplier must be in (0, 1e4]"),
    (["--dp-noise-multiplier", "1", "--dp-clip", "0"], "DP clip norm must be in (0, 1e6]"),
    (["--dp-epsilon", "-2"], "DP epsilon must be in (0, 100]"),
    (["--dp-noise-multiplier", "1", "--dp-sampling-rate", "1.5"], "DP sampling rate must be in (0, 1]"),
])
def test_cli_refuses_nonsense_dp_settings_before_anything_runs(args, what, consortium, tmp_path):
    from tests.support.faults import run_cli

    cons, _ = consortium
    out = tmp_path / "camp"
    r = run_cli(["campaign", "run", "-c", cons.dir, "-o", out, "--rounds", 1, *args], timeout_s=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert what in " ".join((r.stdout + r.stderr).split())
    assert not out.exists()


@pytest.mark.slow
def test_real_campaign_stops_before_the_round_that_would_exceed_the_budget(consortium, tmp_path):
    """Flower simulation on Ray, the real partner app: asked for 6 rounds with a budget that 3
    rounds fit and 4 do not, the campaign runs 3 and every recorded ε is within the budget."""
    from sealfl.he.dp_account import epsilon
    from sealfl.platform.campaign import CampaignSpec, DPSpec, run_campaign

    cons, _ = consortium
    budget = (epsilon(1.0, [0.2] * 3, 1e-5) + epsilon(1.0, [0.2] * 4, 1e-5)) / 2
    spec = CampaignSpec(str(cons.dir), str(tmp_path / "camp"), rounds=6, min_partners=4, lr=1.0,
                        dp=DPSpec(delta=1e-5, epsilon=budget, noise_multiplier=1.0, clip=1.0, trust=1,
                                  sampling_rate=0.2))
    res = run_campaign(spec)
    assert res.status["num_rounds"] == 3 and len(res.rounds) == 3
    eps = [r["privacy"]["epsilon"] for r in res.rounds]
    assert eps == sorted(eps) and eps[-1] <= budget
    assert all(r["accepted"] == sorted(cons.partners) for r in res.rounds)
