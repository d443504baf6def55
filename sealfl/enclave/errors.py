"""Exception hierarchy of :mod:`sealfl.enclave`.

Every error raised by this package derives from :class:`EnclaveError`; messages say what
failed and what to do.
"""

from __future__ import annotations

from sealfl._moved import moved_names_hook
from sealfl.common.errors import SealflError

__all__ = [
    "EnclaveError",
    "TEEError",
    "TEEStateError",
    "UnsealError",
    "TPMError",
    "BootError",
    "UpdateError",
    "RuntimeSandboxError",
    "ReleaseWriteError",
    "SecretNotFoundError",
    "InputSpecError",
    "InputRangeError",
    "InputFileError",
    "KeyBrokerError",
    "LLMInputError",
    "ServeOptionsError",
    "KeyRequestRefused",
]


class EnclaveError(SealflError):
    """Base class of every error raised by :mod:`sealfl.enclave` (a :class:`SealflError`)."""


class TEEError(EnclaveError):
    """A TEE operation failed (bad PCR index, bad digest size, unknown backend, ...)."""


class TEEStateError(TEEError):
    """A TEE state directory is missing, incomplete, has unsafe permissions or already exists."""


class TPMError(TEEError):
    """A tpm2-tools command failed on the TPM; the message says what the response code means
    and what the operator does (:mod:`sealfl.enclave.tee.tpm_rc`).

    Attributes:
        command: the tpm2-tools command (``"tpm2_quote"``).
        rc: the decoded :class:`~sealfl.enclave.tee.tpm_rc.TpmRc`, or None when the tool
            printed no response code.
    """

    def __init__(self, message: str, *, command: str = "", rc=None) -> None:
        super().__init__(message)
        self.command = command
        self.rc = rc

    @property
    def kind(self) -> str:
        """The response code's kind (``"resources"``, ``"policy"``, ...; ``"other"`` without one)."""
        return self.rc.kind if self.rc is not None else "other"


class UnsealError(TEEError):
    """A sealed blob could not be unsealed: it was modified, sealed by another TEE, or the
    current PCR values differ from the policy it was sealed to (e.g. the code changed)."""


class RuntimeSandboxError(EnclaveError):
    """The sandboxed inference child failed: it reported an error (its message is included),
    crashed, exceeded its memory limit, or timed out. Raised by
    :class:`sealfl.enclave.sandbox.runtime.SandboxedRuntime`, which devices and partners
    (scoring release candidates) share."""


class BootError(EnclaveError):
    """The device refused to boot a release.

    Attributes:
        reason: short machine-readable reason (``"verification"``, ``"health-check"``, ``"canary"``, ``"tee-state"``, ``"requirements"``, ``"key"``,
            ``"runtime"``, ``"trust"``, ``"state"``, ``"tee"``, ``"model"``).
        file: failing release file for ``"verification"`` failures, else None.
        check: failing check name for ``"verification"`` failures, else None.
    """

    def __init__(self, message: str, *, reason: str, file: str | None = None, check: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.file = file
        self.check = check


class UpdateError(EnclaveError):
    """A device update from a TUF repository was refused or failed before anything was
    installed: the repository's metadata (TUF), a download (length, hash, timeout), the
    release index or the release's claims; the running release is untouched.

    Attributes:
        stage: ``"trust"`` (no TUF root), ``"metadata"`` (TUF refused the repository's
            metadata), ``"download"`` (a target could not be fetched within its length and
            time), ``"index"`` (the release index or a target's claim), ``"release"`` (the
            downloaded release is not the one promised or fails verification).
    """

    def __init__(self, message: str, *, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


class ReleaseWriteError(EnclaveError):
    """A release could not be written (output dir not empty, invalid payload, I/O failure)."""


class SecretNotFoundError(EnclaveError):
    """No sealed secret with that name exists in the enclave state directory."""


class InputSpecError(EnclaveError):
    """A release's signed ``input`` description (feature ranges) is malformed."""


class InputRangeError(EnclaveError, ValueError):
    """A row given to the device's model is not finite, outside the release's documented
    feature ranges, or has an invalid one-hot group; the message names row and column."""


class InputFileError(EnclaveError):
    """A file of rows to score is unreadable, too large, or not a CSV of numbers with the
    model's number of columns; the message names the file, the row and the problem."""


class LLMInputError(EnclaveError, ValueError):
    """The LLM runtime was given what it cannot run: messages or a prompt it cannot
    tokenise or that exceed the context, or a release whose tokenizer, chat template or
    generation settings do not parse (:mod:`sealfl.enclave.sandbox.llm_runtime`)."""


class ServeOptionsError(EnclaveError, ValueError):
    """``device serve`` was started with impossible options (slots, thread)."""


class KeyBrokerError(EnclaveError):
    """A key-broker step failed: the broker's files, the HTTP exchange with it, or its answer
    (:mod:`sealfl.enclave.keybroker`, :mod:`sealfl.enclave.device.kbs_client`)."""


class KeyRequestRefused(KeyBrokerError):
    """The broker refused a key request; ``check`` names the failed check (``nonce``,
    ``request``, ``ak``, ``evidence``, ``policy``, ``key``, ``rate``); for ``rate``,
    ``retry_after_s`` says when to ask again (seconds)."""

    def __init__(self, message: str, *, check: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.check = check
        self.retry_after_s = retry_after_s


__getattr__ = moved_names_hook(__name__)  # names moved out of this module in 0.2 (sealfl._moved)
