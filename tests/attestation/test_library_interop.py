"""sealfl's canonical JSON / DSSE / in-toto code against securesystemslib and in-toto-attestation.

Where the libraries do the same job the bytes agree (so releases interoperate with tools that
use them); where sealfl keeps its own code, these tests pin the reason (issue 21, item 2):

* DSSE: the PAE is byte-identical and securesystemslib verifies sealfl's envelopes; but its
  decoder accepts URL-safe and non-canonical Base64, its verifier needs a matching keyid
  (model_signing's envelopes carry ``keyid: ""``) and accepts high-S signatures -- one
  signed release would have many envelope texts.
* canonical JSON: securesystemslib's OLPC form refuses floats, and a release's signed
  metadata holds the gate's accuracies.
* in-toto Statement: in-toto-attestation holds the predicate in a protobuf ``Struct``, so the
  version and file sizes come back as floats -- the statement would no longer parse as one.
"""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from google.protobuf import json_format
from in_toto_attestation.v1.statement import Statement
from in_toto_attestation.v1.statement_pb2 import Statement as StatementPB
from securesystemslib._internal.utils import b64dec
from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import FormatError as SslibFormatError
from securesystemslib.formats import encode_canonical
from securesystemslib.signer import CryptoSigner, SSlibKey

from sealfl.attestation import keys
from sealfl.attestation.canonical import b64decode_strict
from sealfl.attestation.dsse import pae, verify_envelope
from sealfl.attestation.errors import FormatError, SignatureError, StatementError
from sealfl.attestation.release import load_trust_anchors
from sealfl.attestation.statement import PAYLOAD_TYPE, parse_statement


def _sslib_key(public_key) -> SSlibKey:
    """securesystemslib's key for a sealfl public key, under sealfl's keyid."""
    crypto = load_pem_public_key(keys.public_key_to_pem(public_key))
    return SSlibKey.from_crypto(crypto, keyid=keys.keyid(public_key))


@pytest.mark.parametrize("payload_type,payload", [(PAYLOAD_TYPE, b'{"a":1}'), ("t", b""),
                                                   ("application/ü+json", "ü\n\x00".encode())])
def test_pae_is_securesystemslibs(payload_type, payload):
    assert pae(payload_type, payload) == Envelope(payload, payload_type, {}).pae()


def test_securesystemslib_verifies_a_sealfl_release_envelope(release_files, trust_dir):
    trust = load_trust_anchors(trust_dir)
    envelope = json.loads(release_files["manifest.dsse.json"])
    ours = verify_envelope(envelope, trust.release_public_keys, expected_payload_type=PAYLOAD_TYPE)
    theirs = Envelope.from_dict(json.loads(release_files["manifest.dsse.json"]))
    accepted = theirs.verify([_sslib_key(k) for k in trust.release_public_keys], 1)
    assert list(accepted) == [keys.keyid(trust.release_public_keys[0])] and theirs.payload == ours


def test_a_securesystemslib_envelope_verifies_with_sealfl_in_its_low_s_form_only():
    signer = CryptoSigner.generate_ecdsa()
    public = keys.load_public_key(signer.public_key.keyval["public"].encode())
    envelope = Envelope(b'{"x":1}', PAYLOAD_TYPE, {})
    sig = bytes.fromhex(envelope.sign(signer).signature)
    low = keys.canonical_signature(sig)
    r_len = low[3]
    r, s = int.from_bytes(low[4:4 + r_len], "big"), int.from_bytes(low[6 + r_len:], "big")
    high_body = b"".join(b"\x02" + bytes([len(b)]) + b for b in
                         (v.to_bytes((v.bit_length() + 8) // 8, "big") for v in (r, keys.P256_ORDER - s)))
    high = b"\x30" + bytes([len(high_body)]) + high_body

    def as_dict(signature: bytes) -> dict:
        return {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(envelope.payload).decode(),
                "signatures": [{"keyid": keys.keyid(public), "sig": base64.b64encode(signature).decode()}]}

    assert verify_envelope(as_dict(low), [public]) == envelope.payload
    with pytest.raises(SignatureError, match="high S"):
        verify_envelope(as_dict(high), [public])
    for form in (low, high):  # securesystemslib takes both spellings of one signature
        Envelope.from_dict(as_dict(form)).verify([_sslib_key(public)], 1)


@pytest.mark.parametrize("text", ["aGl=", "-_-_"])  # non-zero pad bits; URL-safe alphabet
def test_securesystemslib_base64_accepts_texts_sealfl_refuses(text):
    assert b64dec(text)
    with pytest.raises(FormatError):
        b64decode_strict(text, "test field")


def test_securesystemslib_canonical_json_refuses_the_release_metadata_floats():
    metadata = {"model_file": "m.onnx", "accuracy": {"fp32_pooled_test": 0.8125, "max_drop": 0.02}}
    with pytest.raises(SslibFormatError):
        encode_canonical(metadata)


def test_in_toto_attestation_validates_a_sealfl_statement_but_turns_its_ints_into_floats(release_files):
    payload = base64.b64decode(json.loads(release_files["manifest.dsse.json"])["payload"])
    pb = json_format.ParseDict(json.loads(payload), StatementPB())
    Statement.copy_from_pb(pb).validate()  # a valid in-toto Statement v1
    round_trip = json_format.MessageToJson(pb).encode()
    assert json.loads(round_trip)["predicate"]["version"] == 3.0
    assert isinstance(json.loads(round_trip)["predicate"]["version"], float)
    assert parse_statement(payload).version == 3
    with pytest.raises(StatementError, match="predicate.version"):
        parse_statement(round_trip)
