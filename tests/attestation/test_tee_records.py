"""Pure parsers of TEE data, against every byte string: the floor record and a TPM quote's
TPMS_ATTEST raise only their package error; valid ones round-trip (layouts from TPM 2.0
Part 2 and the module docstrings, rebuilt here with struct)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sealfl.attestation.errors import DeviceStateError, QuoteError
from sealfl.attestation.tee_floor import FLOOR_RECORD_SIZE, FloorRecord
from sealfl.attestation.tpm_attest import parse_quote_attest


@given(st.binary(max_size=200))
def test_kind_any_bytes_as_floor_record_parse_or_raise_device_state_error(data):
    try:
        rec = FloorRecord.from_bytes(data)
    except DeviceStateError:
        return
    assert len(data) == FLOOR_RECORD_SIZE and rec.to_bytes() == data or rec.version is None


@given(st.binary(max_size=300))
def test_kind_any_bytes_as_tpms_attest_parse_or_raise_quote_error(data):
    try:
        parse_quote_attest(data)
    except QuoteError:
        pass


@given(version=st.one_of(st.none(), st.integers(0, 2**31 - 1)), keyid=st.binary(min_size=32, max_size=32),
       stmt=st.binary(min_size=32, max_size=32))
def test_kind_floor_record_round_trips(version, keyid, stmt):
    rec = FloorRecord(keyid.hex(), version, None if version is None else stmt.hex())
    assert FloorRecord.from_bytes(rec.to_bytes()) == rec


def _attest(extra: bytes, pcrs: list[int], digest: bytes, trailing: bytes = b"") -> bytes:
    bitmap = bytearray(3)
    for i in pcrs:
        bitmap[i // 8] |= 1 << (i % 8)
    return (struct.pack(">IH", 0xFF544347, 0x8018) + struct.pack(">H", 4) + b"name"
            + struct.pack(">H", len(extra)) + extra + struct.pack(">QIIB", 5, 1, 2, 1) + struct.pack(">Q", 7)
            + struct.pack(">IHB", 1, 0x000B, 3) + bytes(bitmap) + struct.pack(">H", len(digest)) + digest + trailing)


def test_tpms_attest_fields_and_every_truncation():
    blob = _attest(b"\x01" * 32, [16, 23], b"\x02" * 32)
    info = parse_quote_attest(blob)
    assert (info.extra_data, info.selection, info.pcr_digest) == (b"\x01" * 32, {0x000B: frozenset({16, 23})},
                                                                  b"\x02" * 32)
    assert (info.clock, info.reset_count, info.restart_count, info.safe, info.firmware_version) == (5, 1, 2, True, 7)
    for n in range(len(blob)):
        with pytest.raises(QuoteError):
            parse_quote_attest(blob[:n])
    with pytest.raises(QuoteError, match="trailing"):
        parse_quote_attest(_attest(b"x", [16], b"\x02" * 32, b"\0"))
    with pytest.raises(QuoteError, match="magic"):
        parse_quote_attest(b"\0" * 4 + blob[4:])
