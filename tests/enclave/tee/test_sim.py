"""SimTEE: PCR extend, quotes, seal/unseal bound to PCR policy, persisted state."""

from __future__ import annotations

import hashlib
import logging
import os
import stat

import pytest

from sealfl.attestation.quote import verify_quote
from sealfl.enclave.errors import TEEError, TEEStateError, UnsealError
from sealfl.enclave.tee.backends import backend_class, create_tee, load_tee
from sealfl.enclave.tee.interface import TEE
from sealfl.enclave.tee.sim import SimTEE

M1 = hashlib.sha256(b"code v1").digest()
M2 = hashlib.sha256(b"code v2").digest()


def test_extend_matches_hashlib_and_pcrs_start_at_zero(tmp_path):
    tee = SimTEE.create(tmp_path / "tee")
    assert isinstance(tee, TEE) and tee.backend == "sim" and tee.insecure
    assert tee.read(range(24)) == {i: b"\0" * 32 for i in range(24)}
    tee.extend(16, M1)
    tee.extend(16, M2)
    expected = hashlib.sha256(hashlib.sha256(b"\0" * 32 + M1).digest() + M2).digest()
    assert tee.read([16]) == {16: expected}
    with pytest.raises(TEEError):
        tee.extend(24, M1)
    with pytest.raises(TEEError):
        tee.extend(16, b"short")


def test_warns_that_it_is_insecure(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="sealfl.enclave.tee.sim"):
        SimTEE.create(tmp_path / "tee")
    assert "INSECURE" in caplog.text


def test_quote_verifies_with_its_ak(tmp_path):
    tee = SimTEE.create(tmp_path / "tee")
    tee.extend(16, M1)
    quote = tee.quote("challenge", b"\x01" * 32, [16, 23])
    verify_quote(quote, tee.ak_public_key(), "challenge", b"\x01" * 32,
                 {16: hashlib.sha256(b"\0" * 32 + M1).hexdigest(), 23: "00" * 32})


def test_seal_unseal_round_trip_and_policy(tmp_path):
    tee = SimTEE.create(tmp_path / "tee")
    tee.extend(16, M1)
    blob = tee.seal(b"top secret", tee.read([16]))
    assert b"top secret" not in blob
    assert tee.unseal(blob) == b"top secret"
    assert tee.unseal(tee.seal(b"no policy")) == b"no policy"
    tee.extend(16, M2)  # one extra extend of the policy PCR
    with pytest.raises(UnsealError, match="PCR"):
        tee.unseal(blob)


def test_unseal_refuses_tampered_or_foreign_blobs(tmp_path):
    tee, other = SimTEE.create(tmp_path / "a"), SimTEE.create(tmp_path / "b")
    blob = bytearray(tee.seal(b"secret", {16: b"\0" * 32}))
    with pytest.raises(UnsealError):
        other.unseal(bytes(blob))
    blob[-1] ^= 1
    with pytest.raises(UnsealError):
        tee.unseal(bytes(blob))
    # loosening the policy in the header breaks GCM authentication
    relaxed = bytes(tee.seal(b"secret", {16: M1})).replace(M1.hex().encode(), (b"0" * 64))
    with pytest.raises(UnsealError, match="authentication"):
        tee.unseal(relaxed)


def test_reboot_resets_pcrs_and_state_is_private(tmp_path):
    tee = create_tee("sim", tmp_path / "tee")
    tee.extend(16, M1)
    blob = tee.seal(b"s", tee.read([16]))
    same_boot = load_tee("sim", tmp_path / "tee", reset_pcrs=False)
    assert same_boot.read([16]) == tee.read([16]) and same_boot.unseal(blob) == b"s"
    rebooted = load_tee("sim", tmp_path / "tee")
    assert rebooted.read([16]) == {16: b"\0" * 32}
    assert rebooted.public_key() == tee.public_key()
    with pytest.raises(UnsealError):
        rebooted.unseal(blob)
    rebooted.extend(16, M1)  # same measured boot again -> unseals
    assert rebooted.unseal(blob) == b"s"
    for name in ("ak.pem", "seal.key"):
        assert stat.S_IMODE(os.stat(tmp_path / "tee" / name).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "tee").st_mode) == 0o700
    with pytest.raises(TEEStateError):
        SimTEE.create(tmp_path / "tee")
    os.chmod(tmp_path / "tee" / "seal.key", 0o644)
    with pytest.raises(TEEStateError, match="chmod 600"):
        SimTEE.load(tmp_path / "tee")


def test_unknown_backends():
    for name in ("sgx", "", "Sim", "sealfl.enclave.tee.sim"):
        with pytest.raises(TEEError, match="unknown"):
            backend_class(name)
    assert backend_class("sim") is SimTEE
