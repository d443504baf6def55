"""Fault-injecting partners: the real partner ClientApp, except that chosen partners
tamper with one kind of reply and then sign the result with their own kit key (so the
aggregator's value checks, not the signature, must catch them -- a partner attacking
with its own replies can always sign them).

Use :func:`make_app` with ``run_campaign(..., client_app=...)`` / ``federated_evaluate``
on Ray, or :func:`reply` with the in-process grid of tests/support/fakegrid.py.

Fault modes (each one KIND of bad input from issue 5, item 2):

=========================  =========  =====================================================
mode                       phase      what the partner sends
=========================  =========  =====================================================
``nan-examples``           train      ``num-examples`` = NaN
``undeclared-examples``    train      ``num-examples`` = its statistics-round n + 100
``scale-2^30``             train      its own update with each ciphertext's scale set to 2^30
                                      (parses under the campaign's context; SEAL cannot add it)
``padded-chunk``           train      a valid ciphertext followed, inside the same chunk, by
                                      an unknown protobuf field of ``pad_bytes`` bytes
``impostor``               all        claims to be partner 0 (signs with its own key)
``stats-count-lie``        stats      declares n + 100 in plaintext, encrypts the true n
``correct-above-n``        evaluate   ``correct`` = 500 of ``n`` = 100 (also in the evaluation
                                      a train reply carries)
``gate-correct-above-n``   gate       ``int8.correct`` = 900 of ``int8.n`` = 60
``crash``                  train      raises (Flower turns it into an error reply)
=========================  =========  =====================================================
"""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import Array, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from sealfl.clients import app as capp
from sealfl.clients.kit import kit_dir, load_kit
from sealfl.common import protocol as P

PHASE = {
    "nan-examples": "train", "undeclared-examples": "train", "scale-2^30": "train", "padded-chunk": "train",
    "crash": "train", "stats-count-lie": "stats", "correct-above-n": "evaluate", "gate-correct-above-n": "gate",
    "impostor": "all",
}


def _partner(consortium_dir: str, pid: int) -> str:
    return json.loads((Path(consortium_dir) / "consortium.json").read_text())["partners"][pid]


