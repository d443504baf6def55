"""The campaign report (``sealfl campaign report``): figures per round read from a
campaign directory (:mod:`.series`, pure), drawn as PNGs and one HTML page (:mod:`.render`)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["campaign_report"]


def campaign_report(campaign_dir: str | Path, out_dir: str | Path | None = None):
    """Write the report of the campaign in ``campaign_dir`` (running or finished) into
    ``out_dir`` (default ``campaign_dir/report``) and return the
    :class:`~sealfl.platform.report.render.Report` with its figures' :class:`Series` as
    ``(report, series)``.

    Raises:
        CampaignDirError: ``campaign_dir`` holds no campaign (no or a malformed ``status.json``).
        OSError: the output directory cannot be written.
    """
    from sealfl.platform.report.render import write_report
    from sealfl.platform.report.series import series_of
    from sealfl.server.bookkeeping import CampaignDir

    cd = CampaignDir(Path(campaign_dir))
    status = cd.read_status()
    s = series_of(cd.rounds())
    out = Path(out_dir) if out_dir is not None else cd.dir / "report"
    return write_report(f"campaign {cd.dir}", status, s, out), s
