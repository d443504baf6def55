"""The key holder's side of the aggregator's ``"global"`` record: check, decrypt, bound and
round what a partner trains from and evaluates (:func:`decode_global_state`), with a small
per-process cache of recent decodings.

Used by the partner's ClientApp (:mod:`sealfl.clients.app`) for every ``train``,
``evaluate`` and release-gate query; the checks themselves are
:mod:`sealfl.he.decrypted` (bounds, grids, weights) and :mod:`sealfl.he.dp` (the DP
partner count).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict

import numpy as np
from flwr.app import ArrayRecord

from sealfl.clients.kit import PartnerKit
from sealfl.clients.plugins import get_task
from sealfl.common import protocol as P
from sealfl.he.decrypted import check_params, check_weight, open_model, open_stats, share_to_sum, upload_clip
from sealfl.he.dp import DPConfig, open_counted
from sealfl.he.errors import CiphertextError
from sealfl.he.framed import WIDE
from sealfl.he.server_opt import ServerOpt

log = logging.getLogger(__name__)


def task_of(kit: PartnerKit):
    """The consortium's task (the kit records it; :mod:`sealfl.clients.plugins`)."""
    return get_task(kit.task)


def global_int(record: ArrayRecord, key: str) -> int:
    """The int64 (1,) field ``key`` of the global record (``stats-n``: the total rows the
    partners declared). Raises CiphertextError if it is missing or of another dtype/shape."""
    try:
        arr = record[key].numpy()
    except Exception as exc:  # missing key, unreadable array
        raise CiphertextError(f"the global record has no readable {key!r}: {exc}") from exc
    if arr.dtype != np.int64 or arr.shape != (1,):
        raise CiphertextError(f"global {key!r} must be int64 (1,), got {arr.dtype} {arr.shape}")
    return int(arr[0])


#: the last few decoded global records of this process: digest -> (params, mean, std, state)
_DECODED: "OrderedDict[bytes, tuple]" = OrderedDict()
_DECODED_MAX = 2


def _record_digest(record: ArrayRecord, kit: PartnerKit, task, opt: ServerOpt) -> bytes:
    h = hashlib.sha256(b"sealfl-global\0" + kit.codec.context_id + task.name.encode() + b"\0"
                       + json.dumps(opt.to_config(), sort_keys=True).encode() + b"\0")
    for key in sorted(record.keys()):
        # the array's serialised bytes (what ``.numpy()`` deserialises, deterministically),
        # hashed as they are: deserialising every array just to hash it cost more than the hash
        arr = record[key]
        data = bytes(arr.data)
        h.update(f"{key}|{arr.stype}|{arr.dtype}|{tuple(arr.shape)}|{len(data)}|".encode())
        h.update(data)
    return h.digest()


