"""Exception hierarchy for :mod:`sealfl.clients`."""

from sealfl.common.errors import SealflError


class ClientError(SealflError):
    """A partner-side step failed."""


class DataError(ClientError):
    """Partner data is missing or malformed; the message names the file/row."""


class TaskInputError(ClientError, ValueError):
    """A task was given values of the wrong shape or range (parameters, statistics, block
    lengths); the message says which."""


class KitError(ClientError):
    """A partner's startup kit is missing, unreadable or cannot be unwrapped."""
