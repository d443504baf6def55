"""A release encrypted at rest (AES-256-GCM) boots only with the key the broker releases to
the device's attested state; without a broker, or refused by policy, it does not boot."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from sealfl.attestation import encrypted_files as atrest
from sealfl.attestation import hpke_wrap as wrap
from sealfl.attestation.eventlog import POLICY_SCHEMA, parse_policy
from sealfl.attestation.quote import KEY_REQUEST_PURPOSE
from sealfl.enclave import measurement as _measure
from sealfl.enclave.device.boot import boot, boot_last_good
from sealfl.enclave.device.evidence import evidence, measure_config
from sealfl.enclave.device.provision import provision
from sealfl.enclave.errors import BootError
from sealfl.enclave.keybroker.broker import KeyBroker
from tests.support.releases import MODEL_FILE, default_payload, make_onnx_model, sample_inputs


def _in_process_source(broker: KeyBroker):
    """The broker protocol without HTTP (the HTTP path is tested in test_kbs.py)."""
    import base64

    def source(tee, state_root):
        nonce = broker.challenge()
        pair = wrap.new_request_key()
        pub = wrap.public_bytes(pair)
        ev = evidence(tee, state_root, wrap.binding(bytes.fromhex(nonce), pub), KEY_REQUEST_PURPOSE)
        reply = broker.release_key({"nonce": nonce, "public_key": base64.b64encode(pub).decode(),
                                    "ak_keyid": tee.ak_keyid(), "evidence": ev})
        return reply["release_root"], wrap.unwrap(pair, reply["release_root"], base64.b64decode(reply["enc"]),
                                                  base64.b64decode(reply["wrapped_key"]))
    return source


def test_kind_encrypted_release_boots_only_with_a_released_key(backend, trust_dir, enclave, tmp_path):
    payload, key, meta = atrest.encrypt_payload(default_payload(), [MODEL_FILE])
    assert make_onnx_model() not in payload[MODEL_FILE + ".enc"]
    rel = tmp_path / "release-enc"
    enclave.write_release(rel, payload, "heart-mlp", 3, {"model_file": MODEL_FILE + ".enc", **meta})
    state = tmp_path / "device"
    tee = provision(state, backend)
    with pytest.raises(BootError) as info:  # no broker: verified, but no key
        boot(trust_dir, rel, state)
    assert info.value.reason == "key" and "--key-broker" in str(info.value)
    from sealfl.attestation.reader import load_release
    from sealfl.attestation.trust import load_trust_anchors

    root = load_release(rel, load_trust_anchors(trust_dir)).root_digest
    doc = {"schema": POLICY_SCHEMA, "backends": [backend], "runtime_code": [_measure.measure_device_runtime().hex()],
           "config": [measure_config(trust_dir).hex()], "release_root": [root]}
    ak = tee.ak_public_key()
    with boot(trust_dir, rel, state, key_source=_in_process_source(KeyBroker(parse_policy(doc), [ak],
                                                                                 {root: key}))) as dev:
        x = sample_inputs(4)
        want = ort.InferenceSession(make_onnx_model(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(dev.predict(x), want)
    refusing = KeyBroker(parse_policy({**doc, "config": ["00" * 32]}), [ak], {root: key})
    with pytest.raises(BootError) as info:  # the device state is not the approved one: no key
        boot_last_good(trust_dir, state, key_source=_in_process_source(refusing))
    assert info.value.reason == "key" and "config" in str(info.value)
    wrong_key = KeyBroker(parse_policy(doc), [ak], {root: atrest.new_key()})
    with pytest.raises(BootError, match="does not decrypt"):
        boot_last_good(trust_dir, state, key_source=_in_process_source(wrong_key))


def test_kind_decrypted_file_that_is_no_self_contained_onnx_is_refused(trust_dir, enclave, tmp_path):
    payload, key, meta = atrest.encrypt_payload({**default_payload(), MODEL_FILE: b"not onnx at all"}, [MODEL_FILE])
    rel = tmp_path / "release-enc"
    enclave.write_release(rel, payload, "heart-mlp", 3, {"model_file": MODEL_FILE + ".enc", **meta})
    from sealfl.attestation.reader import load_release
    from sealfl.attestation.trust import load_trust_anchors

    root = load_release(rel, load_trust_anchors(trust_dir)).root_digest
    with pytest.raises(BootError) as info:
        boot(trust_dir, rel, tmp_path / "device", key_source=lambda tee, state_root: (root, key), backend="sim")
    assert info.value.reason == "key" and "onnx" in str(info.value)
