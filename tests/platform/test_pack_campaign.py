"""A whole encrypted campaign at a narrow BFV packing (``consortium create --pack-bits 13``):
the real ServerApp body, partner handlers and codec over the in-process grid of
tests/support/fakegrid.py. The partners' first global model is plaintext FedAvg of the same
local training to within the documented bound (K partners x the 2^-9 step, plus the 2^-20
grid); the release enclave opens the same model; the wire carries 4 values per slot; and
the CLI writes the setting into the consortium or refuses a bad one before writing anything."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sealfl.clients.heart.data import HOSPITALS, N_FEATURES, load_partitions
from sealfl.clients.heart.stats import local_sums, mean_std
from sealfl.clients.heart.task import HeartTask
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.enclave.release.keyholder import KeyHolder
from sealfl.he.bfv import BFVParams
from sealfl.platform.campaign_outcome import finished_checkpoint
from sealfl.platform.consortium import create_consortium
from sealfl.platform.errors import ConsortiumError
from sealfl.platform.partner_keys import partner_public_keys
from sealfl.platform.release import enclave_dir, open_final_model, provision_release_enclave
from sealfl.server.app import ServerConfig, run_server
from sealfl.server.bookkeeping import CampaignDir
from tests.support.fakegrid import FakeGrid

TRAIN = {"local-epochs": 2, "lr": 0.05, "batch-size": 16, "seed": 0}
STEP = 2.0**-9  # the 13-bit packing's step (docs/encryption.md)


def test_kind_campaign_at_13_bits_is_fedavg_within_the_packing_bound(tmp_path, server_identity):
    cons, codec = create_consortium(tmp_path / "cons", "heart", list(HOSPITALS), params=BFVParams(pack_bits=13))
    provision_release_enclave(cons, codec.secret_context_bytes())
    assert json.loads((cons.dir / "consortium.json").read_text())["he"]["pack_bits"] == 13
    task = HeartTask()
    out = tmp_path / "camp"
    grid = FakeGrid(str(cons.dir), len(cons.partners))
    decrypted = []
    phases: list[str] = []

    def after(g, mtype):
        phases.append(mtype)
        # partner 0 decrypts round k's global model from round k+1's train message (the
        # last round's from its own evaluate message)
        if (mtype == "train" and phases.count("train") >= 2) or mtype == "evaluate":
            from sealfl.clients.global_record import decode_global
            from sealfl.clients.kit import kit_dir, load_kit
            from sealfl.he.server_opt import ServerOpt

            msg = next(m for m in reversed(g.sent) if m.metadata.dst_node_id == g.node_ids[0])
            kit = load_kit(str(kit_dir(str(cons.dir), cons.partners[0])))
            assert kit.codec.params.pack_bits == 13
            decrypted.append(decode_global(msg.content["global"], kit, task,
                                           ServerOpt.from_config(msg.content["config"]))[0])

    grid.after_round = after
    cfg = ServerConfig(
        campaign_dir=str(out), public_context=str(cons.public_context), context_id=cons.context_id,
        he=cons.he_params.to_dict(), num_partners=4, min_partners=4, num_rounds=2, n_params=task.n_params,
        stats_length=1 + 2 * N_FEATURES, initial_params=task.init_params().tolist(), train=TRAIN, timeout_s=30.0,
        partners=list(cons.partners), partner_keys=partner_public_keys(cons))
    run_server(grid, cfg)
    CampaignDir(out).write_config(cfg.to_dict())
    assert json.loads((out / "status.json").read_text())["status"] == "finished"

    # round 1 from the public initial model: plaintext weighted FedAvg of the same local training
    parts = load_partitions()
    mean, std = mean_std(np.sum([local_sums(p.x_train) for p in parts], axis=0))
    x0 = task.init_params()
    local = [task.train_round(x0, p, mean, std, {**TRAIN, "server-round": 1}, 1000 + i)[0] for i, p in enumerate(parts)]
    n = np.array([p.n_train for p in parts], dtype=np.float64)
    ref = np.sum([w * ni for w, ni in zip(local, n)], axis=0) / n.sum()
    err = np.max(np.abs(decrypted[0] - ref))
    assert err < 4 * STEP + 2.0**-20
    assert np.max(np.abs(decrypted[0] - x0)) > 10 * STEP  # the model moved: not a comparison of two zeros

    keys = KeyHolder(ReleaseEnclave.open(enclave_dir(cons)), cons.he_params, bytes.fromhex(cons.context_id))
    params, _, _ = open_final_model(keys, finished_checkpoint(out), task, out)
    np.testing.assert_array_equal(params, decrypted[-1])


def test_kind_a_narrow_packing_is_refused_for_more_partners_than_it_has_room_for(tmp_path):
    names = [f"p{i}" for i in range(65)]
    with pytest.raises(ConsortiumError, match="room for the rounding of 64 partners, not 65"):
        create_consortium(tmp_path / "c", "heart", names, params=BFVParams(pack_bits=10, pack_range=1))
    assert not (tmp_path / "c").exists()


def test_cli_writes_the_packing_and_refuses_a_bad_one_before_writing(tmp_path):
    from tests.support.faults import run_cli

    r = run_cli(["consortium", "create", tmp_path / "bad", "--pack-bits", "12"], timeout_s=120)
    msg = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 1 and "packing width 12 bits is not supported" in msg and "Traceback" not in msg
    assert not (tmp_path / "bad").exists()
    r = run_cli(["consortium", "create", tmp_path / "ckks", "--he", "ckks", "--pack-bits", "13"], timeout_s=120)
    assert r.returncode == 1 and "use --he bfv" in " ".join(r.stderr.split()) and not (tmp_path / "ckks").exists()
    r = run_cli(["consortium", "create", tmp_path / "ok", "--pack-bits", "10", "--pack-range", "1"], timeout_s=300)
    assert r.returncode == 0, r.stderr
    he = json.loads((tmp_path / "ok" / "consortium.json").read_text())["he"]
    assert (he["pack_bits"], he["pack_range"]) == (10, 1)
    kit = json.loads(next((tmp_path / "ok" / "partners").glob("*/kit.json")).read_text())
    assert (kit["he"]["pack_bits"], kit["he"]["pack_range"]) == (10, 1)  # partners encrypt at the same width
