"""Every TEE backend (``sim`` and ``tpm`` on a real swtpm) passes the same tests.

Expected values come from hashlib (TPM 2.0 Part 1 §17 extend, §18.5 pcrDigest) and, for
``tpm`` quotes, from OpenSSL-independent parsing of the TPM's own signed TPMS_ATTEST.
"""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from sealfl.attestation.errors import DeviceStateError, PolicyError, QuoteError, VerificationError
from sealfl.attestation.quote import qualifying_data, verify_quote
from sealfl.attestation.tee_floor import FloorRecord
from sealfl.attestation.tpm_attest import parse_quote_attest
from sealfl.enclave.errors import TEEError, TEEStateError, UnsealError
from sealfl.enclave.tee.backends import create_tee, load_tee

M1 = hashlib.sha256(b"code v1").digest()
M2 = hashlib.sha256(b"code v2").digest()
ZERO = b"\0" * 32


def _ext(old: bytes, d: bytes) -> bytes:
    return hashlib.sha256(old + d).digest()


def test_kind_extend_equals_hashlib_replay(backend, tmp_path):
    tee = create_tee(backend, tmp_path / "tee")
    tee = load_tee(backend, tmp_path / "tee")  # a reboot: PCRs 16 and 23 at zero
    assert tee.read([16, 23]) == {16: ZERO, 23: ZERO}
    tee.extend(16, M1)
    tee.extend(16, M2)
    tee.extend(23, M1)
    assert tee.read([16, 23]) == {16: _ext(_ext(ZERO, M1), M2), 23: _ext(ZERO, M1)}
    for bad in (24, -1, True):
        with pytest.raises(TEEError):
            tee.extend(bad, M1)
    with pytest.raises(TEEError):
        tee.extend(16, b"short")


def test_kind_quote_fresh_passes_replayed_or_wrong_nonce_fails(backend, tmp_path):
    tee = create_tee(backend, tmp_path / "tee")
    tee = load_tee(backend, tmp_path / "tee")
    tee.extend(16, M1)
    nonce = bytes(range(32))
    quote = json.loads(json.dumps(tee.quote("challenge", nonce, [16, 23])))
    expected = {16: _ext(ZERO, M1).hex(), 23: ZERO.hex()}
    verify_quote(quote, tee.ak_public_key(), "challenge", nonce, expected)
    with pytest.raises(QuoteError, match="nonce"):  # replayed to a new challenge
        verify_quote(quote, tee.ak_public_key(), "challenge", b"\x07" * 32, expected)
    with pytest.raises((QuoteError, PolicyError)):  # presented for another purpose
        verify_quote(quote, tee.ak_public_key(), "release", nonce, expected)
    with pytest.raises(PolicyError, match="PCR 16"):
        verify_quote(quote, tee.ak_public_key(), "challenge", nonce, {16: _ext(ZERO, M2).hex()})
    forged = dict(quote, pcrs={"16": _ext(ZERO, M2).hex(), "23": ZERO.hex()})
    with pytest.raises(QuoteError):
        verify_quote(forged, tee.ak_public_key(), "challenge", nonce, {})
    other = create_tee("sim", tmp_path / "other")
    with pytest.raises(QuoteError, match="signature"):
        verify_quote(quote, other.ak_public_key(), "challenge", nonce, expected)


