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

from sealfl.common.fields import Fields
from sealfl.server.errors import CampaignDirError

STATUS = "status.json"
ROUNDS = "rounds.jsonl"
CHECKPOINT = "checkpoint/global.npz"
CONFIG = "server_config.json"
LOG = "worker.log"
STATES = ("starting", "running", "finished", "failed", "interrupted")
ACTIVE = ("starting", "running")
MAX_STATUS_BYTES = 1 << 20
_MAX_ROUND = 2**31 - 1
#: server_config.json carries the initial model (LoRA: 460,800 floats, ~10 MB of JSON)
MAX_CONFIG_BYTES = 256 << 20
_CKPT_ARRAYS = {"model_ct": (np.uint8, None), "model_weight": (np.float64, (1,)), "stats_ct": (np.uint8, None),
                "round": (np.int64, (1,)), "record": (np.uint8, None)}

__all__ = ["STATUS", "ROUNDS", "CHECKPOINT", "CONFIG", "LOG", "STATES", "ACTIVE", "MAX_STATUS_BYTES", "MAX_CONFIG_BYTES", "parse_config",
           "parse_status", "Checkpoint", "checkpoint_bytes", "parse_checkpoint", "parse_records",
           "CampaignView", "campaign_view", "ResumePlan", "resume_plan", "EPOCH", "fence_verdict"]


_PID_MAX = 2**62  # larger than any pid_max (2^22 on Linux): a cap on a hostile number, not a pid rule


def _optional(fields: Fields, doc: dict, key: str, kind: str, at: str = "", **options: Any) -> Any:
    """``doc[key]`` checked with ``kind`` unless it is absent or null."""
    value = doc.get(key)
    return None if value is None else getattr(fields, kind)(value, fields.join(at, key), **options)


def _check_identity(fields: Fields, v: Any, path: str) -> None:
    fields.object(v, path)
    fields.get(v, "pid", "integer", path, lo=1, hi=_PID_MAX)
    _optional(fields, v, "start", "integer", path, lo=0, hi=2**63 - 1)
    _optional(fields, v, "host", "string", path, nonempty=False, max_len=1024)


def _json(data: bytes, where: str, cap: int, what: str):
    if len(data) > cap:
        raise CampaignDirError(f"{where} is {len(data)} bytes (at most {cap}); it is not {what}")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CampaignDirError(f"{where} is not JSON ({exc})") from exc


def parse_config(data: bytes, where: str = CONFIG) -> dict:
    """Parse ``server_config.json`` bytes: a JSON object whose ``train`` (the settings sent
    to partners) is an object. Unknown fields are kept; the aggregator's
    :class:`~sealfl.server.app.ServerConfig` checks the rest.

    Raises:
        CampaignDirError: too large, not UTF-8 JSON, not an object, or no ``train`` object.
    """
    config = _json(data, where, MAX_CONFIG_BYTES, "a campaign configuration")
    fields = Fields(where, CampaignDirError)
    fields.object(config, "")
    fields.get(config, "train", "object", default={})
    return config


def parse_status(data: bytes, where: str = STATUS) -> dict:
    """Parse and type-check ``status.json`` bytes. Unknown fields are kept.

    Raises:
        CampaignDirError: not UTF-8 JSON, not an object, over 1 MiB, or a known field of
            the wrong type/value (the message names ``where`` and the field).
    """
    status = _json(data, where, MAX_STATUS_BYTES, "a status file")
    fields = Fields(where, CampaignDirError)
    fields.object(status, "")
    fields.get(status, "status", "choice", choices=STATES)
    fields.get(status, "round", "integer", default=0, lo=0, hi=_MAX_ROUND)
    _optional(fields, status, "num_rounds", "integer", lo=1, hi=_MAX_ROUND)
    _optional(fields, status, "error", "string", nonempty=False, max_len=MAX_STATUS_BYTES)
    for key in ("owner", "worker"):
        if status.get(key) is not None:
            _check_identity(fields, status[key], key)
    _optional(fields, status, "pid", "integer", lo=1, hi=_PID_MAX)
    _optional(fields, status, EPOCH, "integer", lo=0, hi=_MAX_ROUND)
    return status


#: ``status.json``'s run epoch: the fencing token of the run allowed to write the campaign
EPOCH = "epoch"


