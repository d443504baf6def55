"""What a release reads from a finished campaign directory (``sealfl campaign run -o``):
which consortium ran it, its final checkpoint, and the settings the partners trained and
were aggregated under (training config, server optimizer, DP, the privacy spent, the test
rows each partner reported). Every reader checks what it reads and says what is wrong;
:mod:`sealfl.platform.release` builds the release from them.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from sealfl.he.errors import ServerOptError
from sealfl.he.server_opt import ServerOpt
from sealfl.platform.consortium import Consortium
from sealfl.platform.errors import ReleaseError
from sealfl.server.bookkeeping import CampaignDir
from sealfl.server.errors import CampaignDirError

log = logging.getLogger(__name__)


def check_campaign_of(cons: Consortium, campaign_dir: str | Path) -> None:
    """Refuse a campaign another consortium ran: its ``server_config.json`` names the HE
    context it aggregated under (``context_id``), which must be ``cons``'s.

    Raises:
        ReleaseError: the campaign's context is another consortium's (naming both), or its
            configuration is unreadable.
    """
    cd = CampaignDir(campaign_dir)
    if not cd.has_config():  # a campaign fabricated by tools/tests: nothing names its consortium
        return
    try:
        config = cd.read_config()
    except CampaignDirError as exc:
        raise ReleaseError(f"{exc}; give the directory 'sealfl campaign run -o' wrote") from exc
    ran_under = config.get("context_id")
    if isinstance(ran_under, str) and ran_under != cons.context_id:
        raise ReleaseError(f"campaign {campaign_dir} belongs to another consortium (HE context {ran_under[:16]}…), "
                           f"not {cons.name!r} in {cons.dir} (context {cons.context_id[:16]}…); build the release "
                           "with the consortium that ran the campaign")


def finished_checkpoint(campaign_dir: str | Path) -> dict:
    """The final checkpoint of a FINISHED campaign: ``{"model_ct", "model_weight",
    "stats_ct", "round"}``.

    Raises ReleaseError if the campaign is missing, did not finish, or its checkpoint is
    unreadable, corrupt, or not from its last round (a stale checkpoint of an earlier run).
    """
    cd = CampaignDir(campaign_dir)
    d = cd.dir
    try:
        status = cd.read_status()
        view = cd.view(status)  # as 'campaign status' sees it: a running campaign whose process is gone is dead
    except CampaignDirError as exc:
        raise ReleaseError(f"{exc}; give the directory 'sealfl campaign run -o' wrote") from exc
    if view.state != "finished":
        raise ReleaseError(f"campaign {d} is {view.state!r}, not finished"
                           f"{': ' + str(view.error) if view.error else ''}{'; ' + view.note if view.note else ''}"
                           "; nothing to release")
    try:
        ckpt = cd.read_checkpoint().to_dict()
    except CampaignDirError as exc:
        raise ReleaseError(f"campaign {d} has no readable checkpoint: {exc}") from exc
    if not (math.isfinite(ckpt["model_weight"]) and ckpt["model_weight"] >= 1):
        raise ReleaseError(f"checkpoint of {d} has total weight {ckpt['model_weight']} (a sample count >= 1 is "
                           "expected); the checkpoint is corrupt")
    if ckpt["round"] != status.get("num_rounds"):
        raise ReleaseError(f"checkpoint of {d} is from round {ckpt['round']}, the campaign ran "
                           f"{status.get('num_rounds')} rounds; not releasing a stale model")
    declared = status.get("stats_declared_n")
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        raise ReleaseError(f"status.json of {d} records no total of declared training rows (stats_declared_n="
                           f"{declared!r}); the key holder cannot check the statistics -- re-run the campaign")
    ckpt["stats_declared_n"] = declared
    return ckpt


def campaign_train_config(campaign_dir: str | Path) -> dict:
    """The training settings the campaign sent its partners (its ``server_config.json``),
    so the gate's partners tokenise their text as they did; {} if unreadable."""
    try:
        train = CampaignDir(campaign_dir).read_train_config()
    except CampaignDirError:
        return {}
    return {k: v for k, v in train.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}


def campaign_server_opt(campaign_dir: str | Path, *, missing_ok: bool = True) -> ServerOpt:
    """The server optimizer a campaign ran, from its ``server_config.json`` (FedAvg if the
    training settings name none, or -- with ``missing_ok`` -- if there is no such file: a
    campaign of another optimizer is then refused by the aggregate's length and settings
    tag, :mod:`sealfl.he.server_opt`). Unlike :func:`campaign_train_config` nothing is
    dropped: every ``server-*`` value goes to :meth:`ServerOpt.from_config` as written.

    Raises:
        ServerOptError: the file is unreadable (or missing, without ``missing_ok``), its
            ``train`` section is not an object, a ``server-*`` key is unknown, or a
            setting is bad.
    """
    from sealfl.he.server_opt import KEYS

    cd = CampaignDir(campaign_dir)
    path = cd.config_path
    if not cd.has_config():
        if not missing_ok:
            raise ServerOptError(f"cannot read the campaign's server optimizer: {path} is missing")
        log.warning("%s is missing: opening the aggregate as FedAvg's", path)
        return ServerOpt()
    try:
        train = cd.read_train_config()
    except CampaignDirError as exc:
        raise ServerOptError(f"cannot read the campaign's server optimizer: {exc}") from exc
    unknown = sorted(k for k in train if isinstance(k, str) and k.startswith("server-")
                     and k not in KEYS.values() and k != "server-round")
    if unknown:
        raise ServerOptError(f"{path}: unknown server optimizer settings {unknown}; known: {sorted(KEYS.values())}")
    return ServerOpt.from_config({k: v for k, v in train.items() if k in KEYS.values()})


def campaign_test_counts(campaign_dir: str | Path) -> dict[str, int]:
    """Partner -> test rows it reported in the campaign's last evaluated round
    (``rounds.jsonl`` ``per_partner``), for the gate's consistency check; {} if none."""
    for rec in reversed(CampaignDir(campaign_dir).rounds()):
        per = rec.get("per_partner")
        if isinstance(per, dict) and per:
            return {p: v["n"] for p, v in per.items()
                    if isinstance(v, dict) and isinstance(v.get("n"), int) and not isinstance(v.get("n"), bool)}
    return {}


def campaign_dp(campaign_dir: str | Path):
    """The campaign's DP settings (:class:`sealfl.he.dp.DPConfig`) from its server_config.json,
    or None without DP (or without a config). Raises ReleaseError for malformed ones."""
    from sealfl.he.dp import DPConfig
    from sealfl.he.errors import PrivacyError

    cd = CampaignDir(campaign_dir)
    if not cd.has_config():
        return None
    try:
        return DPConfig.from_config(cd.read_train_config())
    except (CampaignDirError, PrivacyError) as exc:
        raise ReleaseError(f"campaign {campaign_dir}: its DP settings are unreadable ({exc}); not releasing") from exc


def campaign_privacy(campaign_dir: str | Path) -> dict | None:
    """The ``privacy`` block (ε, δ, mechanism, accountant, ...) of the campaign's last round
    in ``rounds.jsonl``, or None for a campaign without DP: what the release metadata carries
    so a device or an auditor can read the guarantee of the model it runs."""
    for rec in reversed(CampaignDir(campaign_dir).rounds()):
        if isinstance(rec.get("privacy"), dict):
            return dict(rec["privacy"])
    return None
