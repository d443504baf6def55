"""DSSE v1 envelopes (Dead Simple Signing Envelope, secure-systems-lab/dsse, protocol.md + envelope.md).

Signing and verification are over the Pre-Authentication Encoding::

    PAE(type, body) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body

where ``SP`` is one space (0x20), ``LEN(s)`` the ASCII decimal byte length of ``s`` with
no leading zeros, ``type`` is UTF-8. The envelope JSON is::

    {"payloadType": str, "payload": Base64(body),
     "signatures": [{"keyid": str, "sig": Base64(DER ECDSA P-256/SHA-256 over PAE)}]}

Base64 is standard (RFC 4648 §4) on output; on input standard or URL-safe, with or
without padding, as the spec allows.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Sequence
from typing import Any

from Crypto.PublicKey import ECC

from . import keys as _keys
from .errors import SignatureError

__all__ = ["pae", "sign_envelope", "verify_envelope", "b64decode_lenient"]

log = logging.getLogger(__name__)


def pae(payload_type: str, payload: bytes) -> bytes:
    """Return the DSSE v1 Pre-Authentication Encoding of ``(payload_type, payload)``.

    Args:
        payload_type: media type string, e.g. ``"application/vnd.in-toto+json"``.
        payload: the raw payload bytes.

    Returns:
        ``b"DSSEv1 " + LEN(type) + b" " + type + b" " + LEN(body) + b" " + body``.
    """
    type_bytes = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(type_bytes), type_bytes, len(payload), bytes(payload))


def b64decode_lenient(text: Any) -> bytes:
    """Decode standard or URL-safe Base64, with or without padding (DSSE envelope.md).

    Raises:
        SignatureError: not a string or not valid Base64.
    """
    if not isinstance(text, str):
        raise SignatureError(f"expected a Base64 string, got {type(text).__name__}")
    padded = text + "=" * (-len(text) % 4)
    try:
        if "-" in text or "_" in text:
            return base64.urlsafe_b64decode(padded.encode("ascii"))
        return base64.b64decode(padded.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
        raise SignatureError(f"invalid Base64 in DSSE envelope: {exc}") from exc


def sign_envelope(payload: bytes, payload_type: str, private_key: ECC.EccKey) -> dict:
    """Sign ``payload`` into a DSSE v1 envelope with one ECDSA P-256 signature.

    Args:
        payload: the exact bytes to sign (e.g. a canonical-JSON in-toto statement).
        payload_type: the DSSE payloadType string.
        private_key: ECDSA P-256 private key.

    Returns:
        ``{"payloadType", "payload" (b64), "signatures": [{"keyid", "sig" (b64)}]}``;
        ``keyid`` is :func:`sealfl.attestation.keys.keyid` of the public key.
    """
    sig = _keys.sign(private_key, pae(payload_type, payload))
    return {
        "payloadType": payload_type,
        "payload": base64.b64encode(bytes(payload)).decode("ascii"),
        "signatures": [
            {"keyid": _keys.keyid(private_key.public_key()), "sig": base64.b64encode(sig).decode("ascii")}
        ],
    }


def verify_envelope(
    envelope: Any,
    trusted_public_keys: Sequence[ECC.EccKey],
    *,
    expected_payload_type: str | None = None,
) -> bytes:
    """Verify a DSSE envelope against pinned keys and return the payload bytes.

    The envelope is accepted iff at least one of its signatures verifies over
    ``PAE(payloadType, payload)`` with one of ``trusted_public_keys`` (threshold 1). A
    signature whose non-empty ``keyid`` names an untrusted key is skipped; an empty keyid
    is tried against every trusted key.

    Args:
        envelope: the parsed envelope dict.
        trusted_public_keys: pinned ECDSA P-256 public keys.
        expected_payload_type: if given, ``payloadType`` must equal it.

    Returns:
        the payload bytes that were verified (decoded from Base64).

    Raises:
        SignatureError: malformed envelope, wrong payloadType, no trusted keys, or no
            signature by a trusted key.
    """
    if not isinstance(envelope, dict):
        raise SignatureError("DSSE envelope must be a JSON object")
    payload_type = envelope.get("payloadType")
    if not isinstance(payload_type, str) or not payload_type:
        raise SignatureError("DSSE envelope has no string 'payloadType'")
    if expected_payload_type is not None and payload_type != expected_payload_type:
        raise SignatureError(
            f"DSSE payloadType is {payload_type!r}, expected {expected_payload_type!r}"
        )
    payload = b64decode_lenient(envelope.get("payload"))
    signatures = envelope.get("signatures")
    if not isinstance(signatures, list) or not signatures:
        raise SignatureError("DSSE envelope has no signatures")
    if not trusted_public_keys:
        raise SignatureError("no trusted public keys given; pin the release public key")
    trusted = {_keys.keyid(k): k for k in trusted_public_keys}
    message = pae(payload_type, payload)
    for entry in signatures:
        if not isinstance(entry, dict):
            raise SignatureError("DSSE signature entry must be an object")
        kid = entry.get("keyid", "")
        if not isinstance(kid, str):
            raise SignatureError("DSSE signature keyid must be a string")
        sig = b64decode_lenient(entry.get("sig"))
        candidates = [trusted[kid]] if kid in trusted else ([] if kid else list(trusted.values()))
        for key in candidates:
            if _keys.verify(key, message, sig):
                return payload
    kids = [e.get("keyid") for e in signatures if isinstance(e, dict)]
    raise SignatureError(
        f"no DSSE signature verifies with a trusted key (envelope keyids {kids}, "
        f"trusted keyids {sorted(trusted)})"
    )
