"""Exception hierarchy for :mod:`sealfl.server`."""

from sealfl.common.errors import SealflError


class ServerError(SealflError):
    """An aggregator-side step failed."""


class NotEnoughPartnersError(ServerError):
    """Fewer valid partner replies than ``min_partners``: the round cannot be aggregated."""


class SecretKeyPresentError(ServerError):
    """The aggregator was handed a CKKS context that holds a secret key: refuse to run."""
