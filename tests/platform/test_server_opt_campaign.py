"""A whole encrypted campaign with a server optimizer (the real ServerApp body, the real
partner handlers and HE codec, real flwr Messages on the in-process grid of
tests/support/fakegrid.py), checked against Flower 1.42's own plaintext FedAdam/FedAvgM driving
the same local training: the global model the partners decrypt each round, and the one
the release enclave opens at the end, are Flower's to within the grids -- also when a
partner misses a round (the optimizer's state travels in the aggregate, not at the
partners)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sealfl.clients.heart.data import HOSPITALS, N_FEATURES, load_partitions
from sealfl.clients.heart.stats import local_sums, mean_std
from sealfl.clients.heart.task import HeartTask
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.enclave.release.keyholder import KeyHolder
from sealfl.he.server_opt import ServerOpt
from sealfl.platform.campaign_outcome import finished_checkpoint
from sealfl.platform.consortium import create_consortium
from sealfl.platform.partner_keys import partner_public_keys
from sealfl.platform.release import enclave_dir, open_final_model, provision_release_enclave
from sealfl.server.app import ServerConfig, run_server
from sealfl.server.bookkeeping import CampaignDir
from tests.support.fakegrid import FakeGrid

ROUNDS = 3
TRAIN = {"local-epochs": 2, "lr": 0.05, "batch-size": 16, "seed": 0}
#: the partners train from the decrypted model, which is on the 2^-20 grid and a few
#: grid steps from Flower's float64 one; two epochs of SGD (lr 0.05, standardised inputs)
#: move such a difference by a small factor, and three rounds of the optimizer by at most
#: ~10x (see tests/test_server_opt.py): 1e-3 bounds that with room, while the optimizers
#: move the model by ~0.1 per round from plain FedAvg's.
TOL = 1e-3


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    cons, codec = create_consortium(tmp_path_factory.mktemp("cons") / "c", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    return cons, codec


def _flower_reference(opt: ServerOpt, present: list[list[int]]):
    """Flower's strategy in plaintext over the same local training (HeartTask.train_round,
    the same seeds): the global model after each round."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAdam, FedAvgM

    task, parts = HeartTask(), load_partitions()
    mean, std = mean_std(np.sum([local_sums(p.x_train) for p in parts], axis=0))
    x = task.init_params()
    if opt.name == "fedavgm":
        s = FedAvgM(server_learning_rate=opt.lr, server_momentum=opt.momentum)
        s.current_arrays = ArrayRecord({"w": Array(x)})
    else:
        s = FedAdam(eta=opt.lr, beta_1=opt.beta_1, beta_2=opt.beta_2, tau=opt.tau)
    out = []
    for r in range(1, ROUNDS + 1):
        if opt.name == "fedadam":
            s.current_arrays = {"w": x}
        replies = []
        for i in present[r - 1]:
            new, _ = task.train_round(x, parts[i], mean, std, {**TRAIN, "server-round": r}, 1000 * r + i)
            replies.append(Message(RecordDict({"arrays": ArrayRecord({"w": Array(new)}),
                                               "metrics": MetricRecord({"num-examples": parts[i].n_train})}),
                                   dst_node_id=i + 1, message_type="train"))
        rec, _ = s.aggregate_train(r, replies)
        x = rec["w"].numpy().astype(np.float64)
        out.append(x)
    return out


@pytest.mark.parametrize("opt", [ServerOpt("fedadam", lr=0.05), ServerOpt("fedavgm", lr=1.0, momentum=0.9)],
                         ids=["fedadam", "fedavgm"])
