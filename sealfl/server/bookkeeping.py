"""The campaign directory. :class:`CampaignDir` is the only code that reads or writes it.

Layout::

    status.json            {"status", "round", "num_rounds", "error", "owner", "worker", "ray", ...}
    rounds.jsonl           one JSON object per finished round (train + evaluate results, and
                           ``aggregate_sha256``: SHA-256 of the round's encrypted aggregate frame,
                           ``model_ct`` in the checkpoint -- public, what release provenance cites)
    checkpoint/global.npz  the encrypted global state after the last finished round
    server_config.json     the aggregator's configuration (written by the coordinator)
    worker.log             stderr of the process that ran Flower and Ray

``status`` is ``starting`` (coordinator prepared the directory), ``running``,
``finished``, ``failed`` or ``interrupted``. ``owner`` / ``worker`` are
``{"pid", "start", "host"}`` of the coordinator process and of the process running the
aggregator (see :func:`sealfl.common.procs.identity`); a ``running`` campaign whose
owner is gone is reported as dead by :func:`campaign_view`. That is the liveness rule:
a file cannot rewrite itself after a ``kill -9``, so a reader decides from ``owner``
(the process with that pid must have that start time on that host) -- ``sealfl campaign
status DIR --json`` prints the resulting ``state`` for scripts. ``started``, ``finished``
and ``updated`` (the last write) are epoch seconds, each with an ISO 8601 UTC twin
(``started_iso``, ...).

**Fencing.** ``epoch`` in ``status.json`` is the run allowed to write: :meth:`CampaignDir.prepare`
records the directory's previous epoch + 1, :meth:`CampaignDir.reopen` (``campaign
resume``) the next one, and the aggregator is given its epoch in ``server_config.json``.
Every aggregator write (:meth:`~CampaignDir.begin`, :meth:`~CampaignDir.set_status`,
:meth:`~CampaignDir.end_round`) takes an exclusive ``flock`` on the directory, reads the
epoch and writes only if :func:`~sealfl.server.campaign_files.fence_verdict` allows it;
else it raises :class:`~sealfl.server.errors.StaleRunError` and writes nothing. ``reopen``
raises the epoch under the same lock, so once it returns no older run writes here again,
even one still alive on a SuperLink. The keys other processes own (``owner``,
``deployment``, ``ray``, ``resumed``, ``epoch``) are taken from the file at each aggregator
write, so the aggregator's copy of the status never overwrites them.

Checkpoint (``np.savez``, uncompressed): ``model_ct`` uint8 (frame), ``model_weight``
float64 (1,), ``stats_ct`` uint8 (frame), ``round`` int64 (1,), ``record`` uint8 (the
round's JSON record, UTF-8).

**Commit protocol.** A round ends in :meth:`CampaignDir.end_round`, in this order:

1. the checkpoint, with the round's record inside, is written to a temporary file,
   fsynced and renamed onto ``checkpoint/global.npz`` -- THE commit point of the round;
2. the record is appended to ``rounds.jsonl`` (fsynced);
3. ``status.json`` is rewritten atomically with the new round.

A process killed at any instant leaves the previous checkpoint or the new one, never a
mix; the last finished round is the checkpoint's. :meth:`CampaignDir.recover` (run only
when no writer is alive) brings ``rounds.jsonl`` and ``status.json`` level with it:
it drops a partial last line, appends the record a kill between steps 1 and 2 lost,
and deletes temporary files. Nothing here is secret: the aggregator only holds
ciphertexts.

Parsing every file back and deciding a campaign's state are pure functions in
:mod:`sealfl.server.campaign_files`; this module does the I/O around them.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from sealfl.common.fsutil import atomic_write
from sealfl.common.procs import identity
from sealfl.common.testpoints import testpoint
from sealfl.server.campaign_coordinator import CoordinatorSide
from sealfl.server.campaign_files import (
    EPOCH,
    STATES,
    CampaignView,
    Checkpoint,
    campaign_view,
    checkpoint_bytes,
    fence_verdict,
    parse_checkpoint,
    parse_status,
)
from sealfl.server.campaign_reader import CampaignReader
from sealfl.server.errors import CampaignDirError, StaleRunError

log = logging.getLogger(__name__)

__all__ = ["CampaignDir", "Checkpoint", "CampaignView", "parse_status", "parse_checkpoint",
           "campaign_view", "save_checkpoint", "load_checkpoint", "STATES"]


# -- the directory -------------------------------------------------------------------------

#: ``status.json`` keys written by processes other than the aggregator (coordinator, worker)
_OUTSIDE_KEYS = ("owner", "deployment", "ray", "resumed", EPOCH)

#: the epoch-second fields of ``status.json`` that get an ``<field>_iso`` twin
_EPOCH_FIELDS = ("started", "finished", "updated")


def iso8601(epoch: float) -> str:
    """``epoch`` seconds as ISO 8601 in UTC with milliseconds, e.g. ``2026-12-02T05:51:20.123+00:00``."""
    return datetime.datetime.fromtimestamp(float(epoch), datetime.timezone.utc).isoformat(timespec="milliseconds")


class CampaignDir(CoordinatorSide, CampaignReader):
    """Owner of one campaign directory (see module docstring).

    Coordinator side (:class:`~sealfl.server.campaign_coordinator.CoordinatorSide`):
    :meth:`prepare`, :meth:`view`, :meth:`recover`, :meth:`reopen`, :meth:`mark_interrupted`
    (which fences the stopped run out), :meth:`mark_complete`, :meth:`mark_failed` -- the last
    three only once the run was stopped. Aggregator side (here): :meth:`begin`,
    :meth:`set_status`, :meth:`note`, :meth:`stage_checkpoint`, :meth:`end_round`.

    Args:
        path: the campaign directory.
        num_rounds: rounds of the campaign (aggregator side).
        epoch: the aggregator's run epoch (``server_config.json``'s ``epoch``): its writes are
            fenced (module docstring). None: not fenced (the coordinator's side).
    """

    def __init__(self, path: str | os.PathLike, num_rounds: int | None = None, epoch: int | None = None):
        self.dir = Path(path)
        self.num_rounds = num_rounds
        self.epoch = epoch
        self.status: dict[str, Any] = {"status": "running", "round": 0, "num_rounds": num_rounds, "error": None}
        self.current: dict[str, Any] = {}
        self._staged: Checkpoint | None = None

    # -- aggregator side ----------------------------------------------------------------

    def begin(self, resumed_from: int = 0) -> None:
        """Start recording a run: keep what the coordinator wrote (owner, Ray), set
        ``running`` with this process as the worker (and as owner if there is none);
        ``resumed_from``: the round a resumed campaign continues after (0: a new one).

        Raises:
            StaleRunError: the directory's epoch is not this run's (nothing is written).
        """
        with self._fenced():
            try:
                self.status = self.read_status()
            except CampaignDirError:
                self.status = {}
            me = identity()
            self.status.update(status="running", round=resumed_from, num_rounds=self.num_rounds, error=None, worker=me,
                               server_has_secret_key=None)
            self.status.setdefault("owner", me)
            self.status.setdefault("started", time.time())
            self._write_status()

    def amend_status(self, **kw: Any) -> None:
        """Read ``status.json``, update ``kw`` and rewrite it (a writer other than the
        aggregator, e.g. the worker recording which Ray it runs on). Raises CampaignDirError."""
        with self._locked():
            self.status = self.read_status()
            self.status.update(kw)
            self._write_status()

    def set_status(self, **kw: Any) -> None:
        """Update and atomically rewrite ``status.json``.

        Raises:
            StaleRunError: fenced out (aggregator side, see the module docstring); nothing is written.
        """
        with self._fenced():
            self.status.update(kw)
            self._write_status()

    def note(self, **kw: Any) -> None:
        """Add fields to the record of the round in progress."""
        self.current.update(kw)

    def stage_checkpoint(self, server_round: int, model_ct: bytes, model_weight: float, stats_ct: bytes) -> None:
        """Hold the round's aggregate until :meth:`end_round` commits it with the record."""
        self._staged = Checkpoint(server_round, bytes(model_ct), float(model_weight), bytes(stats_ct))

    def end_round(self, server_round: int) -> None:
        """Commit the round (checkpoint, then ``rounds.jsonl``, then ``status.json``).

        Raises:
            CampaignDirError: no aggregate was staged for ``server_round``.
            StaleRunError: fenced out (module docstring); nothing of the round is written.
        """
        staged = self._staged
        if staged is None or staged.round != server_round:
            raise CampaignDirError(f"round {server_round} ends without a staged aggregate; nothing to commit")
        rec = {"round": server_round, **self.current,
               "aggregate_sha256": hashlib.sha256(staged.model_ct).hexdigest()}
        with self._fenced():  # the whole commit under one lock: a resume waits for it, or fences it out
            self._commit_checkpoint(Checkpoint(staged.round, staged.model_ct, staged.model_weight, staged.stats_ct,
                                               rec))
            line = (json.dumps(rec) + "\n").encode()
            fd = os.open(self.rounds_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.current, self._staged = {}, None
            self.status["round"] = server_round
            self._write_status()

    # -- writing ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self):
        """Hold an exclusive ``flock`` on the campaign directory (not re-entrant: the
        public writers take it once, the private helpers never)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    @contextlib.contextmanager
    def _fenced(self):
        """:meth:`_locked`, and for an aggregator (``epoch`` set): refuse unless the
        directory's epoch is this run's, and take the keys other processes own from the file."""
        with self._locked():
            if self.epoch is not None:
                try:
                    disk = self.read_status() if self.status_path.exists() else {}
                except CampaignDirError as exc:
                    raise StaleRunError(f"{self.dir}: {exc}; this run's writes are refused") from exc
                why = fence_verdict(disk.get(EPOCH), self.epoch)
                if why is not None:
                    log.error("%s: %s", self.dir, why)
                    raise StaleRunError(f"{self.dir}: {why}")
                for key in _OUTSIDE_KEYS:
                    if key in disk:
                        self.status[key] = disk[key]
            yield

    def _write_status(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.status["updated"] = time.time()
        for key in _EPOCH_FIELDS:  # ISO 8601 (UTC) beside each epoch time, for people and scripts
            if isinstance(self.status.get(key), (int, float)):
                self.status[f"{key}_iso"] = iso8601(self.status[key])
        atomic_write(self.status_path, json.dumps(self.status, indent=2).encode(), 0o644)

    def _commit_checkpoint(self, ck: Checkpoint) -> None:
        path = self.checkpoint_path
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, checkpoint_bytes(ck), 0o644, before_rename=lambda: testpoint("checkpoint", ck.round))


def save_checkpoint(campaign_dir: str | Path, server_round: int, model_ct: bytes, model_weight: float,
                    stats_ct: bytes, record: dict | None = None) -> Path:
    """Commit a checkpoint directly (tools and tests that fabricate a campaign). Returns its path."""
    cd = CampaignDir(campaign_dir)
    cd._commit_checkpoint(Checkpoint(server_round, bytes(model_ct), float(model_weight), bytes(stats_ct),
                                     record if record is not None else {"round": server_round}))
    return cd.checkpoint_path


def load_checkpoint(campaign_dir: str | Path) -> dict:
    """The committed checkpoint as ``{"model_ct": bytes, "model_weight": float,
    "stats_ct": bytes, "round": int}``. Raises CampaignDirError (missing or malformed)."""
    return CampaignDir(campaign_dir).read_checkpoint().to_dict()
