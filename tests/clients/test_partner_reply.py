"""A partner's train reply carries its update only as BFV ciphertext: the plaintext
weights (as float64 or float32 bytes) appear nowhere in what it sends, and the
aggregate of the replies decrypts to the weighted mean of the partners' own models."""

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from sealfl.clients import app as capp
from sealfl.clients.heart.data import HOSPITALS, load_partitions
from sealfl.clients.heart.stats import local_sums, mean_std
from sealfl.clients.heart.task import HeartTask, TrainConfig
from sealfl.common import protocol as P
from sealfl.he.decrypted import open_stats
from sealfl.he.framed import WIDE
from sealfl.platform.consortium import create_consortium
from tests.support.he import sum_frames

N_TOTAL = sum(p.n_train for p in load_partitions())


def _train_msg(codec, round_=1):
    parts = load_partitions()
    stats = codec.encrypt(sum(local_sums(p.x_train) for p in parts), WIDE)
    content = RecordDict({
        P.GLOBAL: ArrayRecord({"model_plain": Array(np.zeros(14)), "stats_ct": Array(P.to_u8(stats)),
                               "stats_n": Array(np.array([sum(p.n_train for p in parts)], dtype=np.int64))}),
        P.CONFIG: ConfigRecord({"server-round": round_, "local-epochs": 2, "lr": 0.05, "batch-size": 16, "seed": 0}),
    })
    return Message(content=content, dst_node_id=1, message_type="train")


def _payload_bytes(reply) -> bytes:
    out = b""
    for rec in reply.content.array_records.values():
        for arr in rec.values():
            out += arr.numpy().tobytes()
    return out


def test_train_reply_holds_ciphertext_only(tmp_path, monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    # the identity a ServerApp process has when it creates messages
    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1, raising=False)
    cons, codec = create_consortium(tmp_path / "c", "heart", list(HOSPITALS))
    parts = load_partitions()
    # the partner rounds the decrypted statistics to the task's grid before it trains
    task = HeartTask()
    mean, std = open_stats(sum(local_sums(p.x_train) for p in parts), sum(p.n_train for p in parts),
                           task.decrypt_bounds)
    np.testing.assert_allclose(mean, mean_std(sum(local_sums(p.x_train) for p in parts))[0], atol=1e-6)
    total = np.zeros(14)
    n_total = 0
    frames = []
    for pid, part in enumerate(parts):
        ctx = Context(run_id=1, node_id=pid + 1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})
        reply = capp.handle_train(_train_msg(codec), ctx, str(cons.dir))
        # the partner's own plaintext model, recomputed independently with the same seed
        w, _ = task.train(np.zeros(14), part.x_train, part.y_train, mean, std,
                          TrainConfig(local_epochs=2, lr=0.05, batch_size=16), 0 + 1000 * 1 + pid)
        n = part.n_train
        payload = _payload_bytes(reply)
        assert list(reply.content[P.UPDATE].keys()) == ["update_ct"]
        assert reply.content[P.UPDATE]["update_ct"].numpy().dtype == np.uint8
        share = w * n / N_TOTAL
        for plain in (w * n, w, share, (w * n).astype(np.float32), w.astype(np.float32), share.astype(np.float32)):
            for k in range(0, 14, 4):  # any 4 consecutive parameters
                assert plain[k:k + 4].tobytes() not in payload
        assert int(reply.content[P.METRICS][P.NUM_EXAMPLES]) == n
        frames.append(P.from_u8(reply.content[P.UPDATE]["update_ct"].numpy()))
        total += w * n
        n_total += n
    agg = sum_frames(codec, frames, 14)
    # the default codec, packed BFV, carries Σ (n_i / N) w_i, exact up to its 2^-23 grid (4 partners:
    # error <= 4 * 2^-24); CKKS would carry Σ n_i w_i (its noise ~1e-8)
    assert codec.WEIGHTING == "share" and n_total == N_TOTAL
    np.testing.assert_allclose(codec.decrypt(agg, 14), total / n_total, rtol=0, atol=4 * 2.0**-24)