def test_encrypted_campaign_with_a_server_optimizer_matches_flower(opt, consortium, tmp_path, server_identity):
    cons, codec = consortium
    task = HeartTask()
    out = tmp_path / "camp"
    grid = FakeGrid(str(cons.dir), len(cons.partners))
    absent = grid.node_ids[1]
    present = [[0, 1, 2, 3], [0, 2, 3], [0, 1, 2, 3]]
    decrypted: dict[int, np.ndarray] = {}

    phases: list[str] = []

    def after(g, mtype):
        phases.append(mtype)
        # what partner 0 decrypts: round k's global model, evaluated in round k+1's train message
        # (the last one in its own evaluate message)
        if (mtype == "train" and phases.count("train") >= 2) or mtype == "evaluate":
            from sealfl.clients.global_record import decode_global
            from sealfl.clients.kit import kit_dir, load_kit

            msg = next(m for m in reversed(g.sent) if m.metadata.dst_node_id == g.node_ids[0])
            kit = load_kit(str(kit_dir(str(cons.dir), cons.partners[0])))
            decrypted[len(decrypted) + 1] = decode_global(msg.content["global"], kit, task,
                                                          ServerOpt.from_config(msg.content["config"]))[0]
        n_train = phases.count("train")
        if mtype == "train" and n_train == 1:
            g.connected.discard(absent)  # partner 1 misses round 2's training (and round 1's evaluation) ...
        elif mtype == "train" and n_train == 2:
            g.connected.add(absent)  # ... and is back for its evaluation and round 3

    grid.after_round = after
    cfg = ServerConfig(
        campaign_dir=str(out), public_context=str(cons.public_context), context_id=cons.context_id,
        he=cons.he_params.to_dict(), num_partners=4, min_partners=3, num_rounds=ROUNDS, n_params=task.n_params,
        stats_length=1 + 2 * N_FEATURES, initial_params=task.init_params().tolist(),
        train={**TRAIN, **opt.to_config()}, timeout_s=30.0, partners=list(cons.partners),
        partner_keys=partner_public_keys(cons))
    run_server(grid, cfg)
    CampaignDir(out).write_config(cfg.to_dict())  # as run_campaign does: the release reads the optimizer from it
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "finished"
    recs = CampaignDir(out, ROUNDS).rounds()
    assert [len(r["accepted"]) for r in recs] == [4, 3, 4]
    # partners uploaded [model, state]: the aggregate is the wire length, not the model's
    assert recs[0]["fp32_bytes_per_update"] == 4 * opt.wire_length(task.n_params)

    ref = _flower_reference(opt, present)
    for r in range(1, ROUNDS + 1):
        np.testing.assert_allclose(decrypted[r], ref[r - 1], atol=TOL, err_msg=f"round {r}")
    fedavg_like = np.max(np.abs(ref[-1] - ref[-2]))
    assert fedavg_like > 10 * TOL  # the model moved: the comparison is not of two zeros

    # the release enclave opens the last checkpoint with the same step
    keys = KeyHolder(ReleaseEnclave.open(enclave_dir(cons)), cons.he_params, bytes.fromhex(cons.context_id))
    params, _, _ = open_final_model(keys, finished_checkpoint(out), task, out)
    np.testing.assert_array_equal(params, decrypted[ROUNDS])

    from tests.support.faults import run_cli

    shown = " ".join(run_cli(["campaign", "status", out], timeout_s=120).stdout.split())
    assert f"server optimizer: {opt.name} (server-lr={opt.lr:g}" in shown

    # ... and refuses it once the settings it would step with are not the campaign's
    # (server_config.json edited after the campaign: a model nobody trained)
    from sealfl.platform.errors import ReleaseError

    saved = json.loads(CampaignDir(out).config_path.read_text())
    saved["train"]["server-lr"] = opt.lr * 2
    CampaignDir(out).config_path.write_text(json.dumps(saved))
    with pytest.raises(ReleaseError, match="not made with this campaign's settings"):
        open_final_model(keys, finished_checkpoint(out), task, out)


