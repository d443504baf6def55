"""Which codec a consortium's parameters name: CKKS (:mod:`sealfl.he.ckks`, the
default, as ARCHITECTURE.md fixes it), packed BFV (:mod:`sealfl.he.bfv`, the
``--he bfv`` option: ~14x fewer bytes on the wire, exact sums; issue 9), or the
benchmark-only plaintext baseline (:mod:`sealfl.he.plain`, refused unless the process
opted in). Partners, aggregator, key holders and consortium set-up load codecs through
here; the release enclave's key holder refuses the plaintext baseline."""

from __future__ import annotations

from typing import Union

from sealfl.he.bfv import BFVCodec, BFVParams
from sealfl.he.ckks import CKKSCodec, CKKSParams
from sealfl.he.errors import CiphertextError
from sealfl.he.plain import SCHEME as PLAIN_SCHEME
from sealfl.he.plain import PlainCodec, PlainParams

__all__ = ["HE_SCHEMES", "Params", "Codec", "params_from_dict", "params_for", "generate", "from_bytes"]

Params = Union[CKKSParams, BFVParams, PlainParams]
Codec = Union[CKKSCodec, BFVCodec, PlainCodec]
#: the ``--he`` choices of ``sealfl consortium create`` -> default parameters
HE_SCHEMES = {"ckks": CKKSParams, "bfv": BFVParams}
_BY_SCHEME = {"CKKS": (CKKSParams, CKKSCodec), "BFV": (BFVParams, BFVCodec), PLAIN_SCHEME: (PlainParams, PlainCodec)}


def params_from_dict(d) -> Params:
    """Parameters from a consortium/kit/server dict (its ``scheme`` picks the codec).
    Raises CiphertextError for anything else, or for plaintext parameters in a process
    that did not opt in."""
    if not isinstance(d, dict):
        raise CiphertextError(f"HE parameters must be an object, got {type(d).__name__}")
    scheme = d.get("scheme")
    if scheme not in _BY_SCHEME:
        raise CiphertextError(f"unknown HE scheme {scheme!r}; expected one of {sorted(_BY_SCHEME)}")
    return _BY_SCHEME[scheme][0].from_dict(d)


def params_for(name: str) -> Params:
    """Default parameters for a ``--he`` choice (``ckks`` or ``bfv``). Raises CiphertextError."""
    try:
        return HE_SCHEMES[str(name).strip().lower()]()
    except KeyError:
        raise CiphertextError(f"unknown HE scheme {name!r}; choose one of {sorted(HE_SCHEMES)}") from None


def _codec_class(params):
    for p_cls, c_cls in _BY_SCHEME.values():
        if isinstance(params, p_cls):
            return c_cls
    raise CiphertextError(f"not HE parameters: {params!r}")


def generate(params: Params | None = None) -> Codec:
    """Key ceremony for ``params`` (default: CKKS with its defaults)."""
    return _codec_class(params or CKKSParams()).generate(params or CKKSParams())


def from_bytes(context_bytes: bytes, params: Params, ctx_id: bytes) -> Codec:
    """Load a context of ``params``' scheme. Raises CiphertextError."""
    return _codec_class(params).from_bytes(context_bytes, params, ctx_id)
