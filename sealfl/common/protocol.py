"""Record keys and (de)serialisation of the messages partners and the aggregator exchange.

All ciphertexts travel as uint8 ``Array`` entries of an ``ArrayRecord`` (Flower chunks
those; it does not chunk ``bytes`` in a ``ConfigRecord``).

Server -> partner (train / evaluate), ArrayRecord ``"global"``:
    ``model_plain`` float64 (P,)   -- round 1 only: the public initial model, or
    ``model_ct`` uint8 (frame) + ``model_weight`` float64 (1,) -- E(Σ n_i w_i) and Σ n_i
    ``stats_ct`` uint8 (frame)     -- E(Σ [n, Σx, Σx²]) for global scaling
    ``stats_n`` int64 (1,)         -- Σ of the counts partners declared in the statistics
                                      round; key holders check the decrypted n against it
Partner -> server (train reply): ArrayRecord ``"update"`` with ``update_ct`` uint8 =
    E(n_i · w_i) (the locally trained weights times the sample count), MetricRecord
    ``"metrics"`` with ``num-examples`` (n_i, int, equal to the n it declared in the
    statistics round) and ``train_loss``.
Server -> partner (query ``stats``): ConfigRecord ``"config"`` ``{"query": "stats"}``;
    reply ArrayRecord ``"stats"`` with ``stats_ct`` = E([n, Σx, Σx²]) and MetricRecord
    ``"metrics"`` with ``num-examples`` (n, int: the count it encrypted).
Partner -> server (evaluate reply): MetricRecord ``"metrics"`` with ``num-examples``
    (n_test, int), ``correct`` (int), ``accuracy`` (= correct / n) and ``loss``.
Evaluation folded into training: a train message whose ConfigRecord ``"config"`` has
    ``evaluate-round`` = k > 0 carries round k's aggregate as its ``"global"``; the partner
    evaluates that model on its test split before it trains and its train reply carries,
    beside ``"update"`` and ``"metrics"``, MetricRecord ``"evaluation"`` with the evaluate
    reply's keys (the evaluation of round k). So a campaign sends one message per partner
    per round, plus one evaluate message after its last round.
Server -> partner (query ``evaluate-onnx``): ArrayRecord ``"candidates"`` (name -> ONNX
    bytes as uint8); reply MetricRecord ``"metrics"`` with ``<name>.correct``, ``<name>.n``.

Every partner reply also carries ConfigRecord ``"partner"`` with ``name`` (str) and
``signature`` (bytes): ECDSA P-256 / SHA-256 (DER) by the partner's kit key over
:func:`reply_statement` -- a domain-separated encoding of the campaign's context id, the
id of the message it answers, the message type, the partner name and
:func:`content_digest` of everything else in the reply. So a reply cannot be claimed by
another partner, replayed into another round, or altered on the way.

FedAvg on weights equals FedAvg on deltas (w + Σ n_i Δ_i / N = Σ n_i w_i / N), and lets
a partner that missed a round rejoin from the next aggregate without local state.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from sealfl.common.errors import ProtocolError

GLOBAL = "global"
UPDATE = "update"
STATS = "stats"
METRICS = "metrics"
PARTNER = "partner"
CONFIG = "config"
NUM_EXAMPLES = "num-examples"
QUERY_STATS = "stats"
QUERY_EVAL_ONNX = "evaluate-onnx"
CANDIDATES = "candidates"
NAME = "name"
SIGNATURE = "signature"
UPDATE_CT = "update_ct"
STATS_CT = "stats_ct"
STATS_N = "stats_n"
MODEL_CT = "model_ct"
MODEL_WEIGHT = "model_weight"
MODEL_PLAIN = "model_plain"
TRAIN_LOSS = "train_loss"
ACCURACY = "accuracy"
LOSS = "loss"
CORRECT = "correct"
QUERY = "query"
#: train config: the campaign round whose aggregate this message's global model is and that
#: the partner evaluates too (0 or absent: none)
EVALUATE_ROUND = "evaluate-round"
#: train reply: the MetricRecord of that evaluation
EVALUATION = "evaluation"
#: domain separation of :func:`reply_statement` (a partner key signs nothing else with it)
REPLY_DOMAIN = b"sealfl/partner-reply/v1\n"


def to_u8(blob: bytes) -> np.ndarray:
    """Bytes -> uint8 array (a copy Flower can own)."""
    return np.frombuffer(blob, dtype=np.uint8).copy()


def from_u8(arr: np.ndarray) -> bytes:
    """uint8 array -> bytes. Raises ValueError if ``arr`` is not a 1-D uint8 array."""
    arr = np.asarray(arr)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise ProtocolError(f"expected a 1-D uint8 array of ciphertext bytes, got {arr.dtype} {arr.shape}")
    return arr.tobytes()


def _lp(b: bytes) -> bytes:
    """Length-prefixed bytes: u64 big-endian length, then the bytes."""
    return struct.pack(">Q", len(b)) + b


def _value(v) -> bytes:
    """Canonical encoding of one record value (type tag + length-prefixed payload)."""
    if isinstance(v, bool):
        return b"?" + _lp(b"1" if v else b"0")
    if isinstance(v, int):
        return b"i" + _lp(str(v).encode())
    if isinstance(v, float):
        return b"f" + _lp(v.hex().encode())
    if isinstance(v, str):
        return b"s" + _lp(v.encode("utf-8", "surrogatepass"))
    if isinstance(v, bytes):
        return b"b" + _lp(v)
    if isinstance(v, (list, tuple)):
        return b"l" + struct.pack(">Q", len(v)) + b"".join(_value(x) for x in v)
    if all(hasattr(v, a) for a in ("dtype", "shape", "stype", "data")):  # flwr Array
        return b"a" + _lp(str(v.dtype).encode()) + _lp(repr(tuple(v.shape)).encode()) + _lp(str(v.stype).encode()) \
            + _lp(bytes(v.data))
    raise ProtocolError(f"cannot encode a {type(v).__name__} record value")


def content_digest(content) -> bytes:
    """SHA-256 (32 bytes) of a canonical encoding of a reply's ``RecordDict``, leaving out
    only ``content["partner"]["signature"]``.

    Records are visited by sorted name, each tagged with its kind (``array``/``metric``/
    ``config``), then their entries by sorted key; values as in :func:`_value` (floats by
    ``float.hex``, so NaN and -0.0 are distinct; Arrays by dtype, shape, stype and their
    serialised bytes). Works on any object with flwr 1.42's RecordDict interface.

    Raises TypeError for a record or value of an unknown kind.
    """
    h = hashlib.sha256()
    for rec_name in sorted(content.keys()):
        rec = content[rec_name]
        kind = type(rec).__name__
        h.update(_lp(rec_name.encode("utf-8", "surrogatepass")) + _lp(kind.encode()))
        for key in sorted(rec.keys()):
            if rec_name == PARTNER and key == SIGNATURE:
                continue
            h.update(_lp(key.encode("utf-8", "surrogatepass")) + _value(rec[key]))
    return h.digest()


def reply_statement(context_id: bytes, reply_to_message_id: str, message_type: str, partner: str,
                    digest: bytes) -> bytes:
    """The bytes a partner signs for one reply (see module docstring): :data:`REPLY_DOMAIN`
    followed by the length-prefixed context id (32 bytes), the id of the message the
    reply answers, the message type, the partner name and :func:`content_digest`."""
    return REPLY_DOMAIN + b"".join(_lp(x) for x in (
        bytes(context_id), reply_to_message_id.encode(), message_type.encode(), partner.encode("utf-8", "surrogatepass"),
        bytes(digest)))