@pytest.mark.parametrize("args, what", [
    (["--server-opt", "fedyogi"], "unknown server optimizer 'fedyogi'"),
    (["--server-opt", "fedavgm", "--server-momentum", "1.5"], "server-momentum must be in [0.0, 1.0), got 1.5"),
    (["--server-opt", "fedadam", "--server-lr", "-1"], "server-lr must be in [0.0001, 100.0], got -1.0"),
    (["--server-opt", "fedadam", "--server-momentum", "0.5"], "server-momentum does not apply to fedadam"),
    (["--server-lr", "0.5"], "server-lr does not apply to fedavg"),
    (["--proximal-mu", "-1"], "proximal mu must be a finite number in [0, 1000]"),
    (["--proximal-mu", "nan"], "proximal mu must be a finite number in [0, 1000]"),
])
def test_cli_refuses_bad_server_optimizer_settings_before_anything_runs(args, what, consortium, tmp_path):
    from tests.support.faults import run_cli

    cons, _ = consortium
    out = tmp_path / "camp"
    r = run_cli(["campaign", "run", "-c", cons.dir, "-o", out, "--rounds", 1, *args], timeout_s=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert what in " ".join((r.stdout + r.stderr).split())
    assert not out.exists()  # nothing was written


def test_fedprox_term_keeps_local_models_closer_to_the_global_one():
    """FedProx (Li et al., MLSys 2020): the proximal term ½μ‖w - w_global‖² pulls local
    training toward the global model -- the further the larger μ -- and μ = 0 is FedAvg's
    local training exactly."""
    task, part = HeartTask(), load_partitions()[0]
    mean, std = mean_std(local_sums(part.x_train))
    start = np.random.default_rng(1).normal(0, 0.5, task.n_params)
    cfg = {**TRAIN, "local-epochs": 3}
    dist = []
    for mu in (0.0, 0.1, 1.0, 10.0):
        new, _ = task.train_round(start, part, mean, std, {**cfg, "proximal-mu": mu}, 7)
        dist.append(float(np.linalg.norm(new - start)))
    assert all(a > b for a, b in zip(dist, dist[1:])), dist
    plain, _ = task.train_round(start, part, mean, std, cfg, 7)
    np.testing.assert_array_equal(plain, task.train_round(start, part, mean, std, {**cfg, "proximal-mu": 0.0}, 7)[0])


def _write_train(out, train):
    out.mkdir(parents=True, exist_ok=True)
    CampaignDir(out).config_path.write_text(json.dumps({"train": train}))


@pytest.mark.parametrize("train, what", [
    ({"server-opt": "fedadam", "server-tau": True}, "must be a number"),  # not silently the default
    ({"server-opt": None}, "must be a string"),
    ({"server-opt": "fedadam", "server-lr": [0.1]}, "must be a number"),
    ({"server-opt": "fedadam", "server-beta-1": 0.5}, "unknown server optimizer settings"),
    ([1, 2], "field 'train' must be an object, got array"),
])
def test_the_release_reads_every_optimizer_setting_as_written(train, what, tmp_path):
    from sealfl.he.errors import ServerOptError
    from sealfl.platform.campaign_outcome import campaign_server_opt

    _write_train(tmp_path / "camp", train)
    with pytest.raises(ServerOptError, match=what):
        campaign_server_opt(tmp_path / "camp")


def test_the_release_refuses_a_campaign_whose_optimizer_it_cannot_read(tmp_path):
    """A missing server_config.json means FedAvg (for the release: the aggregate of any other
    optimizer is then refused by its length and tag); an unreadable one is refused."""
    from sealfl.he.errors import ServerOptError
    from sealfl.platform.campaign_outcome import campaign_server_opt

    with pytest.raises(ServerOptError, match="missing"):
        campaign_server_opt(tmp_path / "nothing-here", missing_ok=False)
    assert campaign_server_opt(tmp_path / "nothing-here") == ServerOpt()  # then the tag and length decide
    (tmp_path / "bad").mkdir()
    CampaignDir(tmp_path / "bad").config_path.write_text("{not json")
    with pytest.raises(ServerOptError, match="cannot read"):
        campaign_server_opt(tmp_path / "bad")
    _write_train(tmp_path / "camp", {"lr": 0.05, "server-round": 3})  # names none: FedAvg
    assert campaign_server_opt(tmp_path / "camp") == ServerOpt()


@pytest.mark.parametrize("kw, what", [
    ({"extra": {"server-opt": "fedadam"}}, "go in server_opt"),
    ({"extra": {"server-beta-1": 0.5}}, "go in server_opt"),
    ({"server_opt": "fedadam"}, "must be a ServerOpt"),
    ({"server_opt": None}, "must be a ServerOpt"),
])
def test_campaign_spec_refuses_optimizer_settings_outside_server_opt(kw, what, tmp_path):
    from sealfl.platform.campaign import CampaignSpec
    from sealfl.platform.campaign_checks import check_spec
    from sealfl.platform.errors import CampaignError

    with pytest.raises(CampaignError, match=what):
        check_spec(CampaignSpec(str(tmp_path), str(tmp_path / "out"), **kw), 4, 3)
