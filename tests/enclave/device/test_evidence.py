"""Measured boot and remote attestation on ``sim`` and ``tpm`` (a real swtpm): PCRs equal
the event-log replay; fresh evidence verifies; a replayed quote, a wrong nonce, a runtime
file changed after boot, a tampered event log and a release outside the policy fail."""

from __future__ import annotations

import copy
import hashlib

import pytest

from sealfl.attestation.errors import PolicyError, QuoteError
from sealfl.attestation.eventlog import POLICY_SCHEMA, parse_eventlog, parse_policy, replay, verify_evidence
from sealfl.attestation.keys import load_public_key
from sealfl.enclave import measurement as _measure
from sealfl.enclave.device.boot import boot
from sealfl.enclave.device.evidence import attest_device, measure_config, read_events
from sealfl.enclave.device.provision import provision


def _policy(trust_dir, root_digest: str, backend: str, runtime: bytes | None = None):
    return parse_policy({"schema": POLICY_SCHEMA, "backends": [backend],
                         "runtime_code": [(runtime or _measure.measure_device_runtime()).hex()],
                         "config": [measure_config(trust_dir).hex()], "release_root": [root_digest]})


@pytest.fixture
def booted(backend, trust_dir, release_dir, tmp_path):
    state = tmp_path / "device"
    ak = load_public_key(provision(state, backend).public_key())
    with boot(trust_dir, release_dir, state) as dev:
        pcrs = {i: v.hex() for i, v in dev.tee.read([16, 23]).items()}
        root = dev.release.root_digest
    return state, ak, pcrs, root


def test_kind_pcrs_equal_the_event_log_replay(booted, backend, trust_dir):
    state, _, pcrs, root = booted
    events = read_events(state)
    assert [e.type for e in events] == ["runtime-code", "config", "release-root"]
    assert replay(events) == pcrs
    # independent recomputation with hashlib
    p16 = b"\0" * 32
    for d in (_measure.measure_device_runtime(), measure_config(trust_dir)):
        p16 = hashlib.sha256(p16 + d).digest()
    assert pcrs == {16: p16.hex(), 23: hashlib.sha256(b"\0" * 32 + bytes.fromhex(root)).hexdigest()}


def test_kind_fresh_evidence_verifies_replayed_or_wrong_nonce_fails(booted, backend, trust_dir):
    state, ak, _, root = booted
    policy = _policy(trust_dir, root, backend)
    nonce = bytes(range(32))
    ev = attest_device(state, nonce)
    assert verify_evidence(ev, ak, nonce, policy).release_root == root
    with pytest.raises(QuoteError, match="nonce"):  # the same evidence replayed to a new challenge
        verify_evidence(ev, ak, b"\x09" * 32, policy)
    second = attest_device(state, b"\x09" * 32)  # a second attestation in the same boot also verifies
    verify_evidence(second, ak, b"\x09" * 32, policy)


def test_kind_runtime_file_changed_after_boot_fails(booted, backend, trust_dir, tmp_path, monkeypatch):
    state, ak, _, root = booted
    policy = _policy(trust_dir, root, backend)  # the allowed values: the code as released
    real = _measure._index
    changed = tmp_path / "changed_device.py"
    changed.write_bytes(real()["sealfl.enclave.device.boot"].read_bytes() + b"\n# patched after boot\n")
    monkeypatch.setattr(_measure, "_index", lambda: {**real(), "sealfl.enclave.device.boot": changed})
    nonce = b"\x05" * 16
    ev = attest_device(state, nonce)
    with pytest.raises(PolicyError, match="changed after boot"):
        verify_evidence(ev, ak, nonce, policy)


def test_kind_tampered_event_log_or_policy_mismatch_fails(booted, backend, trust_dir):
    state, ak, _, root = booted
    nonce = b"\x01" * 32
    ev = attest_device(state, nonce)
    policy = _policy(trust_dir, root, backend)
    forged = copy.deepcopy(ev)
    forged["eventlog"]["events"][2]["digest"] = "ab" * 32  # claim another release
    with pytest.raises(QuoteError, match="does not replay to the quoted PCR 23.*forged"):
        verify_evidence(forged, ak, nonce, _policy(trust_dir, "ab" * 32, backend))  # even a policy that allows it
    appended = copy.deepcopy(ev)  # the case: a forged event appended; said to be a replay failure
    appended["eventlog"]["events"].append({**appended["eventlog"]["events"][2], "digest": "cd" * 32})
    with pytest.raises(QuoteError, match="does not replay to the quoted PCR 23") as info:
        verify_evidence(appended, ak, nonce, policy)
    assert "policy" not in str(info.value)
    dropped = copy.deepcopy(ev)
    del dropped["eventlog"]["events"][1]
    with pytest.raises(QuoteError, match="does not replay to the quoted PCR 16"):
        verify_evidence(dropped, ak, nonce, policy)
    with pytest.raises(PolicyError, match="release_root"):
        verify_evidence(ev, ak, nonce, _policy(trust_dir, "cd" * 32, backend))
    with pytest.raises(PolicyError, match="backend"):
        verify_evidence(ev, ak, nonce, parse_policy({**_policy_doc(trust_dir, root), "backends": ["other"]}))


def _policy_doc(trust_dir, root):
    return {"schema": POLICY_SCHEMA, "backends": ["sim", "tpm"],
            "runtime_code": [_measure.measure_device_runtime().hex()],
            "config": [measure_config(trust_dir).hex()], "release_root": [root]}


@pytest.mark.parametrize("field,value", [("schema", 1), ("bank", "sha1"), ("events", {}),
                                         ("events", [{"pcr": 23, "type": "runtime-code", "digest": "00" * 32,
                                                      "detail": ""}]),
                                         ("events", [{"pcr": 16, "type": "x", "digest": "00" * 32, "detail": ""}]),
                                         ("events", [{"pcr": 16, "type": "config", "digest": "0" * 63, "detail": ""}]),
                                         ("extra", 1)])
def test_kind_malformed_event_log_names_the_field(field, value):
    doc = {"schema": "sealfl.eventlog/v1", "bank": "sha256", "events": []}
    doc[field] = value
    with pytest.raises(QuoteError, match="eventlog: field"):
        parse_eventlog(doc)