def fence_verdict(current_epoch: Any, writer_epoch: int) -> str | None:
    """May a run of epoch ``writer_epoch`` write the campaign directory whose
    ``status.json`` holds ``current_epoch``? None: yes; else why not (one sentence). Pure.

    The fencing token of Kleppmann's "How to do distributed locking" (2016) and of
    ZooKeeper's epochs: ``campaign run`` records epoch 1, every ``campaign resume`` the
    next one, and a run is given its epoch in ``server_config.json`` when it starts. A run
    still alive after a newer one took over (a ServerApp left on a SuperLink after its
    coordinator died) holds an older epoch and is refused every write -- round record,
    checkpoint, status. A directory written before epochs existed reads as epoch 0 (the
    run's configuration then says 0 too). A newer epoch than the directory's is refused
    as well: the directory was replaced (``--overwrite``) under the run.
    """
    current = 0 if current_epoch is None else current_epoch
    if isinstance(current, bool) or not isinstance(current, int) or current < 0:
        return f"status.json's {EPOCH} is {current_epoch!r}, not a run epoch; the directory was edited"
    if writer_epoch == current:
        return None
    if writer_epoch < current:
        return (f"this run has epoch {writer_epoch} but the campaign was taken over by run epoch {current} "
                "(campaign resume); this run's writes are refused and it stops")
    return (f"this run has epoch {writer_epoch} but the campaign directory records epoch {current} (replaced "
            "under the run); this run's writes are refused and it stops")


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
                f"is the last finished state; 'campaign resume' continues from it")
    elif state in ACTIVE and owner_alive is None and owner and owner.get("host"):
        note = f"running on host {owner['host']} (liveness not checked from here)"
    return CampaignView(state, rnd, status.get("num_rounds"), status.get("error"), note)


def parse_records(raw: bytes) -> list[dict]:
    """Records of ``rounds.jsonl`` bytes, oldest first; lines that are not JSON objects
    with an integer ``round`` (e.g. a partial last line) are skipped."""
    out = []
    fields = Fields(ROUNDS, CampaignDirError)
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
            fields.object(rec, "")
            fields.get(rec, "round", "integer", lo=0, hi=_MAX_ROUND)
        except (ValueError, RecursionError, CampaignDirError):
            continue
        out.append(rec)
    return out


@dataclass(frozen=True)
class ResumePlan:
    """What ``sealfl campaign resume`` would do with a campaign directory.

    Attributes:
        ok: True if it can resume.
        from_round: the last finished round (the checkpoint's; 0: none, it starts at round 1).
        num_rounds: rounds of the campaign.
        message: one sentence for people: "resume will continue from round k of N" or why not.
    """

    ok: bool
    from_round: int
    num_rounds: int | None
    message: str

    def to_dict(self) -> dict:
        return {"possible": self.ok, "from_round": self.from_round, "num_rounds": self.num_rounds,
                "message": self.message}


def resume_plan(view: CampaignView, checkpoint_error: str | None, *, owner_alive: bool | None,
                campaign_context_id: str | None = None, consortium_context_id: str | None = None) -> ResumePlan:
    """Decide whether a campaign can be resumed, and from where. Pure.

    Args:
        view: :func:`campaign_view` of the directory.
        checkpoint_error: why the checkpoint file that exists does not parse (None: it
            parses, or there is none).
        owner_alive: whether the recorded owner process lives (None: cannot tell).
        campaign_context_id: the HE context id in ``server_config.json``.
        consortium_context_id: the consortium's context id (None: not checked, e.g. in
            ``campaign status``).
    Refused: a finished campaign (or one whose checkpoint holds every round), one whose
    owner still runs or may run on another host, a damaged checkpoint, a campaign of
    another consortium.
    """
    n, k = view.num_rounds, view.round
    def no(why: str) -> ResumePlan:
        return ResumePlan(False, k, n, f"cannot resume: {why}")
    if view.state == "finished":
        return no(f"the campaign finished all {n} rounds")
    if view.state in ACTIVE and owner_alive is not False:
        where = "its owner process still runs" if owner_alive else "its owner may still run (on another host)"
        return no(f"the campaign is {view.state} and {where}; stop it first (Ctrl-C or SIGTERM)")
    if checkpoint_error is not None:
        return no(f"the checkpoint is damaged ({checkpoint_error}); start again with 'campaign run --overwrite'")
    if not isinstance(n, int) or n < 1:
        return no("status.json records no number of rounds")
    if k >= n:
        return no(f"the checkpoint already holds all {n} rounds")
    if consortium_context_id is not None and campaign_context_id != consortium_context_id:
        return no(f"the campaign belongs to another consortium (HE context {str(campaign_context_id)[:16]}..., the "
                  f"consortium's is {consortium_context_id[:16]}...); give the consortium that ran it")
    if k == 0:
        return ResumePlan(True, 0, n, f"resume will start again at round 1 of {n} (no round had finished)")
    return ResumePlan(True, k, n, f"resume will continue from round {k} of {n} (next: round {k + 1})")