def test_kind_tpm_quote_json_agrees_with_signed_attest(swtpm, tmp_path):
    tee = create_tee("tpm", tmp_path / "tee")
    tee.extend(23, M1)
    nonce = b"n" * 20
    quote = tee.quote("challenge", nonce, [16, 23])
    info = parse_quote_attest(base64.b64decode(quote["attest"]))
    assert info.extra_data == qualifying_data("challenge", nonce)
    from Crypto.Util.asn1 import DerSequence

    s = int(DerSequence().decode(base64.b64decode(quote["signature"]))[1])
    assert s <= 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551 // 2  # stored in its low-S form
    assert info.selection == {0x000B: frozenset({16, 23})}
    assert info.pcr_digest == hashlib.sha256(bytes.fromhex(quote["pcrs"]["16"]) + _ext(ZERO, M1)).digest()
    for field, value in (("nonce", "00" * 32), ("pcr_digest", "11" * 32), ("pcrs", {"23": _ext(ZERO, M1).hex()})):
        with pytest.raises(QuoteError):
            verify_quote(dict(quote, **{field: value}), tee.ak_public_key(), "challenge", nonce, {})
    truncated = base64.b64encode(base64.b64decode(quote["attest"])[:-3]).decode()
    with pytest.raises(QuoteError, match="attest"):
        verify_quote(dict(quote, attest=truncated), tee.ak_public_key(), "challenge", nonce, {})


def test_kind_seal_unseal_bound_to_pcr_policy(backend, tmp_path):
    tee = create_tee(backend, tmp_path / "tee")
    tee = load_tee(backend, tmp_path / "tee")
    tee.extend(16, M1)
    secret = b"top secret " * 40  # longer than a TPM sealed object can hold
    blob = tee.seal(secret, tee.read([16]))
    assert b"top secret" not in blob
    assert tee.unseal(blob) == secret
    assert tee.unseal(tee.seal(b"no policy")) == b"no policy"
    tampered = bytearray(blob)
    tampered[-1] ^= 1
    with pytest.raises(UnsealError):
        tee.unseal(bytes(tampered))
    tee.extend(16, M2)
    with pytest.raises(UnsealError, match="PCR"):
        tee.unseal(blob)
    tee = load_tee(backend, tmp_path / "tee")  # reboot, same measurement again: unseals
    tee.extend(16, M1)
    assert tee.unseal(blob) == secret


def test_kind_floor_only_rises_and_is_bound_to_the_ak(backend, tmp_path):
    tee = create_tee(backend, tmp_path / "tee")
    rec = tee.read_floor()
    assert rec == FloorRecord(tee.ak_keyid())
    tee.write_floor(rec.raised(3, "ab" * 32))
    assert tee.read_floor().version == 3
    with pytest.raises(TEEError, match="lower"):
        tee.write_floor(FloorRecord(tee.ak_keyid(), 2, "cd" * 32))
    with pytest.raises(VerificationError, match="rollback"):
        tee.read_floor().check(2, "cd" * 32)
    with pytest.raises(VerificationError, match="rollback"):
        tee.read_floor().check(3, "cd" * 32)
    tee.read_floor().check(3, "ab" * 32)
    tee.read_floor().check(4, "cd" * 32)
    with pytest.raises(DeviceStateError, match="state was replaced"):
        tee.read_floor().check_owner("00" * 32)


def test_kind_state_dir_reused_or_missing_is_refused(backend, tmp_path):
    create_tee(backend, tmp_path / "tee")
    with pytest.raises(TEEStateError):
        create_tee(backend, tmp_path / "tee")
    with pytest.raises(TEEStateError):
        load_tee(backend, tmp_path / "empty")


def test_kind_tpm_reprovision_keeps_floor_and_old_state_is_refused(swtpm, tmp_path):
    tee = create_tee("tpm", tmp_path / "a")
    tee.write_floor(tee.read_floor().raised(5, "ab" * 32))
    with pytest.raises(TEEStateError, match="another device state.*--force"):
        create_tee("tpm", tmp_path / "b")  # another state would take the TPM's AK over
    assert not (tmp_path / "b").exists()
    load_tee("tpm", tmp_path / "a")  # untouched
    new = create_tee("tpm", tmp_path / "b", replace=True)  # wiping tee/ and provisioning again, on purpose
    assert new.ak_keyid() != tee.ak_keyid()
    assert new.read_floor() == FloorRecord(new.ak_keyid(), 5, "ab" * 32)
    with pytest.raises(TEEStateError, match="another key"):
        load_tee("tpm", tmp_path / "a")
