"""A DP round through the partner app (issue 23): each partner uploads its clipped gradient
sum with its Skellam share and the count slot as BFV integers; the key holders' decoding of
the sum is one DP-SGD step over all partners' rows, and an aggregate of fewer than k partners
is refused as too little noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from sealfl.clients import app as capp
from sealfl.clients import global_record
from sealfl.clients.heart.data import HOSPITALS, load_partitions
from sealfl.clients.heart.stats import local_sums
from sealfl.clients.heart.task import HeartTask
from sealfl.clients.kit import kit_dir, load_kit
from sealfl.common import protocol as P
from sealfl.he.decrypted import open_stats
from sealfl.he.errors import TooLittleNoiseError
from sealfl.he.framed import WIDE
from sealfl.platform.consortium import create_consortium
from tests.support.he import sum_frames

W0 = np.linspace(-0.2, 0.2, 14)


def _dp_cfg(k: int, **kw) -> dict:
    return {"server-round": 2, "lr": 0.5, "seed": 0, "dp-noise-multiplier": 1e-3, "dp-clip": 1e3,
            "dp-min-partners": k, "dp-trust": 0, "dp-sampling-rate": 1.0, "dp-delta": 1e-5, **kw}


def _record(codec, model_ct=None, weight=None, plain=None) -> ArrayRecord:
    parts = load_partitions()
    stats = codec.encrypt(sum(local_sums(p.x_train) for p in parts), WIDE)
    rec = {"stats_ct": Array(P.to_u8(stats)),
           "stats_n": Array(np.array([sum(p.n_train for p in parts)], dtype=np.int64))}
    if plain is not None:
        rec["model_plain"] = Array(plain)
    else:
        rec["model_ct"], rec["model_weight"] = Array(P.to_u8(model_ct)), Array(np.array([weight], dtype=np.float64))
    return ArrayRecord(rec)


@pytest.fixture(scope="module")
def dp_round(tmp_path_factory):
    from flwr.supercore.task_identity import TaskIdentity

    mp = pytest.MonkeyPatch()
    for attr in ("_run_id", "_node_id", "_task_id"):
        mp.setattr(TaskIdentity, attr, 1, raising=False)
    cons, codec = create_consortium(tmp_path_factory.mktemp("c") / "c", "heart", list(HOSPITALS))
    frames = []
    for pid in range(len(HOSPITALS)):
        ctx = Context(run_id=1, node_id=pid + 1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})
        msg = Message(content=RecordDict({P.GLOBAL: _record(codec, plain=W0), P.CONFIG: ConfigRecord(_dp_cfg(4))}),
                      dst_node_id=1, message_type="train")
        reply = capp.handle_train(msg, ctx, str(cons.dir))
        assert float(reply.content[P.METRICS][P.TRAIN_LOSS]) == 0.0  # no plaintext loss of the records under DP
        frames.append(P.from_u8(reply.content[P.UPDATE]["update_ct"].numpy()))
    yield cons, codec, frames
    mp.undo()


def test_decoded_dp_aggregate_is_one_sgd_step_over_all_partners(dp_round):
    cons, codec, frames = dp_round
    parts = load_partitions()
    n_total = sum(p.n_train for p in parts)
    agg = sum_frames(codec, frames, 15)  # 14 parameters + the count slot
    kit = load_kit(str(kit_dir(str(cons.dir), HOSPITALS[0])))
    params, mean, std, _ = global_record.decode_global_state(_record(codec, agg, n_total), kit, None, None,
                                                    capp.round_dp(_dp_cfg(4)))
    # the oracle: one full-batch gradient step of the mean BCE over all partners' rows, plain torch
    assert np.array_equal(mean, open_stats(sum(local_sums(p.x_train) for p in parts), n_total,
                                           HeartTask().decrypt_bounds)[0])
    x = torch.as_tensor(np.concatenate([p.x_train for p in parts]), dtype=torch.float64)
    y = torch.as_tensor(np.concatenate([p.y_train for p in parts]), dtype=torch.float64)
    w = torch.tensor(W0, dtype=torch.float64, requires_grad=True)
    z = ((x - torch.as_tensor(mean, dtype=torch.float64)) / torch.as_tensor(std, dtype=torch.float64)) @ w[:-1] + w[-1]
    torch.nn.functional.binary_cross_entropy_with_logits(z, y).backward()
    # noise std: z * lr * C / N = 1e-3 * 0.5 * 1e3 / 490 ≈ 1e-3 per coordinate; the step moves by ~0.1
    np.testing.assert_allclose(params, W0 - 0.5 * w.grad.numpy(), atol=6e-3)
    assert not np.allclose(params, W0, atol=1e-3)


def test_fewer_than_k_partners_is_refused_at_the_partner_key_holder(dp_round):
    cons, codec, frames = dp_round
    agg = sum_frames(codec, frames[:3], 15)
    n3 = sum(p.n_train for p in load_partitions()[:3])
    kit = load_kit(str(kit_dir(str(cons.dir), HOSPITALS[0])))
    global_record._DECODED.clear()
    with pytest.raises(TooLittleNoiseError, match="only 3 partners counted.*k=4.*too little noise"):
        global_record.decode_global_state(_record(codec, agg, n3), kit, None, None, capp.round_dp(_dp_cfg(4)))
    # the same aggregate is accepted when the campaign's k is 3
    global_record.decode_global_state(_record(codec, agg, n3), kit, None, None, capp.round_dp(_dp_cfg(3)))


def test_a_partner_pins_its_own_dp_floor_against_the_relayed_round_config(dp_round):
    from sealfl.clients.errors import ClientError

    cons, codec, _ = dp_round
    floor = {"partition-id": 0, "dp-min-partners": 4, "dp-noise-multiplier": 1e-3}
    ctx = Context(run_id=1, node_id=1, node_config=floor, state=RecordDict(), run_config={})

    def train(cfg):
        msg = Message(content=RecordDict({P.GLOBAL: _record(codec, plain=W0), P.CONFIG: ConfigRecord(cfg)}),
                      dst_node_id=1, message_type="train")
        return capp.handle_train(msg, ctx, str(cons.dir))

    with pytest.raises(ClientError, match="dp-min-partners = 3 is below this partner's floor 4"):
        train(_dp_cfg(3))
    with pytest.raises(ClientError, match="dp-noise-multiplier = 0.0001 is below this partner's floor 0.001"):
        train(_dp_cfg(4, **{"dp-noise-multiplier": 1e-4}))
    with pytest.raises(ClientError, match="requires DP .* but the round has none"):
        train({"server-round": 2, "lr": 0.5, "seed": 0})
    assert P.UPDATE in train(_dp_cfg(4)).content  # at the floor: trains