def decode_global(record: ArrayRecord, kit: PartnerKit, task=None, opt: ServerOpt | None = None,
                  dp: DPConfig | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Turn the server's ``"global"`` record into (params (P,), mean (d,), std (d,)), all float64
    (:func:`decode_global_state` without the optimizer state)."""
    return decode_global_state(record, kit, task, opt, dp)[:3]


def decode_global_state(record: ArrayRecord, kit: PartnerKit, task=None, opt: ServerOpt | None = None,
                        dp: DPConfig | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Turn the server's ``"global"`` record into (params (P,), mean (d,), std (d,), state
    (S,)), all float64: ``state`` is what the partner uploads beside its local model
    (``opt.wire_length(P) - P`` values, :class:`sealfl.he.server_opt.ServerOpt`; empty
    for FedAvg, the default ``opt``).

    The same global record may reach a partner more than once (a round the server
    optimizer or DP skipped, the release gate's query) and, in simulation, several partners share a process: the
    last :data:`_DECODED_MAX` successful decodings are kept per process, keyed by the
    SHA-256 of the context, the task, the optimizer and every array of the record (a
    decoding depends on nothing else). Failures are not kept: a bad record is refused
    every time.

    Key-holder side of FedAvg: decrypt, check against ``task.decrypt_bounds`` and round
    (:func:`sealfl.he.decrypted.open_stats` / ``open_model``); the decrypted
    statistics count must equal ``stats_n`` (the total the partners declared) and the
    model weight must be a whole number of rows no larger than it. With a server optimizer
    the decrypted mean holds the optimizer's state too, and its step gives the parameters.
    With DP (``dp``) the aggregate carries the partner count after the model
    (:func:`sealfl.he.dp.open_counted`): fewer than ``dp.min_partners`` is refused.

    Raises:
        CiphertextError: a ciphertext or field is missing or does not decrypt under this kit.
        DecryptedValueError: a decrypted value is out of bounds (nothing is trained or
            reported from it).
        TooLittleNoiseError: a DP aggregate of fewer than ``dp.min_partners`` partners.
    """
    task = task or task_of(kit)
    opt = opt or ServerOpt()
    try:
        key = _record_digest(record, kit, task, opt) + (b"dp" + json.dumps(dp.to_config(), sort_keys=True).encode()
                                                         if dp else b"")
    except Exception as exc:  # an unreadable array: let the checks below name it
        key = None
        log.debug("global record not hashable (%s); decoding without the cache", exc)
    if key is not None and key in _DECODED:
        _DECODED.move_to_end(key)
        return tuple(a.copy() for a in _DECODED[key])
    out = _decode_global(record, kit, task, opt, dp)
    if key is not None:
        _DECODED[key] = tuple(a.copy() for a in out)
        while len(_DECODED) > _DECODED_MAX:
            _DECODED.popitem(last=False)
    return out


def _decode_global(record: ArrayRecord, kit: PartnerKit, task, opt: ServerOpt, dp: DPConfig | None = None
                   ) -> tuple[np.ndarray, ...]:
    bounds = task.decrypt_bounds
    stats_n = global_int(record, P.STATS_N)
    try:
        stats_blob = P.from_u8(record[P.STATS_CT].numpy())
    except Exception as exc:
        raise CiphertextError(f"the global record has no readable {P.STATS_CT!r}: {exc}") from exc
    mean, std = open_stats(kit.codec.decrypt(stats_blob, task.stats_length, WIDE), stats_n, bounds)
    if P.MODEL_PLAIN in record:  # round 1: the public initial model
        params = np.asarray(record[P.MODEL_PLAIN].numpy(), dtype=np.float64)
        if params.shape != (task.n_params,) or not np.all(np.isfinite(params)) \
                or np.any(np.abs(params) > bounds.param_abs_max):
            raise CiphertextError(f"the initial model must be {task.n_params} finite values within "
                                  f"±{bounds.param_abs_max:g}, got shape {params.shape}")
        state = opt.initial_state(params)
    else:
        try:
            weight = float(record[P.MODEL_WEIGHT].numpy()[0])
            model_blob = P.from_u8(record[P.MODEL_CT].numpy())
        except Exception as exc:
            raise CiphertextError(f"the global record has no readable model ciphertext/weight: {exc}") from exc
        check_weight(weight, stats_n)
        wire = opt.wire_length(task.n_params)
        if dp is None:
            decrypted = kit.codec.decrypt(model_blob, wire)
        else:  # refused below k partners: too little noise (TooLittleNoiseError)
            decrypted, count = open_counted(kit.codec.decrypt(model_blob, wire + 1), dp.min_partners)
            log.info("DP aggregate of %d partners (k=%d)", count, dp.min_partners)
        opened = open_model(share_to_sum(decrypted, stats_n, kit.codec.WEIGHTING), weight, bounds, max_total=stats_n)
        params, state = opt.step(opened, task.n_params, bounds.param_grid_bits,
                                 clip=upload_clip(kit.codec.WEIGHTING, kit.codec.params.update_layout),
                                 abs_max=bounds.param_abs_max)
        check_params(params, bounds)
    return params, mean, std, state
