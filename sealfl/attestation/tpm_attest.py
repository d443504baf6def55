"""Parse a TPM 2.0 quote's signed structure (``TPMS_ATTEST``). Pure; no I/O.

A ``tpm`` quote carries the bytes the TPM signed (``attest``, what ``tpm2_quote -m``
writes). TPM 2.0 Library Part 2 (Structures) gives the layout, all integers big-endian:

=====================  =========================================================
``magic``              u32 ``0xff544347`` (``TPM_GENERATED_VALUE``, §6.2)
``type``               u16 ``0x8018`` (``TPM_ST_ATTEST_QUOTE``, §6.9)
``qualifiedSigner``    ``TPM2B_NAME``: u16 size + bytes
``extraData``          ``TPM2B_DATA``: u16 size + bytes -- the qualifying data (nonce)
``clockInfo``          ``TPMS_CLOCK_INFO`` (§10.11.1): clock u64, resetCount u32,
                       restartCount u32, safe u8
``firmwareVersion``    u64
``attested.quote``     ``TPMS_QUOTE_INFO`` (§10.12.1): ``TPML_PCR_SELECTION``
                       (count u32, then per bank: hash u16, sizeofSelect u8,
                       pcrSelect bytes -- bit ``i % 8`` of byte ``i // 8`` selects
                       PCR ``i``) and ``pcrDigest`` ``TPM2B_DIGEST``
=====================  =========================================================

Trailing bytes, a wrong magic or type, or a size that runs past the end are
:class:`~sealfl.attestation.errors.QuoteError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from sealfl.attestation.errors import QuoteError

__all__ = ["TPM_GENERATED_VALUE", "TPM_ST_ATTEST_QUOTE", "TPM_ALG_SHA256", "TpmQuoteInfo", "parse_quote_attest"]

TPM_GENERATED_VALUE = 0xFF544347
TPM_ST_ATTEST_QUOTE = 0x8018
TPM_ALG_SHA256 = 0x000B
#: Largest TPMS_ATTEST this parser takes (real quotes are ~150 bytes).
MAX_ATTEST = 1024


@dataclass(frozen=True)
class TpmQuoteInfo:
    """The fields of a parsed quote ``TPMS_ATTEST`` that sealfl checks.

    Attributes:
        qualified_signer: TPM name of the signing key (bytes).
        extra_data: the qualifying data (bytes, at most 64).
        clock, reset_count, restart_count, safe: ``TPMS_CLOCK_INFO`` (ms, counters, flag).
        firmware_version: TPM firmware version (u64).
        selection: ``{hash algorithm id: frozenset of PCR indices}``.
        pcr_digest: the ``pcrDigest`` (bytes; 32 for SHA-256).
    """

    qualified_signer: bytes
    extra_data: bytes
    clock: int
    reset_count: int
    restart_count: int
    safe: bool
    firmware_version: int
    selection: dict[int, frozenset[int]]
    pcr_digest: bytes


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise QuoteError(f"quote field 'attest': {what} runs past the end of the TPMS_ATTEST "
                             f"({len(self.data)} bytes); the quote is truncated or not a TPM quote")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u(self, fmt: str, what: str) -> int:
        return struct.unpack(">" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def sized(self, what: str) -> bytes:
        return self.take(self.u("H", f"size of {what}"), what)


def parse_quote_attest(attest: bytes) -> TpmQuoteInfo:
    """Parse the ``TPMS_ATTEST`` of a TPM2_Quote (layout in the module docstring).

    Args:
        attest: the signed bytes, at most :data:`MAX_ATTEST`.

    Returns:
        a :class:`TpmQuoteInfo`.

    Raises:
        QuoteError: not bytes, too long, wrong magic or type, truncated, or trailing bytes.
    """
    if not isinstance(attest, (bytes, bytearray)) or len(attest) > MAX_ATTEST:
        raise QuoteError(f"quote field 'attest' must be at most {MAX_ATTEST} bytes of TPMS_ATTEST")
    r = _Reader(bytes(attest))
    magic = r.u("I", "magic")
    if magic != TPM_GENERATED_VALUE:
        raise QuoteError(f"quote field 'attest': magic is {magic:#010x}, not TPM_GENERATED_VALUE "
                         f"{TPM_GENERATED_VALUE:#010x}; these bytes were not produced by a TPM")
    kind = r.u("H", "type")
    if kind != TPM_ST_ATTEST_QUOTE:
        raise QuoteError(f"quote field 'attest': type is {kind:#06x}, not TPM_ST_ATTEST_QUOTE (0x8018)")
    signer = r.sized("qualifiedSigner")
    extra = r.sized("extraData")
    if len(extra) > 64:
        raise QuoteError("quote field 'attest': extraData is longer than 64 bytes")
    clock, resets, restarts, safe = r.u("Q", "clock"), r.u("I", "resetCount"), r.u("I", "restartCount"), r.u("B", "safe")
    firmware = r.u("Q", "firmwareVersion")
    selection: dict[int, frozenset[int]] = {}
    for _ in range(r.u("I", "pcrSelect count")):
        alg = r.u("H", "pcrSelect hash")
        bitmap = r.take(r.u("B", "sizeofSelect"), "pcrSelect")
        if alg in selection:
            raise QuoteError(f"quote field 'attest': PCR bank {alg:#06x} is selected twice")
        selection[alg] = frozenset(8 * i + b for i, byte in enumerate(bitmap) for b in range(8) if byte >> b & 1)
    digest = r.sized("pcrDigest")
    if r.pos != len(r.data):
        raise QuoteError(f"quote field 'attest' has {len(r.data) - r.pos} trailing bytes after the TPMS_QUOTE_INFO")
    return TpmQuoteInfo(signer, extra, clock, resets, restarts, bool(safe), firmware, selection, digest)
