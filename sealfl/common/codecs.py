"""Which codec a consortium's parameters name: packed BFV (:mod:`sealfl.common.bfv`), or
the benchmark-only plaintext baseline (:mod:`sealfl.common.plain`, refused unless the
process opted in). Partners, aggregator and consortium set-up load codecs through here;
the release enclave's key holder loads BFV only."""

from __future__ import annotations

from .bfv import BFVCodec, BFVParams
from .errors import CiphertextError
from .plain import SCHEME as PLAIN_SCHEME
from .plain import PlainCodec, PlainParams

__all__ = ["params_from_dict", "generate", "from_bytes"]


def params_from_dict(d) -> BFVParams | PlainParams:
    """Parameters from a consortium/kit/server dict. Raises CiphertextError for anything
    else, or for plaintext parameters in a process that did not opt in."""
    if not isinstance(d, dict):
        raise CiphertextError(f"HE parameters must be an object, got {type(d).__name__}")
    return PlainParams.from_dict(d) if d.get("scheme") == PLAIN_SCHEME else BFVParams.from_dict(d)


def generate(params: BFVParams | PlainParams | None = None):
    """Key ceremony for ``params`` (default: BFV defaults)."""
    return PlainCodec.generate(params) if isinstance(params, PlainParams) else BFVCodec.generate(params)


def from_bytes(context_bytes: bytes, params: BFVParams | PlainParams, ctx_id: bytes):
    """Load a context of ``params``' scheme. Raises CiphertextError."""
    cls = PlainCodec if isinstance(params, PlainParams) else BFVCodec
    return cls.from_bytes(context_bytes, params, ctx_id)
