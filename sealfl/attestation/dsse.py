"""DSSE v1 envelopes (Dead Simple Signing Envelope, secure-systems-lab/dsse, protocol.md + envelope.md).

Signing and verification are over the Pre-Authentication Encoding::

    PAE(type, body) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body

where ``SP`` is one space (0x20), ``LEN(s)`` the ASCII decimal byte length of ``s`` with
no leading zeros, ``type`` is UTF-8. The envelope JSON is::

    {"payloadType": str, "payload": Base64(body),
     "signatures": [{"keyid": str, "sig": Base64(DER ECDSA P-256/SHA-256 over PAE)}]}

Base64 is standard (RFC 4648 §4) with canonical padding, on output *and* on input: the
DSSE spec lets verifiers accept URL-safe or unpadded text too, but then one signed byte
string has many texts (and lenient decoders drop stray characters), so sealfl accepts only
the one text its signer writes (:func:`sealfl.attestation.canonical.b64decode_strict`).
Every field is type-checked before use; an envelope holds at most
:data:`MAX_SIGNATURES` signatures.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence
from typing import Any

from Crypto.PublicKey import ECC

from sealfl.attestation import keys as _keys
from sealfl.attestation.canonical import b64decode_strict
from sealfl.attestation.errors import FormatError, SignatureError
from sealfl.common.fields import Fields

__all__ = ["MAX_SIGNATURES", "pae", "sign_envelope", "verify_envelope"]

log = logging.getLogger(__name__)

#: Most signatures one envelope may carry (each costs an ECDSA verification per pinned key).
MAX_SIGNATURES = 16
_WHAT = "DSSE envelope"


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
    ``PAE(payloadType, payload)`` with one of ``trusted_public_keys`` (threshold 1), in its
    one canonical encoding (low-S, minimal DER: :func:`sealfl.attestation.keys.verify`).
    The envelope's other bytes (further signatures, keyids, JSON layout) carry no identity:
    what a release *is* is the payload verified here (its digest, the statement digest). A
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
    fields = Fields(_WHAT, SignatureError)
    fields.object(envelope, "")
    payload_type = fields.get(envelope, "payloadType", "string")
    if expected_payload_type is not None and payload_type != expected_payload_type:
        raise fields.fail("payloadType", f"is {payload_type!r:.80}, expected {expected_payload_type!r}")
    payload = _b64(envelope, "payload", "", fields)
    signatures = fields.get(envelope, "signatures", "array", nonempty=True, max_len=MAX_SIGNATURES)
    entries = []
    for i, entry in enumerate(signatures):
        at = fields.join("signatures", i)
        fields.object(entry, at)
        entries.append((fields.get(entry, "keyid", "string", at, default="", nonempty=False),
                        _b64(entry, "sig", at, fields)))
    if not trusted_public_keys:
        raise SignatureError("no trusted public keys given; pin the release public key")
    trusted = {_keys.keyid(k): k for k in trusted_public_keys}
    message = pae(payload_type, payload)
    for kid, sig in entries:
        candidates = [trusted[kid]] if kid in trusted else ([] if kid else list(trusted.values()))
        for key in candidates:
            if _keys.verify(key, message, sig):
                return payload
    kids = [kid for kid, _ in entries]
    problems = [f"signatures[{i}]: {p}" for i, (_, sig) in enumerate(entries) if (p := _keys.signature_problem(sig))]
    raise SignatureError(
        f"no DSSE signature verifies with a trusted key (envelope keyids {kids}, "
        f"trusted keyids {sorted(trusted)})" + (f"; {'; '.join(problems)}" if problems else "")
    )


def _b64(parent: dict, key: str, at: str, fields: Fields) -> bytes:
    path = fields.join(at, key)
    try:
        return b64decode_strict(fields.get(parent, key, "string", at, nonempty=False, max_len=1 << 30),
                                f"{_WHAT}: field {path!r}")
    except FormatError as exc:
        raise SignatureError(str(exc)) from exc
