"""The coordinator's half of :class:`sealfl.server.bookkeeping.CampaignDir`: preparing a
campaign directory, levelling it after its writer died, reopening it for a resume, and
recording how a stopped run ended. These run in the coordinator's process (``campaign run``,
``campaign resume``), never in the aggregator's; the directory layout, the commit protocol and
the fencing they keep are described in :mod:`sealfl.server.bookkeeping`.

:class:`CoordinatorSide` is a mixin: it uses the directory's paths and readers
(:class:`~sealfl.server.campaign_reader.CampaignReader`) and its lock and status writer
(``_locked``, ``_write_status``, defined by ``CampaignDir``).
"""

from __future__ import annotations

import json
import logging
import signal
import time
from typing import Any

from sealfl.common.fsutil import atomic_write
from sealfl.common.procs import identity_alive
from sealfl.server.campaign_files import (
    ACTIVE,
    CHECKPOINT,
    CONFIG,
    EPOCH,
    LOG,
    ROUNDS,
    STATUS,
    Checkpoint,
    parse_records,
)
from sealfl.server.errors import CampaignDirError

log = logging.getLogger(__name__)

__all__ = ["CoordinatorSide"]

#: what a campaign directory may hold (a directory holding anything else is not taken for one)
_CAMPAIGN_NAMES = {STATUS, ROUNDS, CONFIG, LOG, CHECKPOINT.split("/")[0], "report"}


