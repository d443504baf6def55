"""Exception hierarchy of :mod:`sealfl.he` (one base, :class:`HEError`)."""

from __future__ import annotations

from sealfl.common.errors import SealflError

__all__ = ["HEError", "CiphertextError", "SecretKeyMissingError", "DecryptedValueError", "KeyWrapError",
           "ServerOptError", "PrivacyError", "TooLittleNoiseError"]


class HEError(SealflError):
    """Base class of every error raised by :mod:`sealfl.he` (homomorphic encryption, key
    wrapping of HE secrets, and what key holders do with decryptions)."""


class CiphertextError(HEError):
    """A ciphertext blob does not parse, belongs to another HE context, or has the
    wrong length. The message names what was wrong; callers add who sent it."""


class SecretKeyMissingError(HEError):
    """Decryption was asked of a HE context that holds no secret key (the aggregator's)."""


class DecryptedValueError(HEError):
    """A key holder refused a decrypted aggregate: it is out of the bounds the task
    declares, not finite, or its count differs from the declared total. Nothing derived
    from it may be published (see :mod:`sealfl.he.decrypted`)."""


class KeyWrapError(HEError):
    """Unwrapping a kit secret failed: wrong private key, wrong label, or a modified blob
    (:mod:`sealfl.he.kit_wrap`)."""


class ServerOptError(HEError):
    """A server-optimizer setting is unknown or out of range (:mod:`sealfl.he.server_opt`)."""


class PrivacyError(HEError):
    """A differential-privacy setting is nonsense (ε, δ, noise multiplier, clip norm,
    trust parameter out of range) or a budget cannot be met (:mod:`sealfl.he.dp`,
    :mod:`sealfl.he.dp_account`). The message names the setting and its allowed range."""


class TooLittleNoiseError(DecryptedValueError):
    """A key holder refused a DP aggregate because fewer partners than ``k`` counted in it
    (the count travels inside the encrypted sum, :mod:`sealfl.he.dp`): the sum carries less
    noise than the accountant assumes, so it is not published."""
