"""Pure parsing and decisions over the campaign directory's files (no I/O).

``status.json`` and the checkpoint are read back by the coordinator, ``campaign status``
and ``release build``: every field is type-checked here before it is believed, and
:func:`campaign_view` decides what state a campaign is in. Formats: see
:mod:`sealfl.server.bookkeeping`.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CampaignDirError

STATUS = "status.json"
ROUNDS = "rounds.jsonl"
CHECKPOINT = "checkpoint/global.npz"
CONFIG = "server_config.json"
LOG = "worker.log"
STATES = ("starting", "running", "finished", "failed", "interrupted")
ACTIVE = ("starting", "running")
MAX_STATUS_BYTES = 1 << 20
_CKPT_ARRAYS = {"model_ct": (np.uint8, None), "model_weight": (np.float64, (1,)), "stats_ct": (np.uint8, None),
                "round": (np.int64, (1,)), "record": (np.uint8, None)}

__all__ = ["STATUS", "ROUNDS", "CHECKPOINT", "CONFIG", "LOG", "STATES", "ACTIVE", "MAX_STATUS_BYTES",
           "parse_status", "Checkpoint", "checkpoint_bytes", "parse_checkpoint", "parse_records",
           "CampaignView", "campaign_view"]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_identity(v: Any, where: str) -> None:
    if not isinstance(v, dict):
        raise CampaignDirError(f"{where} is not an object")
    if not (_is_int(v.get("pid")) and v["pid"] > 0):
        raise CampaignDirError(f"{where}.pid is not a positive integer")
    if v.get("start") is not None and not (_is_int(v["start"]) and v["start"] >= 0):
        raise CampaignDirError(f"{where}.start is not a non-negative integer")
    if v.get("host") is not None and not isinstance(v["host"], str):
        raise CampaignDirError(f"{where}.host is not a string")


def parse_status(data: bytes, where: str = STATUS) -> dict:
    """Parse and type-check ``status.json`` bytes. Unknown fields are kept.

    Raises:
        CampaignDirError: not UTF-8 JSON, not an object, over 1 MiB, or a known field of
            the wrong type/value (the message names ``where`` and the field).
    """
    if len(data) > MAX_STATUS_BYTES:
        raise CampaignDirError(f"{where} is {len(data)} bytes (at most {MAX_STATUS_BYTES}); it is not a status file")
    try:
        status = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CampaignDirError(f"{where} is not JSON ({exc})") from exc
    if not isinstance(status, dict):
        raise CampaignDirError(f"{where} is not a JSON object")
    if status.get("status") not in STATES:
        raise CampaignDirError(f"{where}: field 'status' is {status.get('status')!r}, expected one of {', '.join(STATES)}")
    if not (_is_int(status.get("round", 0)) and status.get("round", 0) >= 0):
        raise CampaignDirError(f"{where}: field 'round' is not a non-negative integer")
    nr = status.get("num_rounds")
    if nr is not None and not (_is_int(nr) and nr >= 1):
        raise CampaignDirError(f"{where}: field 'num_rounds' is not a positive integer")
    if status.get("error") is not None and not isinstance(status["error"], str):
        raise CampaignDirError(f"{where}: field 'error' is not a string")
    for key in ("owner", "worker"):
        if status.get(key) is not None:
            _check_identity(status[key], f"{where}: field '{key}'")
    if status.get("pid") is not None and not (_is_int(status["pid"]) and status["pid"] > 0):
        raise CampaignDirError(f"{where}: field 'pid' is not a positive integer")
    return status


@dataclass(frozen=True)
class Checkpoint:
    """The encrypted global state after round ``round`` (see module docstring)."""

    round: int
    model_ct: bytes
    model_weight: float
    stats_ct: bytes
    record: dict | None = None

    def to_dict(self) -> dict:
        """``{"model_ct", "model_weight", "stats_ct", "round"}`` (the pre-0.2 shape)."""
        return {"model_ct": self.model_ct, "model_weight": self.model_weight, "stats_ct": self.stats_ct,
                "round": self.round}


def checkpoint_bytes(ck: Checkpoint) -> bytes:
    """Serialise a checkpoint (uncompressed npz, no pickles)."""
    buf = io.BytesIO()
    arrays = dict(model_ct=np.frombuffer(ck.model_ct, np.uint8), model_weight=np.array([ck.model_weight], np.float64),
                  stats_ct=np.frombuffer(ck.stats_ct, np.uint8), round=np.array([ck.round], np.int64))
    if ck.record is not None:
        arrays["record"] = np.frombuffer(json.dumps(ck.record).encode(), np.uint8)
    np.savez(buf, **arrays)
    return buf.getvalue()


def parse_checkpoint(data: bytes, where: str = CHECKPOINT) -> Checkpoint:
    """Parse checkpoint bytes; every array's name, dtype and shape is checked.

    Members must be stored uncompressed (``np.savez``) and no larger than the file, so a
    crafted archive cannot expand in memory; pickled objects are refused.

    Raises:
        CampaignDirError: not an npz, an unexpected/missing member, a wrong dtype or
            shape, an empty ciphertext, a round < 1, a non-finite weight, or a record
            that is not a JSON object of the same round (message names the member).
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise CampaignDirError(f"{where} is not a checkpoint (not an npz archive: {exc})") from exc
    names = set()
    for info in infos:
        name = info.filename.removesuffix(".npy")
        if name not in _CKPT_ARRAYS:
            raise CampaignDirError(f"{where}: unexpected member {info.filename!r}")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
            raise CampaignDirError(f"{where}: member {info.filename!r} is compressed or larger than the file")
        names.add(name)
    missing = sorted(set(_CKPT_ARRAYS) - {"record"} - names)
    if missing:
        raise CampaignDirError(f"{where}: missing member(s) {', '.join(missing)}")
    arrays: dict[str, np.ndarray] = {}
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        for name in sorted(names):
            try:
                arrays[name] = z[name]
            except Exception as exc:  # numpy raises ValueError/OSError/EOFError/zipfile errors on bad members
                raise CampaignDirError(f"{where}: member {name!r} is unreadable ({type(exc).__name__}: {exc})") from exc
    for name, arr in arrays.items():
        dtype, shape = _CKPT_ARRAYS[name]
        if arr.dtype != dtype or (shape is not None and arr.shape != shape) or (shape is None and arr.ndim != 1):
            want = f"{np.dtype(dtype)} {shape or '(n,)'}"
            raise CampaignDirError(f"{where}: member {name!r} is {arr.dtype} {arr.shape}, expected {want}")
    rnd, weight = int(arrays["round"][0]), float(arrays["model_weight"][0])
    if rnd < 1:
        raise CampaignDirError(f"{where}: member 'round' is {rnd}; a checkpoint exists only after round 1")
    if not math.isfinite(weight):
        raise CampaignDirError(f"{where}: member 'model_weight' is {weight}, not a finite number")
    for name in ("model_ct", "stats_ct"):
        if arrays[name].size == 0:
            raise CampaignDirError(f"{where}: member {name!r} is empty")
    record = None
    if "record" in arrays:
        try:
            record = json.loads(arrays["record"].tobytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CampaignDirError(f"{where}: member 'record' is not JSON ({exc})") from exc
        if not isinstance(record, dict) or record.get("round") != rnd:
            raise CampaignDirError(f"{where}: member 'record' is not the record of round {rnd}")
    return Checkpoint(rnd, arrays["model_ct"].tobytes(), weight, arrays["stats_ct"].tobytes(), record)


@dataclass(frozen=True)
class CampaignView:
    """What a coordinator should believe about a campaign directory.

    Attributes:
        state: ``status.json``'s status, or ``"dead"`` when it says starting/running but
            the process that ran it is gone.
        round: the last finished round = the checkpoint's round (0: none finished).
        num_rounds: rounds asked for (None if unknown).
        error: the recorded error, if any.
        note: one sentence for people (why dead, what to do).
    """

    state: str
    round: int
    num_rounds: int | None
    error: str | None
    note: str = ""


def campaign_view(status: dict, checkpoint_round: int | None, owner_alive: bool | None) -> CampaignView:
    """Decide the state of a campaign from its parsed status, its checkpoint's round and
    whether its owner process lives (None: cannot tell, e.g. another host). Pure."""
    state = status["status"]
    rnd = checkpoint_round or 0
    owner = status.get("owner") or ({"pid": status["pid"]} if status.get("pid") else None)
    note = ""
    if state in ACTIVE and owner_alive is False:
        pid = owner.get("pid") if owner else "?"
        state = "dead"
        note = (f"stopped unexpectedly: the process that ran it (pid {pid}) is gone; the checkpoint of round {rnd} "
                "is the last finished state; start again with 'campaign run --overwrite'")
    elif state in ACTIVE and owner_alive is None and owner and owner.get("host"):
        note = f"running on host {owner['host']} (liveness not checked from here)"
    return CampaignView(state, rnd, status.get("num_rounds"), status.get("error"), note)


def parse_records(raw: bytes) -> list[dict]:
    """Records of ``rounds.jsonl`` bytes, oldest first; lines that are not JSON objects
    with an integer ``round`` (e.g. a partial last line) are skipped."""
    out = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict) and _is_int(rec.get("round")):
            out.append(rec)
    return out