class CoordinatorSide:
    """The coordinator's operations on a campaign directory (module docstring)."""

    status: dict[str, Any]
    num_rounds: int | None

    def prepare(self, num_rounds: int, *, overwrite: bool, owner: dict) -> None:
        """Make the directory ready for a new campaign and record ``starting`` with
        ``owner`` (the coordinator process's identity).

        Raises:
            CampaignDirError: the path is a file; it holds files that are not a campaign's
                (a release, a consortium, ...); it holds a campaign and ``overwrite`` is
                false; or it holds a campaign whose owner still runs (even with overwrite).
        """
        if self.dir.exists() and not self.dir.is_dir():
            raise CampaignDirError(f"{self.dir} is a file; give a directory for the campaign")
        if self.dir.is_dir() and not self.exists():
            foreign = sorted(p.name for p in self.dir.iterdir() if p.name not in _CAMPAIGN_NAMES
                             and not (p.name.startswith(".") and p.name.endswith(".tmp")))
            if foreign:
                what = ("a release" if "manifest.json" in foreign else "a consortium" if "consortium.json" in foreign
                        else "a device's state" if "state.json" in foreign else "files that are not a campaign's")
                raise CampaignDirError(f"{self.dir} holds {what} ({', '.join(foreign[:5])}"
                                       f"{', ...' if len(foreign) > 5 else ''}); a campaign writes into a new or "
                                       "empty directory: choose another --out")
        old: dict = {}
        if self.exists():
            try:
                old = self.read_status()
            except CampaignDirError:
                old = {}
            owner = old.get("owner") or ({"pid": old["pid"]} if old.get("pid") else None)
            if old.get("status") in ACTIVE and owner and identity_alive(owner) is True:
                raise CampaignDirError(f"{self.dir} holds a campaign that is still {old['status']} (process "
                                       f"{owner['pid']}); stop it first ('campaign status' shows it)")
            if not overwrite:
                raise CampaignDirError(f"{self.dir} already holds a campaign (a release may have been built from it); "
                                       "choose a new --out or pass --overwrite")
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in [self.rounds_path, self.checkpoint_path, self.status_path, self.log_path, *self.temporaries()]:
            p.unlink(missing_ok=True)
        self.num_rounds = num_rounds
        epoch = old.get(EPOCH) if isinstance(old.get(EPOCH), int) else 0
        self.status = {"status": "starting", "round": 0, "num_rounds": num_rounds, "error": None, "owner": owner,
                       "started": time.time(), EPOCH: epoch + 1}
        with self._locked():
            self._write_status()

    def recover(self) -> int:
        """After the writer died: delete temporaries, drop a partial last line of
        ``rounds.jsonl``, append the record of a committed round it lacks, and set the
        status's round to the checkpoint's. Returns the last finished round.

        Call only when no process writes here (the supervisor calls it after the whole
        worker process tree is gone)."""
        for tmp in self.temporaries():
            tmp.unlink(missing_ok=True)
        try:
            ck: Checkpoint | None = self.read_checkpoint()
        except CampaignDirError as exc:
            if self.checkpoint_path.exists():
                log.warning("recovering %s: %s", self.dir, exc)
            ck = None
        committed = ck.round if ck else 0
        try:
            raw = self.rounds_path.read_bytes()
        except FileNotFoundError:
            raw = b""
        keep = raw[: raw.rfind(b"\n") + 1]  # a kill during the append leaves a partial last line
        last = max((r["round"] for r in parse_records(keep)), default=0)
        if ck is not None and ck.record is not None and ck.round > last:
            keep += (json.dumps(ck.record) + "\n").encode()
        if keep != raw:
            atomic_write(self.rounds_path, keep, 0o644)
        try:
            self.status = self.read_status()
        except CampaignDirError:
            self.status = {"status": "running", "num_rounds": self.num_rounds, "error": None}
        self.status["round"] = committed
        self._write_status()
        return committed

    def reopen(self, owner: dict) -> int:
        """Make a stopped campaign ready to resume (coordinator, after
        :meth:`plan_resume` allowed it and while no process writes here): :meth:`recover`,
        then ``starting`` with ``owner``, the error cleared, the next run epoch (``epoch`` + 1:
        every run of an older epoch is fenced out from here on, see the module docstring)
        and ``resumed`` (a list of ``{"at", "from_round", "previous_status", "epoch"}``)
        extended. Returns the last finished round; :attr:`status` holds the new epoch."""
        with self._locked():
            rnd = self.recover()
            prev = self.status.get("status")
            resumed = self.status.get("resumed") if isinstance(self.status.get("resumed"), list) else []
            for key in ("worker", "finished", "finished_iso", "stopped"):
                self.status.pop(key, None)
            self.num_rounds = self.status.get("num_rounds")
            epoch = (self.status.get(EPOCH) if isinstance(self.status.get(EPOCH), int) else 0) + 1
            self.status.update(status="starting", error=None, owner=owner, round=rnd, **{EPOCH: epoch},
                               resumed=[*resumed, {"at": time.time(), "from_round": rnd, "previous_status": prev,
                                                   EPOCH: epoch}])
            self._write_status()
        return rnd

    def mark_interrupted(self, signum: int) -> dict:
        """Record that a signal stopped the campaign (coordinator side): under the directory's
        lock, level it with its last committed round (:meth:`recover`), raise the run epoch
        (the stopped run's aggregator, should it still be alive -- a ServerApp on a SuperLink
        ends some time after ``flwr stop`` -- is fenced out: it cannot overwrite this record
        with its own "failed") and set ``interrupted``. Returns the status written."""
        with self._locked():
            self.recover()
            rnd = int(self.status.get("round", 0))
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = "a signal"
            after = (f"after round {rnd}; the checkpoint of round {rnd} is intact" if rnd
                     else "before the first round finished; there is no checkpoint")
            epoch = (self.status.get(EPOCH) if isinstance(self.status.get(EPOCH), int) else 0) + 1
            self.status.update(status="interrupted", error=f"stopped by {name} (signal {signum}) {after}",
                               stopped=time.time(), **{EPOCH: epoch})
            self._write_status()
        return self.status

    def mark_abandoned(self, error: str) -> dict:
        """Record that the coordinator stopped following a run it could not reach (a
        deployed campaign whose SuperLink stopped answering): under the directory's lock,
        level it with its last committed round (:meth:`recover`), raise the run epoch (the
        run, should its SuperLink come back, is fenced out) and set ``failed`` with
        ``error`` -- ``campaign resume`` continues it. Returns the status written."""
        with self._locked():
            self.recover()
            epoch = (self.status.get(EPOCH) if isinstance(self.status.get(EPOCH), int) else 0) + 1
            self.status.update(status="failed", error=error, stopped=time.time(), **{EPOCH: epoch})
            self._write_status()
        return self.status

    def mark_complete(self, note: str) -> dict:
        """Record as ``finished`` a campaign whose checkpoint already holds its last round
        (coordinator side, after :meth:`reopen`: a stopped run committed it before it ended,
        but never wrote ``finished``); ``note`` says so in the status. Returns the status.

        Raises:
            CampaignDirError: the checkpoint does not hold the campaign's last round.
        """
        with self._locked():
            rnd = self.recover()
            total = self.status.get("num_rounds")
            if not isinstance(total, int) or rnd < total:
                raise CampaignDirError(f"{self.dir}: the checkpoint holds round {rnd} of {total}; not complete")
            self.status.update(status="finished", finished=time.time(), error=None, note=note)
            self._write_status()
        return self.status

    def mark_failed(self, error: str) -> dict:
        """Record a failure the aggregator could not record itself (after :meth:`recover`);
        keeps an error the aggregator did record."""
        if self.status.get("status") in ACTIVE:
            self.status.update(status="failed", error=error, stopped=time.time())
            self._write_status()
        return self.status

    # -- aggregator side ----------------------------------------------------------------
