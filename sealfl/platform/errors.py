"""Exception hierarchy for :mod:`sealfl.platform`."""

from sealfl.common.errors import SealflError


class PlatformError(SealflError):
    """A coordinator-side step failed."""


class ConsortiumError(PlatformError):
    """The consortium directory is missing, malformed or would be overwritten."""


class CampaignError(PlatformError):
    """A campaign did not finish; the message carries the aggregator's recorded error."""


class ReleaseError(PlatformError):
    """The release pipeline refused to release (e.g. the INT8 accuracy gate)."""


class SimulationError(PlatformError):
    """Ray could not be started or reached for a Flower simulation run."""
