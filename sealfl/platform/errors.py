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


class Interrupted(PlatformError):
    """A signal (SIGINT, SIGTERM) stopped a long command. Raised only after every process
    the command started is gone and its directory is consistent again.

    Attributes:
        signum: the signal number; ``exit_code`` is ``128 + signum`` (130 for SIGINT,
            143 for SIGTERM), the shell convention for "killed by a signal".
    """

    def __init__(self, signum: int, message: str = ""):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(message or f"stopped by {signal_name(signum)}")


class WorkerError(SimulationError):
    """The worker process that runs Flower and Ray failed or died; the message says how
    and names its log file."""


def signal_name(signum: int) -> str:
    """``2`` -> ``"SIGINT"`` (``"signal N"`` for numbers without a name)."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