def _varint(n: int) -> bytes:
    """Protobuf base-128 varint (TenSEAL's vector protos)."""
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def _read_varint(b: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        v |= (b[i] & 0x7F) << shift
        shift += 7
        i += 1
        if not b[i - 1] & 0x80:
            return v, i


def _rescale_seal(codec, value: bytes, scale_bits: int) -> bytes:
    import os
    import tempfile

    import tenseal.sealapi as sealapi

    ct = sealapi.Ciphertext()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ct")
        with open(path, "wb") as fh:
            fh.write(value)
        ct.load(codec._ctx.seal_context().data, path)
        ct.scale = 2.0**scale_bits
        ct.save(path)
        with open(path, "rb") as fh:
            return fh.read()


def rescale_chunk(codec, chunk: bytes, scale_bits: int) -> bytes:
    """A chunk whose SEAL ciphertext carries scale 2**scale_bits: either a bare SEAL
    ciphertext (the BFV codec's chunks) or a TenSEAL CKKSVector serialisation (fields of
    ``CKKSVectorProto``: 1 packed sizes, 2 ciphertext bytes, 3 its scale, kept). Issue 5's
    scale-2^30 ciphertext: a CKKS campaign parses it and refuses it by its scale; SEAL
    refuses to load it under a BFV context."""
    if chunk[:2] == b"\x5e\xa1":  # SEAL's magic 0xA15E, little-endian
        return _rescale_seal(codec, chunk, scale_bits)
    fields, i = [], 0
    while i < len(chunk):
        key, i = _read_varint(chunk, i)
        size, i = _read_varint(chunk, i)
        fields.append((key, chunk[i:i + size]))
        i += size
    out = b""
    for key, value in fields:
        if key == (2 << 3) | 2:
            value = _rescale_seal(codec, value, scale_bits)
        out += _varint(key) + _varint(len(value)) + value
    return out


def _rescale_update(kit, blob: bytes, scale_bits: int) -> bytes:
    """The partner's own update with every chunk's scale set to 2**scale_bits."""
    n, chunks = kit.codec.split(blob)
    return kit.codec.frame(n, [rescale_chunk(kit.codec, c, scale_bits) for c in chunks])


def tamper(mode: str, msg: Message, reply: Message, consortium_dir: str, pad_bytes: int = 64 << 20) -> Message:
    """Apply fault ``mode`` to ``reply`` (the honest reply to ``msg``) and re-sign it."""
    name = reply.content[P.PARTNER][P.NAME]
    kit = load_kit(str(kit_dir(consortium_dir, name)))
    c = reply.content
    if mode == "nan-examples":
        c[P.METRICS] = MetricRecord({P.NUM_EXAMPLES: float("nan"), P.TRAIN_LOSS: c[P.METRICS][P.TRAIN_LOSS]})
    elif mode == "undeclared-examples":
        c[P.METRICS] = MetricRecord({P.NUM_EXAMPLES: int(c[P.METRICS][P.NUM_EXAMPLES]) + 100,
                                     P.TRAIN_LOSS: c[P.METRICS][P.TRAIN_LOSS]})
    elif mode == "scale-2^30":
        blob = P.from_u8(c[P.UPDATE][P.UPDATE_CT].numpy())
        c[P.UPDATE][P.UPDATE_CT] = Array(P.to_u8(_rescale_update(kit, blob, 30)))
    elif mode == "padded-chunk":
        blob = P.from_u8(c[P.UPDATE][P.UPDATE_CT].numpy())
        n, chunks = kit.codec.split(blob)
        field15 = bytes([(15 << 3) | 2]) + _varint(pad_bytes) + bytes(pad_bytes)  # unknown length-delimited field
        c[P.UPDATE][P.UPDATE_CT] = Array(P.to_u8(kit.codec.frame(n, [chunks[0] + field15, *chunks[1:]])))
    elif mode == "stats-count-lie":
        c[P.METRICS] = MetricRecord({P.NUM_EXAMPLES: int(c[P.METRICS][P.NUM_EXAMPLES]) + 100})
    elif mode == "correct-above-n":  # an evaluate reply, or the evaluation a train reply carries
        key = P.EVALUATION if P.EVALUATION in c else P.METRICS
        c[key] = MetricRecord({P.NUM_EXAMPLES: 100, P.CORRECT: 500, P.ACCURACY: 5.0, P.LOSS: c[key][P.LOSS]})
    elif mode == "gate-correct-above-n":
        m = dict(c[P.METRICS])
        m.update({"int8.correct": 900, "int8.n": 60})
        c[P.METRICS] = MetricRecord(m)
    elif mode == "impostor":
        victim = _partner(consortium_dir, 0)
        c[P.PARTNER] = ConfigRecord({P.NAME: victim})
        stmt = P.reply_statement(kit.codec.context_id, msg.metadata.message_id, msg.metadata.message_type, victim,
                                 P.content_digest(c))
        from sealfl.attestation.keys import sign

        c[P.PARTNER] = ConfigRecord({P.NAME: victim, P.SIGNATURE: sign(kit.signing_key, stmt)})
        return reply
    else:
        raise ValueError(f"unknown fault mode {mode!r}")
    capp.sign_reply(kit, msg, c)
    return reply


def _phase_of(msg: Message) -> str:
    kind = msg.metadata.message_type
    if kind == "query":
        return "gate" if msg.content[P.CONFIG].get(P.QUERY) == P.QUERY_EVAL_ONNX else "stats"
    return kind


def reply(msg: Message, ctx: Context, consortium_dir: str, faults: dict[int, str] | None = None,
          pad_bytes: int = 64 << 20) -> Message:
    """The (possibly faulty) reply of the node with ``ctx.node_config["partition-id"]`` to ``msg``."""
    pid = int(ctx.node_config["partition-id"])
    mode = (faults or {}).get(pid)
    phase = _phase_of(msg)
    if mode == "crash" and phase == "train":
        raise RuntimeError(f"partner {pid} crashed on purpose")
    handler = {"train": capp.handle_train, "evaluate": capp.handle_evaluate}.get(phase, capp.handle_query)
    out = handler(msg, ctx, consortium_dir)
    folded = phase == "train" and P.EVALUATION in out.content and PHASE.get(mode) == "evaluate"
    if mode is not None and (PHASE[mode] in (phase, "all") or folded) and mode != "crash":
        out = tamper(mode, msg, out, consortium_dir, pad_bytes)
    return out


def make_app(consortium_dir: str, **kwargs) -> ClientApp:
    """The partner ClientApp with faults.

    Keyword args:
        faults: ``{partition id: mode}`` (modes in the module docstring).
        pad_bytes: size of the unknown field of ``padded-chunk`` (default 64 MiB).
    """
    faults = {int(k): v for k, v in dict(kwargs.get("faults", {})).items()}  # JSON keys arrive as strings
    pad_bytes = int(kwargs.get("pad_bytes", 64 << 20))
    try:  # Ray workers cannot import tests/: ship this module's code with the app
        import sys

        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    except ImportError:  # no Ray: nothing is pickled
        pass
    app = ClientApp()

    @app.query()
    def query(msg: Message, ctx: Context) -> Message:
        return reply(msg, ctx, consortium_dir, faults, pad_bytes)

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        return reply(msg, ctx, consortium_dir, faults, pad_bytes)

    @app.evaluate()
    def evaluate(msg: Message, ctx: Context) -> Message:
        return reply(msg, ctx, consortium_dir, faults, pad_bytes)

    return app
