"""Exception hierarchy for :mod:`sealfl.platform`."""

from sealfl.common.errors import Interrupted, SealflError, signal_name  # noqa: F401  (Interrupted, signal_name: moved to sealfl.common.errors in 0.2; re-exported for one release)

__all__ = ["PlatformError", "ConsortiumError", "CampaignError", "ReleaseError", "QuantizeError", "OnnxReferenceError",
           "SimulationError", "WorkerError", "DeploymentError"]


class PlatformError(SealflError):
    """A coordinator-side step failed."""


class ConsortiumError(PlatformError):
    """The consortium directory is missing, malformed or would be overwritten."""


class CampaignError(PlatformError):
    """A campaign did not finish; the message carries the aggregator's recorded error."""


class ReleaseError(PlatformError):
    """The release pipeline refused to release (e.g. the INT8 accuracy gate)."""


class QuantizeError(ReleaseError, ValueError):
    """A model cannot be quantised (:mod:`sealfl.platform.quantize`,
    :mod:`sealfl.platform.llm.quantize`): not the expected graph or weights."""


class OnnxReferenceError(ReleaseError, ValueError):
    """The NumPy re-implementation of the released ONNX operators cannot run a model
    (:mod:`sealfl.platform.onnx_ref`)."""


class SimulationError(PlatformError):
    """Ray could not be started or reached for a Flower simulation run."""


class WorkerError(SimulationError):
    """The worker process that runs Flower and Ray failed or died; the message says how
    and names its log file."""


class DeploymentError(PlatformError):
    """A Flower deployment process (SuperLink, SuperNode) or ``flwr`` command failed, or a
    deployed run did not finish; the message says which and where its log is."""
