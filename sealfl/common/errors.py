"""Exception hierarchy for :mod:`sealfl.common`."""


class SealflError(Exception):
    """Base class of every error sealfl raises on purpose."""


class HEError(SealflError):
    """Something about homomorphic encryption failed."""


class CiphertextError(HEError):
    """A ciphertext blob does not parse, belongs to another HE context, or has the
    wrong length. The message names what was wrong; callers add who sent it."""


class SecretKeyMissingError(HEError):
    """Decryption was asked of a HE context that holds no secret key (the aggregator's)."""


class DecryptedValueError(HEError):
    """A key holder refused a decrypted aggregate: it is out of the bounds the task
    declares, not finite, or its count differs from the declared total. Nothing derived
    from it may be published (see :mod:`sealfl.common.decrypted`)."""


class RuntimeSandboxError(SealflError):
    """The sandboxed inference child failed: it reported an error (its message is included),
    crashed, exceeded its memory limit, or timed out. Raised by
    :class:`sealfl.common.sandbox.SandboxedRuntime`, which devices and partners (scoring
    release candidates) share; re-exported by :mod:`sealfl.enclave.errors`."""


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for error messages about hostile
    input (a config may hold a 400-digit int or a megabyte string)."""
    r = repr(value)
    return r if len(r) <= limit else r[:max(limit - 3, 1)] + "..."
