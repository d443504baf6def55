"""Key broker: the key reaches an attested device in the approved state (``sim`` and a real
swtpm), and nothing else gets it: a runtime file changed after boot, wrong PCRs (another
release), a stale / reused / foreign nonce, a public key not bound in the quote, an
unregistered AK. AES-256-GCM at rest round-trips and refuses the wrong key or name."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from sealfl.attestation import encrypted_files as atrest
from sealfl.attestation import hpke_wrap as wrap
from sealfl.attestation.errors import AtRestError
from sealfl.attestation.eventlog import POLICY_SCHEMA, parse_policy
from sealfl.attestation.keys import keyid, load_public_key
from sealfl.attestation.quote import KEY_REQUEST_PURPOSE
from sealfl.enclave import measurement as _measure
from sealfl.enclave.device.boot import boot
from sealfl.enclave.device.evidence import attest_device, device_public_key, measure_config
from sealfl.enclave.device.kbs_client import request_key
from sealfl.enclave.device.provision import provision
from sealfl.enclave.errors import KeyRequestRefused
from sealfl.enclave.keybroker.broker import KeyBroker


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def device(backend, trust_dir, release_dir, tmp_path):
    state = tmp_path / "device"
    tee = provision(state, backend)
    with boot(trust_dir, release_dir, state) as dev:
        root = dev.release.root_digest
    policy = parse_policy({"schema": POLICY_SCHEMA, "backends": [backend],
                           "runtime_code": [_measure.measure_device_runtime().hex()],
                           "config": [measure_config(trust_dir).hex()], "release_root": [root]})
    return state, load_public_key(tee.public_key()), root, policy


def _request(state, broker, pub_for_quote=None, pub_sent=None):
    nonce = broker.challenge()
    pair = wrap.new_request_key()
    pub = wrap.public_bytes(pair)
    bound = pub_for_quote or pub
    ev = attest_device(state, wrap.binding(bytes.fromhex(nonce), bound), purpose=KEY_REQUEST_PURPOSE)
    ak = keyid(load_public_key(device_public_key(state)))
    req = {"nonce": nonce, "public_key": base64.b64encode(pub_sent or pub).decode(), "ak_keyid": ak, "evidence": ev}
    return pair, req


def test_kind_key_released_only_in_the_approved_state(device, monkeypatch, tmp_path):
    state, ak, root, policy = device
    key = atrest.new_key()
    clock = Clock()
    broker = KeyBroker(policy, [ak], {root: key}, nonce_ttl_s=30, clock=clock)
    pair, req = _request(state, broker)
    reply = broker.release_key(req)
    assert wrap.unwrap(pair, root, base64.b64decode(reply["enc"]), base64.b64decode(reply["wrapped_key"])) == key
    with pytest.raises(KeyRequestRefused) as info:  # the same request replayed: nonce consumed
        broker.release_key(req)
    assert info.value.check == "nonce"
    _, stale = _request(state, broker)
    clock.t += 31
    with pytest.raises(KeyRequestRefused) as info:
        broker.release_key(stale)
    assert info.value.check == "nonce"
    _, foreign = _request(state, broker)
    foreign["nonce"] = os.urandom(32).hex()
    with pytest.raises(KeyRequestRefused) as info:
        broker.release_key(foreign)
    assert info.value.check == "nonce"
    other = wrap.public_bytes(wrap.new_request_key())  # attacker swaps in its own key
    _, unbound = _request(state, broker, pub_sent=other)
    with pytest.raises(KeyRequestRefused) as info:
        broker.release_key(unbound)
    assert info.value.check == "evidence" and "nonce" in str(info.value)
    wrong_pcrs = KeyBroker(parse_policy({**_doc(policy), "release_root": ["ab" * 32]}), [ak], {root: key})
    _, req2 = _request(state, wrong_pcrs)
    with pytest.raises(KeyRequestRefused) as info:
        wrong_pcrs.release_key(req2)
    assert info.value.check == "policy"
    stranger = KeyBroker(policy, [], {root: key})
    _, req3 = _request(state, stranger)
    with pytest.raises(KeyRequestRefused) as info:
        stranger.release_key(req3)
    assert info.value.check == "ak"
    # one runtime file changes after boot: no key
    real = _measure._index
    changed = tmp_path / "changed.py"
    changed.write_bytes(real()["sealfl.enclave.device.slots"].read_bytes() + b"#\n")
    monkeypatch.setattr(_measure, "_index", lambda: {**real(), "sealfl.enclave.device.slots": changed})
    _, req4 = _request(state, broker)
    with pytest.raises(KeyRequestRefused) as info:
        broker.release_key(req4)
    assert info.value.check == "policy" and "changed after boot" in str(info.value)


def _doc(policy):
    return {"schema": POLICY_SCHEMA, "backends": sorted(policy.backends), "runtime_code": sorted(policy.runtime_code),
            "config": sorted(policy.config), "release_root": sorted(policy.release_root)}


@pytest.mark.parametrize("field,value", [("nonce", 5), ("public_key", "!!"), ("public_key", "AAAA"),
                                         ("ak_keyid", "xy"), ("evidence", []), ("extra", 1)])
def test_kind_malformed_key_request_is_refused_by_field(field, value):
    broker = KeyBroker(parse_policy({"schema": POLICY_SCHEMA, "backends": [], "runtime_code": [], "config": [],
                                     "release_root": []}), [], {})
    req = {"nonce": broker.challenge(), "public_key": base64.b64encode(b"\4" * 65).decode(),
           "ak_keyid": "00" * 32, "evidence": {}}
    req[field] = value
    with pytest.raises(KeyRequestRefused) as info:
        broker.release_key(req)
    assert info.value.check == "request"


def test_kind_at_rest_round_trip_and_wrong_key_or_name():
    key, data = atrest.new_key(), os.urandom(1000)
    blob = atrest.encrypt(key, "model.onnx", data)
    assert atrest.decrypt(key, "model.onnx", blob) == data and data not in blob
    for k, name in ((atrest.new_key(), "model.onnx"), (key, "other.onnx")):
        with pytest.raises(AtRestError):
            atrest.decrypt(k, name, blob)
    with pytest.raises(AtRestError):
        atrest.decrypt(key, "model.onnx", blob[:-1] + bytes([blob[-1] ^ 1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kind_kbs_server_over_http_releases_and_refuses(swtpm, trust_dir, release_dir, tmp_path):
    state = tmp_path / "device"
    ak_pem = tmp_path / "ak.pem"
    ak_pem.write_bytes(provision(state, "tpm").public_key())
    with boot(trust_dir, release_dir, state) as dev:
        root = dev.release.root_digest
    policy = tmp_path / "policy.json"
    import json
    policy.write_text(json.dumps({"schema": POLICY_SCHEMA, "backends": ["tpm"],
                                  "runtime_code": [_measure.measure_device_runtime().hex()],
                                  "config": [measure_config(trust_dir).hex()], "release_root": [root]}))
    key = atrest.new_key()
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({root: base64.b64encode(key).decode()}))
    keys.chmod(0o600)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sealfl.platform.cli", "kbs", "serve", "--policy", str(policy),
                             "--ak", str(ak_pem), "--keys", str(keys), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < end, "kbs did not listen within 60 s"
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        assert request_key(url, state) == (root, key)
        (state / "eventlog.json").write_bytes((state / "eventlog.json").read_bytes().replace(root.encode(), b"0" * 64))
        with pytest.raises(KeyRequestRefused):
            request_key(url, state)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
