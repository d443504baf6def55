"""Release provenance: signed by the release enclave, bound to the release's root digest,
every field typed; the round log's digests and partners are what the aggregator committed."""

from __future__ import annotations

import base64
import copy
import hashlib
import json

import pytest

from sealfl.attestation import keys
from sealfl.attestation.errors import ProvenanceError
from sealfl.attestation.provenance import PREDICATE_TYPE, verify_provenance
from sealfl.attestation.release import load_trust_anchors, read_release_dir, verify_release
from tests.support.releases import MODEL_FILE, default_payload

A1, A2 = hashlib.sha256(b"aggregate 1").hexdigest(), hashlib.sha256(b"aggregate 2").hexdigest()


def predicate() -> dict:
    return {"consortium": {"name": "heart", "context_id": "ab" * 16, "partners": ["A", "B"]},
            "campaign": {"id": "camp", "config_sha256": "00" * 32},
            "he": {"codec": "bfv", "params": {"scheme": "BFV"}, "public_params_sha256": "11" * 32},
            "rounds": [{"round": 1, "aggregate_sha256": A1, "partners": ["A", "B"]},
                       {"round": 2, "aggregate_sha256": A2, "partners": ["A"]}],
            "decrypted_aggregate": {"round": 2, "sha256": A2},
            "optimizer": {"name": "fedavg", "settings": {"lr": 1.0}},
            "gate": {"fp32_pooled_test": 0.8125, "int8_pooled_test": 0.8, "max_drop": 0.02},
            "export": {"format": "onnx"}, "quantization": {"weights": "int8"}, "sealfl_version": "0.1.0"}


@pytest.fixture
def with_provenance(enclave, tmp_path):
    out = tmp_path / "release-prov"
    enclave.write_release(out, default_payload(), "heart-mlp", 4, {"model_file": MODEL_FILE}, predicate())
    return read_release_dir(out)


def _statement(files) -> dict:
    return json.loads(base64.b64decode(json.loads(files["provenance.dsse.json"])["payload"]))


def test_provenance_is_signed_bound_to_the_root_digest_and_names_the_enclave(with_provenance, trust_dir, enclave):
    trust = load_trust_anchors(trust_dir)
    verified = verify_release(with_provenance, trust)  # model.sig covers provenance.dsse.json too
    assert "provenance.dsse.json" in verified.documents
    prov = verify_provenance(with_provenance["provenance.dsse.json"], trust.release_public_keys, name="heart-mlp",
                             root_digest=verified.root_digest)
    statement = _statement(with_provenance)
    assert statement["predicateType"] == PREDICATE_TYPE == "https://sealfl.dev/provenance/v1"
    assert statement["subject"] == [{"name": "heart-mlp", "digest": {"sha256": verified.root_digest}}]
    # the enclave wrote its own measurement and the version, whatever the caller passed
    assert prov.measurement == {"16": enclave.measurement[16]} and prov.predicate["version"] == 4
    assert prov.predicate["release_enclave"]["backend"] == "sim"
    assert [r["aggregate_sha256"] for r in prov.rounds] == [A1, A2]
    assert isinstance(prov.predicate["version"], int) and prov.predicate["gate"]["fp32_pooled_test"] == 0.8125


def test_provenance_of_another_release_or_key_is_refused(with_provenance, trust_dir):
    trust = load_trust_anchors(trust_dir)
    data = with_provenance["provenance.dsse.json"]
    with pytest.raises(ProvenanceError, match="another release's"):
        verify_provenance(data, trust.release_public_keys, name="heart-mlp", root_digest="22" * 32)
    with pytest.raises(ProvenanceError, match="subject\\[0\\].name"):
        verify_provenance(data, trust.release_public_keys, name="other",
                          root_digest=_statement(with_provenance)["subject"][0]["digest"]["sha256"])
    with pytest.raises(ProvenanceError, match="no DSSE signature verifies"):
        verify_provenance(data, [keys.generate_key().public_key()], name="heart-mlp", root_digest="22" * 32)


@pytest.mark.parametrize("edit,field", [
    (lambda p: p["rounds"][1].update(round=1), "rounds[1].round"),
    (lambda p: p["rounds"][0].update(aggregate_sha256="XY"), "rounds[0].aggregate_sha256"),
    (lambda p: p["rounds"][0].update(partners=[]), "rounds[0].partners"),
    (lambda p: p.update(version=3.0), "version"),
    (lambda p: p["decrypted_aggregate"].pop("sha256"), "decrypted_aggregate.sha256"),
    (lambda p: p["release_enclave"]["measurement"].update({"16": "zz"}), "release_enclave.measurement"),
])
def test_a_provenance_field_of_the_wrong_type_is_refused_naming_it(with_provenance, trust_dir, enclave, edit, field):
    from sealfl.attestation.canonical import canonical_json
    from sealfl.attestation.dsse import sign_envelope

    statement = _statement(with_provenance)
    bad = copy.deepcopy(statement)
    edit(bad["predicate"])
    data = canonical_json(sign_envelope(canonical_json(bad), "application/vnd.in-toto+json", enclave._key))
    trust = load_trust_anchors(trust_dir)
    with pytest.raises(ProvenanceError) as info:
        verify_provenance(data, trust.release_public_keys, name="heart-mlp",
                          root_digest=statement["subject"][0]["digest"]["sha256"])
    assert field in str(info.value)
