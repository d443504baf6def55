"""Errors of :mod:`sealfl.kbs` (one hierarchy under :class:`sealfl.common.errors.SealflError`)."""

from __future__ import annotations

from sealfl.common.errors import SealflError

__all__ = ["KBSError", "KeyRequestRefused", "AtRestError"]


class KBSError(SealflError):
    """Base class of key-broker errors."""


class KeyRequestRefused(KBSError):
    """The broker refused a key request; ``check`` names the failed check (``nonce``,
    ``request``, ``ak``, ``evidence``, ``policy``, ``key``)."""

    def __init__(self, message: str, *, check: str) -> None:
        super().__init__(message)
        self.check = check


class AtRestError(KBSError):
    """An encrypted-at-rest file is malformed, or the key does not open it."""
