"""Exception hierarchy for :mod:`sealfl.server`."""

from sealfl.common.errors import SealflError


class ServerError(SealflError):
    """An aggregator-side step failed."""


class NotEnoughPartnersError(ServerError):
    """Fewer valid partner replies than ``min_partners``: the round cannot be aggregated."""


class SecretKeyPresentError(ServerError):
    """The aggregator was handed a HE context that holds a secret key: refuse to run."""


class ReplyError(ServerError):
    """A partner's reply failed a check; the reply does not count.

    Attributes:
        field: what failed (e.g. ``"metrics.num-examples"``, ``"update.update_ct"``,
            ``"partner.signature"``).
        reason: why, in words (the message is ``"<field>: <reason>"``).
    """

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class ReplyStreamError(ServerError, ValueError):
    """A reply stream was given an impossible timeout or pull interval, or iterated twice
    (:mod:`sealfl.server.streaming`)."""


class CampaignDirError(ServerError):
    """A file of the campaign directory (``status.json``, ``rounds.jsonl``, the checkpoint)
    is missing, malformed or inconsistent; the message names the file and the field."""


class StaleRunError(CampaignDirError):
    """A run of the campaign tried to write after a newer run took the campaign over
    (``campaign resume`` raised the directory's epoch): nothing of it was written, and
    the stale run stops (:func:`sealfl.server.campaign_files.fence_verdict`)."""
