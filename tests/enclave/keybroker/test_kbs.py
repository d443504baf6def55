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


def _wait_listening(proc, port: int, deadline_s: float = 60.0) -> None:
    """Until the broker ``proc`` accepts connections on ``port`` (a deadline, not a delay)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < end, f"kbs did not listen within {deadline_s:g} s"
            time.sleep(0.05)


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
                             "--ak", str(ak_pem), "--keys", str(keys), "--port", str(port),
                             "--forwarded-allow-ips", "127.0.0.1",  # as behind a reverse proxy on this host
                             "--challenge-rate", "0.01"],  # no token comes back during the test, however slow it runs
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_listening(proc, port)
        url = f"http://127.0.0.1:{port}"
        import httpx

        flood = [httpx.post(url + "/challenge", headers={"X-Forwarded-For": "203.0.113.9"}, timeout=60)
                 for _ in range(12)]  # one client (as the proxy forwards it) floods
        assert [r.status_code for r in flood] == [200] * 8 + [429] * 4  # its burst, then 429s
        assert flood[-1].json()["check"] == "rate" and int(flood[-1].headers["Retry-After"]) >= 1
        assert request_key(url, state) == (root, key)  # another client is served as if nothing happened
        (state / "eventlog.json").write_bytes((state / "eventlog.json").read_bytes().replace(root.encode(), b"0" * 64))
        with pytest.raises(KeyRequestRefused):
            request_key(url, state)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.parametrize("backend", ["sim"], indirect=True)  # the bounds do not depend on the TEE
def test_kind_a_challenge_flood_cannot_crowd_out_a_genuine_challenge(backend, device):
    """One client asks for 10,000 challenges: it gets its burst, then 429s with a time to
    retry -- and the genuine device's unexpired challenge stays valid. Many clients together
    hit the total bound: refused too, and still nothing issued is evicted."""
    from sealfl.enclave.keybroker.broker import ChallengeLimits

    state, ak, root, policy = device
    clock = Clock()
    broker = KeyBroker(policy, [ak], {root: b"k" * 32},
                       limits=ChallengeLimits(ttl_s=60, per_client=16, total=100, rate_per_s=2, burst=8), clock=clock)
    genuine = broker.challenge("10.0.0.2")
    refused, retry = 0, set()
    for _ in range(10_000):
        try:
            broker.challenge("10.0.0.9")
        except KeyRequestRefused as exc:
            assert exc.check == "rate"
            refused += 1
            retry.add(exc.retry_after_s)
    assert refused == 10_000 - 8 and retry == {1}  # the burst, then one token per 0.5 s: retry after 1 s
    clock.t += 30  # tokens come back; the per-client bound holds what is left unused
    for _ in range(8):
        broker.challenge("10.0.0.9")
    with pytest.raises(KeyRequestRefused, match="16 unused challenges are outstanding") as info:
        clock.t += 10
        broker.challenge("10.0.0.9")
    assert info.value.retry_after_s == 20  # when its oldest expires (issued at t=1000, ttl 60, now 1040)
    for i in range(100):  # many clients: the total bound
        try:
            broker.challenge(f"10.1.{i // 250}.{i % 250}")
        except KeyRequestRefused as exc:
            assert "outstanding challenges" in str(exc) and exc.check == "rate"
    assert broker.outstanding() == 100
    assert broker.outstanding("10.0.0.2") == 1  # nothing evicted the genuine one
    pair = wrap.new_request_key()
    pub = wrap.public_bytes(pair)
    ev = attest_device(state, wrap.binding(bytes.fromhex(genuine), pub), purpose=KEY_REQUEST_PURPOSE)
    out = broker.release_key({"nonce": genuine, "public_key": base64.b64encode(pub).decode(),
                              "ak_keyid": keyid(ak), "evidence": ev})
    assert wrap.unwrap(pair, root, base64.b64decode(out["enc"]), base64.b64decode(out["wrapped_key"])) == b"k" * 32


def test_kind_a_private_key_given_as_a_device_ak_is_named_as_such(tmp_path):
    import json

    from sealfl.attestation.keys import generate_key, private_key_to_pem
    from sealfl.enclave.errors import KeyBrokerError
    from sealfl.enclave.keybroker.server import load_broker

    policy, keys, priv = tmp_path / "policy.json", tmp_path / "keys.json", tmp_path / "ak.pem"
    policy.write_text(json.dumps({"schema": POLICY_SCHEMA, "backends": ["tpm"], "runtime_code": [], "config": [],
                                  "release_root": []}))
    keys.write_text(json.dumps({"ab" * 32: base64.b64encode(b"k" * 32).decode()}))
    keys.chmod(0o600)
    priv.write_bytes(private_key_to_pem(generate_key()))  # the operator copied the wrong file
    with pytest.raises(KeyBrokerError, match=r"--ak .*ak\.pem: holds a PRIVATE key, not a public key"):
        load_broker(policy, [priv], keys)


def _self_signed(tmp_path):
    """A CA-less self-signed certificate for 127.0.0.1 (cryptography), as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sealfl key broker")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_pem, key_pem = tmp_path / "kbs.crt", tmp_path / "kbs.key"
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    key_pem.chmod(0o600)
    return cert_pem, key_pem


@pytest.mark.parametrize("backend", ["sim"], indirect=True)
def test_kind_a_broker_beyond_loopback_speaks_only_tls_and_devices_fetch_keys_over_it(backend, device, tmp_path,
                                                                                     monkeypatch):
    import json

    state, ak, root, policy = device
    ak_pem = tmp_path / "ak.pem"
    ak_pem.write_bytes(device_public_key(state))
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps({"schema": POLICY_SCHEMA, "backends": ["sim"],
                                       "runtime_code": list(policy.runtime_code), "config": list(policy.config),
                                       "release_root": [root]}))
    key = atrest.new_key()
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({root: base64.b64encode(key).decode()}))
    keys.chmod(0o600)
    base = [sys.executable, "-m", "sealfl.platform.cli", "kbs", "serve", "--policy", str(policy_file), "--ak",
            str(ak_pem), "--keys", str(keys)]
    plain = subprocess.run([*base, "--host", "0.0.0.0", "--port", str(_free_port())], capture_output=True, text=True,
                           timeout=120)
    assert plain.returncode == 1 and "--tls-cert" in plain.stderr  # never clear text beyond loopback
    cert, tls_key = _self_signed(tmp_path)
    port = _free_port()
    proc = subprocess.Popen([*base, "--port", str(port), "--tls-cert", str(cert), "--tls-key", str(tls_key)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_listening(proc, port)
        import httpx

        with pytest.raises(httpx.ConnectError):  # the certificate is not one the system trusts
            httpx.post(f"https://127.0.0.1:{port}/challenge", timeout=30)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the device trusts the broker's CA
        assert request_key(f"https://127.0.0.1:{port}", state) == (root, key)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
