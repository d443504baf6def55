"""Exception hierarchy of :mod:`sealfl.enclave`.

Every error raised by this package derives from :class:`EnclaveError`; messages say what
failed and what to do.
"""

from __future__ import annotations

from sealfl.common.errors import RuntimeSandboxError, SealflError

__all__ = [
    "EnclaveError",
    "TEEError",
    "TEEStateError",
    "UnsealError",
    "BootError",
    "RuntimeSandboxError",
    "ReleaseWriteError",
    "SecretNotFoundError",
    "InputSpecError",
    "InputRangeError",
]


class EnclaveError(SealflError):
    """Base class of every error raised by :mod:`sealfl.enclave` (a :class:`SealflError`)."""


class TEEError(EnclaveError):
    """A TEE operation failed (bad PCR index, bad digest size, unknown backend, ...)."""


class TEEStateError(TEEError):
    """A TEE state directory is missing, incomplete, has unsafe permissions or already exists."""


class UnsealError(TEEError):
    """A sealed blob could not be unsealed: it was modified, sealed by another TEE, or the
    current PCR values differ from the policy it was sealed to (e.g. the code changed)."""


class BootError(EnclaveError):
    """The device refused to boot a release.

    Attributes:
        reason: short machine-readable reason (``"verification"``, ``"health-check"``, ``"canary"``,
            ``"runtime"``, ``"trust"``, ``"state"``, ``"tee"``, ``"model"``).
        file: failing release file for ``"verification"`` failures, else None.
        check: failing check name for ``"verification"`` failures, else None.
    """

    def __init__(self, message: str, *, reason: str, file: str | None = None, check: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.file = file
        self.check = check



class ReleaseWriteError(EnclaveError):
    """A release could not be written (output dir not empty, invalid payload, I/O failure)."""


class SecretNotFoundError(EnclaveError):
    """No sealed secret with that name exists in the enclave state directory."""


class InputSpecError(EnclaveError):
    """A release's signed ``input`` description (feature ranges) is malformed."""


class InputRangeError(EnclaveError, ValueError):
    """A row given to the device's model is not finite, outside the release's documented
    feature ranges, or has an invalid one-hot group; the message names row and column."""
