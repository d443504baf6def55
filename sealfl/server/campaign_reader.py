"""The reading side of a campaign directory: its file paths, ``status.json``,
``rounds.jsonl``, ``server_config.json`` and the committed checkpoint parsed back (the
pure parsers are in :mod:`sealfl.server.campaign_files`), what ``campaign status`` shows and
what ``campaign resume`` would do. :class:`~sealfl.server.bookkeeping.CampaignDir` adds the
writing side (preparing, fenced round commits, recovery) on top.
"""

from __future__ import annotations

import json
from pathlib import Path

from sealfl.common.fsutil import atomic_write
from sealfl.common.procs import identity_alive
from sealfl.server.campaign_files import (
    CHECKPOINT,
    CONFIG,
    LOG,
    MAX_CONFIG_BYTES,
    MAX_STATUS_BYTES,
    ROUNDS,
    STATUS,
    CampaignView,
    Checkpoint,
    ResumePlan,
    campaign_view,
    parse_checkpoint,
    parse_config,
    parse_records,
    parse_status,
    resume_plan,
)
from sealfl.server.errors import CampaignDirError

__all__ = ["CampaignReader"]


class CampaignReader:
    """One campaign directory, read (``self.dir``: its path). Every reader raises
    CampaignDirError for a missing or malformed file unless it says otherwise."""

    dir: Path

    @property
    def status_path(self) -> Path:
        return self.dir / STATUS

    @property
    def rounds_path(self) -> Path:
        return self.dir / ROUNDS

    @property
    def checkpoint_path(self) -> Path:
        return self.dir / CHECKPOINT

    @property
    def config_path(self) -> Path:
        return self.dir / CONFIG

    @property
    def log_path(self) -> Path:
        return self.dir / LOG

    # -- reading ------------------------------------------------------------------------

    def exists(self) -> bool:
        """True if the directory holds a campaign (a ``status.json``)."""
        return self.status_path.exists()

    def read_status(self) -> dict:
        """Parsed ``status.json``. Raises CampaignDirError (missing or malformed)."""
        try:
            with open(self.status_path, "rb") as fh:
                data = fh.read(MAX_STATUS_BYTES + 1)
        except OSError as exc:
            raise CampaignDirError(f"{self.dir} is not a campaign directory (no readable {STATUS}: "
                                   f"{exc.strerror or exc})") from exc
        return parse_status(data, str(self.status_path))

    def rounds(self) -> list[dict]:
        """Finished rounds from ``rounds.jsonl``, oldest first; lines that are not JSON
        objects with an integer ``round`` (e.g. a partial last line) are skipped."""
        try:
            return parse_records(self.rounds_path.read_bytes())
        except OSError:
            return []

    def has_config(self) -> bool:
        """True if the campaign's ``server_config.json`` exists."""
        return self.config_path.exists()

    def read_config(self) -> dict:
        """Parsed ``server_config.json`` (the aggregator's configuration; its ``train`` object
        is what partners were sent). Raises CampaignDirError (missing or malformed)."""
        try:
            with open(self.config_path, "rb") as fh:
                data = fh.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise CampaignDirError(f"campaign {self.dir} has no readable {CONFIG} ({exc.strerror or exc})") from exc
        return parse_config(data, str(self.config_path))

    def read_train_config(self) -> dict:
        """The ``train`` object of ``server_config.json`` ({} if it has none). Raises
        CampaignDirError (missing or malformed)."""
        return dict(self.read_config().get("train", {}))

    def write_config(self, config: dict) -> None:
        """Write ``server_config.json`` atomically (the coordinator, before the campaign)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.config_path, json.dumps(config, indent=2).encode(), 0o644)

    def read_checkpoint(self) -> Checkpoint:
        """The committed checkpoint. Raises CampaignDirError (missing or malformed)."""
        try:
            data = self.checkpoint_path.read_bytes()
        except OSError as exc:
            raise CampaignDirError(f"campaign {self.dir} has no checkpoint ({exc.strerror or exc})") from exc
        return parse_checkpoint(data, str(self.checkpoint_path))

    def checkpoint_round(self) -> int | None:
        """Round of the committed checkpoint; None if there is none or it is unreadable."""
        try:
            return self.read_checkpoint().round
        except CampaignDirError:
            return None

    def view(self, status: dict | None = None) -> CampaignView:
        """:func:`campaign_view` of this directory (``status``: its ``status.json`` if the
        caller has read it already). Raises CampaignDirError if ``status.json`` is missing
        or malformed."""
        status = self.read_status() if status is None else status
        owner = status.get("owner") or ({"pid": status["pid"]} if status.get("pid") else None)
        alive = identity_alive(owner) if owner else None
        return campaign_view(status, self.checkpoint_round(), alive)

    def plan_resume(self, consortium_context_id: str | None = None) -> ResumePlan:
        """:func:`~sealfl.server.campaign_files.resume_plan` of this directory (what
        ``campaign resume`` would do). Raises CampaignDirError if ``status.json`` is
        missing or malformed."""
        status = self.read_status()
        owner = status.get("owner") or ({"pid": status["pid"]} if status.get("pid") else None)
        alive = identity_alive(owner) if owner else None
        ck_error = None
        if self.checkpoint_path.exists():
            try:
                self.read_checkpoint()
            except CampaignDirError as exc:
                ck_error = str(exc)
        context_id = None
        if consortium_context_id is not None:
            try:
                context_id = self.read_config().get("context_id")
            except CampaignDirError as exc:
                return ResumePlan(False, 0, status.get("num_rounds"), f"cannot resume: {exc}")
        return resume_plan(self.view(status), ck_error, owner_alive=alive, campaign_context_id=context_id,
                           consortium_context_id=consortium_context_id)

    def temporaries(self) -> list[Path]:
        """Temporary files a killed writer may leave (``.<name>.<random>.tmp``)."""
        found = []
        for d in (self.dir, self.checkpoint_path.parent):
            if d.is_dir():
                found += [p for p in d.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
        return found
