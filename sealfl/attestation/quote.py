"""TEE quotes: format, PCR arithmetic and pure verification.

PCR arithmetic follows TPM 2.0 Library Part 1 (Architecture):

* §17 PCR extend: ``PCR_new = H(PCR_old || digest)`` with ``H`` = the bank hash
  (SHA-256 here), ``digest`` the same size as the bank hash (32 bytes), and every PCR
  starting at 32 zero bytes after reset.
* §18.5 (Quote) ``pcrDigest``: ``H(PCR[i1] || PCR[i2] || ...)`` over the selected PCR
  values concatenated in ascending index order.

A quote, as produced by every :class:`sealfl.enclave.tee.TEE` backend, is a JSON object::

    {"backend": "sim" | "tpm", "pcr_bank": "sha256",
     "pcrs": {"<index>": hex, ...},          # decimal-string keys, values 32-byte hex
     "pcr_digest": hex,                      # §18.5 pcrDigest over "pcrs"
     "nonce": hex,                           # caller's qualifying data, 1..64 bytes
     "signature": base64(DER ECDSA P-256/SHA-256 by the attestation key (AK)
                         over canonical_json(quote without "signature"))}

Backends may add further fields; they are covered by the signature.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from Crypto.PublicKey import ECC

from . import keys as _keys
from .canonical import canonical_json
from .errors import PolicyError, QuoteError

__all__ = [
    "PCR_BANK",
    "DIGEST_SIZE",
    "NUM_PCRS",
    "ZERO_PCR",
    "KNOWN_BACKENDS",
    "INSECURE_BACKENDS",
    "extend",
    "pcr_after",
    "pcr_digest",
    "quote_message",
    "make_quote",
    "verify_quote",
]

PCR_BANK = "sha256"
DIGEST_SIZE = 32
NUM_PCRS = 24
ZERO_PCR = b"\0" * DIGEST_SIZE
KNOWN_BACKENDS = frozenset({"sim", "tpm"})
#: Backends whose quotes prove nothing about hardware; accepted only when policy says so.
INSECURE_BACKENDS = frozenset({"sim"})
_MAX_NONCE = 64


def _as_digest(value: bytes | str, what: str) -> bytes:
    if isinstance(value, str):
        try:
            value = bytes.fromhex(value)
        except ValueError as exc:
            raise QuoteError(f"{what} is not hex: {value!r}") from exc
    if not isinstance(value, (bytes, bytearray)) or len(value) != DIGEST_SIZE:
        raise QuoteError(f"{what} must be {DIGEST_SIZE} bytes (SHA-256), got {value!r}")
    return bytes(value)


def _check_index(index: Any) -> int:
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < NUM_PCRS:
        raise QuoteError(f"PCR index must be an integer in 0..{NUM_PCRS - 1}, got {index!r}")
    return index


def extend(old: bytes, digest: bytes) -> bytes:
    """TPM 2.0 Part 1 §17 extend: return ``SHA-256(old || digest)`` (32 bytes).

    Raises:
        QuoteError: ``old`` or ``digest`` is not exactly 32 bytes.
    """
    return hashlib.sha256(_as_digest(old, "PCR value") + _as_digest(digest, "extend digest")).digest()


def pcr_after(digests: Sequence[bytes | str]) -> str:
    """Value of a SHA-256 PCR after reset (32 zero bytes) and extending ``digests`` in order.

    Args:
        digests: each a 32-byte ``bytes`` or 64-char hex ``str``.

    Returns:
        lowercase hex (64 chars) of the resulting PCR value.

    Raises:
        QuoteError: a digest is not 32 bytes.
    """
    value = ZERO_PCR
    for i, digest in enumerate(digests):
        value = extend(value, _as_digest(digest, f"digest #{i}"))
    return value.hex()


def pcr_digest(pcrs: Mapping[int, bytes | str]) -> str:
    """TPM 2.0 Part 1 §18.5 pcrDigest: SHA-256 over the PCR values in ascending index order; hex.

    Raises:
        QuoteError: an index is outside 0..23 or a value is not 32 bytes.
    """
    h = hashlib.sha256()
    for index in sorted(_check_index(i) for i in pcrs):
        h.update(_as_digest(pcrs[index], f"PCR {index}"))
    return h.hexdigest()


def quote_message(quote: Mapping[str, Any]) -> bytes:
    """Bytes the AK signs: canonical JSON of ``quote`` without its ``"signature"`` field."""
    return canonical_json({k: v for k, v in quote.items() if k != "signature"})


def make_quote(
    backend: str,
    pcr_values: Mapping[int, bytes],
    nonce: bytes,
    sign: Callable[[bytes], bytes],
) -> dict:
    """Assemble and sign a quote dict (used by TEE backends).

    Args:
        backend: backend name (``"sim"``, ``"tpm"``).
        pcr_values: ``{index: 32-byte value}`` of the selected PCRs.
        nonce: qualifying data, 1..64 bytes.
        sign: callable returning a DER ECDSA signature by the AK over its argument.

    Returns:
        the quote dict (format in the module docstring).

    Raises:
        QuoteError: bad backend, index, value or nonce length.
    """
    if backend not in KNOWN_BACKENDS:
        raise QuoteError(f"unknown TEE backend {backend!r}; known: {sorted(KNOWN_BACKENDS)}")
    if not isinstance(nonce, (bytes, bytearray)) or not 1 <= len(nonce) <= _MAX_NONCE:
        raise QuoteError(f"nonce must be 1..{_MAX_NONCE} bytes")
    if not pcr_values:
        raise QuoteError("a quote needs at least one PCR")
    values = {_check_index(i): _as_digest(v, f"PCR {i}") for i, v in pcr_values.items()}
    body = {
        "backend": backend,
        "pcr_bank": PCR_BANK,
        "pcrs": {str(i): values[i].hex() for i in sorted(values)},
        "pcr_digest": pcr_digest(values),
        "nonce": bytes(nonce).hex(),
    }
    body["signature"] = base64.b64encode(sign(quote_message(body))).decode("ascii")
    return body


def _parse_pcrs(raw: Any) -> dict[int, str]:
    if not isinstance(raw, dict) or not raw:
        raise QuoteError("quote 'pcrs' must be a non-empty object")
    out: dict[int, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key.isdigit() or str(int(key)) != key:
            raise QuoteError(f"quote PCR key must be a decimal index string, got {key!r}")
        index = _check_index(int(key))
        out[index] = _as_digest(value, f"PCR {index}").hex()
        if out[index] != value:
            raise QuoteError(f"PCR {index} value must be lowercase hex")
    return out


def verify_quote(
    quote: Any,
    ak_public_key: ECC.EccKey,
    expected_nonce: bytes,
    expected_pcrs: Mapping[int, str],
    *,
    allowed_backends: Collection[str] | None = None,
) -> None:
    """Verify a quote against a pinned AK, a nonce and expected PCR values. Pure; no I/O.

    Checks, in order: structure and types; the AK signature over
    :func:`quote_message`; ``pcr_bank == "sha256"``; ``pcr_digest`` recomputed from
    ``pcrs`` (§18.5); ``nonce == expected_nonce``; backend in ``allowed_backends`` (if
    given); every ``expected_pcrs[i]`` present in the quote and equal.

    Args:
        quote: the parsed quote dict.
        ak_public_key: pinned attestation-key public key (ECDSA P-256).
        expected_nonce: the qualifying data the quote must carry (bytes).
        expected_pcrs: ``{index: lowercase hex}`` the quoted PCRs must equal (a subset of
            the quoted PCRs; quoted PCRs not listed here are ignored).
        allowed_backends: backends the policy accepts; ``None`` = any known backend.

    Raises:
        QuoteError: malformed quote, bad signature, wrong bank, pcr_digest or nonce.
        PolicyError: backend not allowed, or a PCR missing/different from expected.
    """
    if not isinstance(quote, dict):
        raise QuoteError("quote must be a JSON object")
    for key in ("backend", "pcr_bank", "pcrs", "pcr_digest", "nonce", "signature"):
        if key not in quote:
            raise QuoteError(f"quote has no {key!r} field")
    sig_text = quote["signature"]
    try:
        signature = base64.b64decode(str(sig_text).encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
        raise QuoteError(f"quote signature is not Base64: {exc}") from exc
    try:
        message = quote_message(quote)
    except (TypeError, ValueError) as exc:
        raise QuoteError(f"quote is not serialisable to canonical JSON: {exc}") from exc
    if not _keys.verify(ak_public_key, message, signature):
        raise QuoteError(
            "quote signature does not verify with the pinned attestation key "
            f"(keyid {_keys.keyid(ak_public_key)}); the quote comes from another TEE or was modified"
        )
    backend = quote["backend"]
    if backend not in KNOWN_BACKENDS:
        raise QuoteError(f"unknown TEE backend {backend!r}")
    if quote["pcr_bank"] != PCR_BANK:
        raise QuoteError(f"quote PCR bank is {quote['pcr_bank']!r}; only {PCR_BANK!r} is supported")
    pcrs = _parse_pcrs(quote["pcrs"])
    if not hmac.compare_digest(str(quote["pcr_digest"]), pcr_digest(pcrs)):
        raise QuoteError("quote pcr_digest does not match its PCR values")
    if not isinstance(quote["nonce"], str) or not hmac.compare_digest(
        quote["nonce"], bytes(expected_nonce).hex()
    ):
        raise QuoteError(
            f"quote nonce {quote['nonce']!r} != expected {bytes(expected_nonce).hex()!r}; "
            "the quote is stale or was made for another request"
        )
    if allowed_backends is not None and backend not in allowed_backends:
        raise PolicyError(f"TEE backend {backend!r} is not allowed by policy (allowed: {sorted(allowed_backends)})")
    for index in sorted(expected_pcrs):
        want = expected_pcrs[index]
        got = pcrs.get(_check_index(index))
        if got is None:
            raise PolicyError(f"quote does not include PCR {index} required by policy")
        if not hmac.compare_digest(got, str(want).lower()):
            raise PolicyError(
                f"PCR {index} is {got}, policy expects {str(want).lower()}: the attested code "
                "measurement differs from the pinned one"
            )
