"""Which codec a consortium's parameters name: packed BFV (:mod:`sealfl.he.bfv`, the
default, as ARCHITECTURE.md fixes it: ~1.05x the fp32 bytes at LoRA size, exact sums,
decryptions that leak nothing about the key), CKKS (:mod:`sealfl.he.ckks`, the ``--he ckks``
option, NVIDIA FLARE's parameters), or the benchmark-only plaintext baseline (:mod:`sealfl.he.plain`, refused unless the process
opted in). Partners, aggregator, key holders and consortium set-up load codecs through
here; the release enclave's key holder refuses the plaintext baseline."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Union

from sealfl.he.bfv import BFVCodec, BFVParams
from sealfl.he.ckks import CKKSCodec, CKKSParams
from sealfl.he.errors import CiphertextError
from sealfl.he.plain import SCHEME as PLAIN_SCHEME
from sealfl.he.plain import PlainCodec, PlainParams

__all__ = ["HE_SCHEMES", "DEFAULT_HE", "Params", "Codec", "params_from_dict", "params_for", "generate", "from_bytes", "from_bytes_shared"]

Params = Union[CKKSParams, BFVParams, PlainParams]
Codec = Union[CKKSCodec, BFVCodec, PlainCodec]
#: the ``--he`` choices of ``sealfl consortium create`` -> default parameters
HE_SCHEMES = {"bfv": BFVParams, "ckks": CKKSParams}
#: the ``--he`` choice of a consortium created without one
DEFAULT_HE = "bfv"
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


def params_for(name: str, pack_bits: int | None = None, pack_range: int | None = None) -> Params:
    """Default parameters for a ``--he`` choice (``bfv`` or ``ckks``), with packed BFV's
    ``pack_bits`` / ``pack_range`` (:func:`sealfl.he.layouts.packed_layout`) when given.

    Raises CiphertextError: an unknown scheme, a packing given for CKKS, or an unsupported
    width or range."""
    try:
        cls = HE_SCHEMES[str(name).strip().lower()]
    except KeyError:
        raise CiphertextError(f"unknown HE scheme {name!r}; choose one of {sorted(HE_SCHEMES)}") from None
    if pack_bits is None and pack_range is None:
        return cls()
    if cls is not BFVParams:
        raise CiphertextError("--pack-bits / --pack-range choose packed BFV's fixed-point packing; CKKS holds one "
                              "approximate value per slot (use --he bfv)")
    d = BFVParams()
    return BFVParams(pack_bits=d.pack_bits if pack_bits is None else pack_bits,
                     pack_range=d.pack_range if pack_range is None else pack_range)


def _codec_class(params):
    for p_cls, c_cls in _BY_SCHEME.values():
        if isinstance(params, p_cls):
            return c_cls
    raise CiphertextError(f"not HE parameters: {params!r}")


def generate(params: Params | None = None) -> Codec:
    """Key ceremony for ``params`` (default: packed BFV with its defaults, :data:`DEFAULT_HE`)."""
    params = params or HE_SCHEMES[DEFAULT_HE]()
    return _codec_class(params).generate(params)


def from_bytes(context_bytes: bytes, params: Params, ctx_id: bytes) -> Codec:
    """Load a context of ``params``' scheme. Raises CiphertextError."""
    return _codec_class(params).from_bytes(context_bytes, params, ctx_id)


#: contexts parsed by :func:`from_bytes_shared` in this process: digest of (bytes, params, id) -> codec
_SHARED: "OrderedDict[bytes, Codec]" = OrderedDict()
#: how many distinct contexts :func:`from_bytes_shared` keeps (a simulation hosts one consortium's)
SHARED_CONTEXTS_MAX = 4


def from_bytes_shared(context_bytes: bytes, params: Params, ctx_id: bytes) -> Codec:
    """:func:`from_bytes`, parsing each distinct context once per process.

    Every partner kit of a consortium wraps the same HE secret context, and in simulation one
    Ray actor process serves many partners: parsing that context (TenSEAL ``context_from``,
    a few ms) for every message was a large part of a partner's work. Here the parsed
    context is kept (at most :data:`SHARED_CONTEXTS_MAX`, least recently used dropped),
    keyed by SHA-256 over the exact context bytes, the parameter dict and the context id,
    so a codec is only ever built on the context those bytes describe; each call returns
    a codec object of its own over it (``sibling()``: own evaluator, encoder and rounding
    generator). A context that fails to load is not kept: it fails every time.

    Raises:
        CiphertextError: as :func:`from_bytes`.
    """
    h = hashlib.sha256(b"sealfl-shared-context\0")
    for part in (bytes(context_bytes), json.dumps(params.to_dict(), sort_keys=True).encode(), bytes(ctx_id)):
        h.update(len(part).to_bytes(8, "big") + part)
    key = h.digest()
    proto = _SHARED.get(key)
    if proto is None:
        proto = _SHARED[key] = from_bytes(context_bytes, params, ctx_id)
        while len(_SHARED) > SHARED_CONTEXTS_MAX:
            _SHARED.popitem(last=False)
    else:
        _SHARED.move_to_end(key)
    return proto.sibling()
