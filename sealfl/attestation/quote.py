"""TEE quotes: format, PCR arithmetic and pure verification.

PCR arithmetic follows TPM 2.0 Library Part 1 (Architecture):

* §17 PCR extend: ``PCR_new = H(PCR_old || digest)`` with ``H`` = the bank hash
  (SHA-256 here), ``digest`` the same size as the bank hash (32 bytes), and every PCR
  starting at 32 zero bytes after reset.
* §18.5 (Quote) ``pcrDigest``: ``H(PCR[i1] || PCR[i2] || ...)`` over the selected PCR
  values concatenated in ascending index order.

**Purpose.** A quote says what it is for, inside what is signed. The caller's data is
never quoted as is: the qualifying data (TPM 2.0 Part 1 §18.5 / Part 3 TPM2_Quote
``qualifyingData``, the quote's ``nonce`` field here) is::

    SHA-256( label(purpose) || 0x00 || data )

with one label per purpose (:data:`PURPOSE_LABELS`): ``"release"`` (a release attestation;
``data`` = SHA-256 of the signed in-toto statement) and ``"challenge"`` (a fresh quote for a
remote verifier; ``data`` = the verifier's nonce). Labels contain no NUL byte, so
``label || 0x00`` is prefix-free and no challenge nonce can produce a release
attestation's qualifying data (short of a SHA-256 collision). The purpose is also a signed
field of the quote, so a verifier sees it without guessing; on a TPM, where only
``qualifyingData`` is signed, the label inside it carries the same meaning.

A quote, as produced by every :class:`sealfl.enclave.tee.interface.TEE` backend, is a JSON object::

    {"backend": "sim" | "tpm", "pcr_bank": "sha256",
     "pcrs": {"<index>": hex, ...},          # decimal-string keys, values 32-byte hex
     "pcr_digest": hex,                      # §18.5 pcrDigest over "pcrs"
     "purpose": "release" | "challenge",
     "nonce": hex,                           # qualifying data (32 bytes, see above)
     "signature": base64(DER ECDSA P-256/SHA-256 by the attestation key (AK)
                         over canonical_json(quote without "signature"));
                         canonical low-S DER only: sealfl.attestation.keys)}

Backends may add further fields; they are covered by the signature. Every field above is
type-checked before use (:mod:`sealfl.common.fields`) and the signature is strict
Base64.

**TPM quotes** (``backend == "tpm"``) carry one more field, ``"attest"``: base64 of the
``TPMS_ATTEST`` the TPM signed (:mod:`sealfl.attestation.tpm_attest`), and their
``signature`` is the TPM's DER ECDSA P-256/SHA-256 signature over *those* bytes, not over
the JSON. The verifier then checks that the signed structure says what the JSON says:
``extraData`` equals ``nonce``, the selection is exactly the SHA-256 bank over the quoted
PCR indices, and ``pcrDigest`` equals ``pcr_digest``. ``purpose`` is not signed by a TPM;
the purpose label hashed into ``extraData`` carries it (a quote presented for another
purpose fails the nonce check).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from Crypto.PublicKey import ECC

from sealfl.attestation import keys as _keys
from sealfl.attestation.canonical import b64decode_strict, canonical_json
from sealfl.attestation.errors import FormatError, PolicyError, QuoteError
from sealfl.attestation.tpm_attest import TPM_ALG_SHA256, parse_quote_attest
from sealfl.common.fields import Fields

__all__ = [
    "PCR_BANK",
    "DIGEST_SIZE",
    "NUM_PCRS",
    "ZERO_PCR",
    "KNOWN_BACKENDS",
    "INSECURE_BACKENDS",
    "RELEASE_PURPOSE",
    "CHALLENGE_PURPOSE",
    "KEY_REQUEST_PURPOSE",
    "PURPOSE_LABELS",
    "MAX_DATA",
    "extend",
    "pcr_after",
    "pcr_digest",
    "parse_pcr_map",
    "qualifying_data",
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
RELEASE_PURPOSE = "release"
CHALLENGE_PURPOSE = "challenge"
#: Domain-separation label of each purpose (hashed into the qualifying data).
KEY_REQUEST_PURPOSE = "key-request"
PURPOSE_LABELS: dict[str, bytes] = {
    RELEASE_PURPOSE: b"sealfl.release-attestation/v1",
    CHALLENGE_PURPOSE: b"sealfl.challenge/v1",
    KEY_REQUEST_PURPOSE: b"sealfl.key-request/v1",
}
#: Longest caller data (nonce) a quote accepts, in bytes.
MAX_DATA = 64
_WHAT = "quote"


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


def qualifying_data(purpose: str, data: bytes) -> bytes:
    """The qualifying data a quote carries: ``SHA-256(label(purpose) || 0x00 || data)`` (32 bytes).

    Args:
        purpose: a key of :data:`PURPOSE_LABELS` (``"release"`` or ``"challenge"``).
        data: the caller's data, 1..:data:`MAX_DATA` bytes.

    Raises:
        QuoteError: unknown purpose, or ``data`` not bytes of 1..64 bytes.
    """
    label = PURPOSE_LABELS.get(purpose) if isinstance(purpose, str) else None
    if label is None:
        raise QuoteError(f"unknown quote purpose {purpose!r}; known: {sorted(PURPOSE_LABELS)}")
    if not isinstance(data, (bytes, bytearray)) or not 1 <= len(data) <= MAX_DATA:
        raise QuoteError(f"quote data (nonce) must be 1..{MAX_DATA} bytes")
    return hashlib.sha256(label + b"\0" + bytes(data)).digest()


def quote_message(quote: Mapping[str, Any]) -> bytes:
    """Bytes the AK signs: canonical JSON of ``quote`` without its ``"signature"`` field."""
    return canonical_json({k: v for k, v in quote.items() if k != "signature"})


def make_quote(
    backend: str,
    pcr_values: Mapping[int, bytes],
    purpose: str,
    data: bytes,
    sign: Callable[[bytes], bytes],
) -> dict:
    """Assemble and sign a quote dict (used by TEE backends).

    Args:
        backend: backend name (``"sim"``, ``"tpm"``).
        pcr_values: ``{index: 32-byte value}`` of the selected PCRs.
        purpose: ``"release"`` or ``"challenge"`` (see module docstring).
        data: the caller's data, 1..64 bytes; the quote carries
            :func:`qualifying_data` of it, not the data itself.
        sign: callable returning a DER ECDSA signature by the AK over its argument.

    Returns:
        the quote dict (format in the module docstring).

    Raises:
        QuoteError: bad backend, purpose, index, value or data length.
    """
    if backend not in KNOWN_BACKENDS:
        raise QuoteError(f"unknown TEE backend {backend!r}; known: {sorted(KNOWN_BACKENDS)}")
    nonce = qualifying_data(purpose, data)
    if not pcr_values:
        raise QuoteError("a quote needs at least one PCR")
    values = {_check_index(i): _as_digest(v, f"PCR {i}") for i, v in pcr_values.items()}
    body = {
        "backend": backend,
        "pcr_bank": PCR_BANK,
        "pcrs": {str(i): values[i].hex() for i in sorted(values)},
        "pcr_digest": pcr_digest(values),
        "purpose": purpose,
        "nonce": nonce.hex(),
    }
    body["signature"] = base64.b64encode(sign(quote_message(body))).decode("ascii")
    return body


def parse_pcr_map(raw: Any, fields: Fields, at: str) -> dict[int, str]:
    """Check a JSON object ``{"<index>": 64 lowercase hex}`` (non-empty) and return it with
    int keys. An index is a decimal string without leading zeros, ``"0"``..``"23"``.

    Raises:
        the error of ``fields``: not a non-empty object, a key that is not such an index, or
            a value that is not 64 lowercase hex digits; the message names the field.
    """
    fields.object(raw, at, nonempty=True)
    out: dict[int, str] = {}
    for key, value in raw.items():
        path = fields.join(at, key)
        if not (key.isascii() and key.isdigit() and len(key) <= 2 and str(int(key)) == key
                and int(key) < NUM_PCRS):
            raise fields.fail(path, f"is not a PCR index 0..{NUM_PCRS - 1} written in decimal")
        out[int(key)] = fields.hex64(value, path)
    return out


def _tpm_signed_bytes(quote: Mapping[str, Any], fields: Fields, pcrs: Mapping[int, str], claimed_digest: str,
                      nonce: str) -> bytes:
    """The ``TPMS_ATTEST`` of a ``tpm`` quote, after checking it agrees with the JSON fields."""
    try:
        attest = b64decode_strict(fields.get(quote, "attest", "string", max_len=2048), f"{_WHAT}: field 'attest'")
    except FormatError as exc:
        raise QuoteError(str(exc)) from exc
    info = parse_quote_attest(attest)
    if not hmac.compare_digest(info.extra_data.hex(), nonce):
        raise QuoteError("quote field 'nonce' differs from the extraData the TPM signed; the quote was altered")
    if info.selection != {TPM_ALG_SHA256: frozenset(pcrs)}:
        raise QuoteError(f"quote field 'pcrs' lists PCRs {sorted(pcrs)} but the TPM quoted "
                         f"{ {hex(a): sorted(v) for a, v in info.selection.items()} }; the quote was altered")
    if not hmac.compare_digest(info.pcr_digest.hex(), claimed_digest):
        raise QuoteError("quote field 'pcr_digest' differs from the pcrDigest the TPM signed; the quote was altered")
    return attest


def verify_quote(
    quote: Any,
    ak_public_key: ECC.EccKey,
    purpose: str,
    data: bytes,
    expected_pcrs: Mapping[int, str],
    *,
    allowed_backends: Collection[str] | None = None,
) -> None:
    """Verify a quote against a pinned AK, its purpose and data, and expected PCR values.
    Pure; no I/O.

    Checks, in order: the type of every field; the AK signature over
    :func:`quote_message` (for ``tpm`` quotes: over ``attest``, after checking that its
    nonce, PCR selection and pcrDigest equal the JSON fields); known backend; ``pcr_bank == "sha256"``; ``pcr_digest``
    recomputed from ``pcrs`` (§18.5); ``purpose`` equal to ``purpose`` and ``nonce`` equal
    to :func:`qualifying_data` ``(purpose, data)``; backend in ``allowed_backends`` (if
    given); every ``expected_pcrs[i]`` present in the quote and equal.

    Args:
        quote: the parsed quote dict.
        ak_public_key: pinned attestation-key public key (ECDSA P-256).
        purpose: what the quote must be for (``"release"`` or ``"challenge"``).
        data: the data the quote must be over (a release's statement digest, 32 bytes, or
            the verifier's challenge nonce, 1..64 bytes).
        expected_pcrs: ``{index: lowercase hex}`` the quoted PCRs must equal (a subset of
            the quoted PCRs; quoted PCRs not listed here are ignored).
        allowed_backends: backends the policy accepts; ``None`` = any known backend.

    Raises:
        QuoteError: malformed quote (naming the field), bad signature, wrong bank,
            pcr_digest, purpose or nonce.
        PolicyError: backend not allowed, or a PCR missing/different from expected.
    """
    expected_nonce = qualifying_data(purpose, data)
    fields = Fields(_WHAT, QuoteError)
    fields.object(quote, "")
    backend = fields.get(quote, "backend", "string", max_len=64)
    bank = fields.get(quote, "pcr_bank", "string", max_len=64)
    pcrs = parse_pcr_map(fields.get(quote, "pcrs", "object"), fields, "pcrs")
    claimed_digest = fields.get(quote, "pcr_digest", "hex64")
    claimed_purpose = fields.get(quote, "purpose", "string", max_len=64)
    nonce = fields.get(quote, "nonce", "string", max_len=2 * MAX_DATA)
    try:
        signature = b64decode_strict(fields.get(quote, "signature", "string", max_len=1024),
                                     f"{_WHAT}: field 'signature'")
        message = quote_message(quote)
    except FormatError as exc:
        raise QuoteError(str(exc)) from exc
    except (TypeError, ValueError) as exc:  # unreachable for parsed JSON; a guard for callers' dicts
        raise QuoteError(f"quote is not serialisable to canonical JSON: {exc}") from exc
    if backend == "tpm":
        message = _tpm_signed_bytes(quote, fields, pcrs, claimed_digest, nonce)
    if not _keys.verify(ak_public_key, message, signature):
        problem = _keys.signature_problem(signature)
        raise QuoteError(
            "quote signature does not verify with the pinned attestation key "
            f"(keyid {_keys.keyid(ak_public_key)}); the quote comes from another TEE or was modified"
            + (f" ({problem})" if problem else "")
        )
    if backend not in KNOWN_BACKENDS:
        raise fields.fail("backend", f"names unknown TEE backend {backend!r}")
    if bank != PCR_BANK:
        raise fields.fail("pcr_bank", f"is {bank!r}; only {PCR_BANK!r} is supported")
    if not hmac.compare_digest(claimed_digest, pcr_digest(pcrs)):
        raise QuoteError("quote pcr_digest does not match its PCR values")
    if claimed_purpose != purpose:
        raise QuoteError(
            f"quote purpose is {claimed_purpose!r:.80}, expected {purpose!r}: a quote made for one purpose "
            "(e.g. a challenge) never counts as another (e.g. a release attestation)"
        )
    if not hmac.compare_digest(nonce, expected_nonce.hex()):
        raise QuoteError(
            f"quote nonce {nonce!r} != expected {expected_nonce.hex()!r} (SHA-256 of the {purpose} label "
            "and the data); the quote is stale or was made for another request or release"
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
