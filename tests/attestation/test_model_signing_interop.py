"""model.sig interop with the real OpenSSF ``model_signing`` package (1.1), both ways.

* its ``verify key`` (the CLI, a separate process) accepts a sealfl release with the trust
  directory's ``release-signing.pub`` and refuses it after one flipped byte in any file;
* a directory signed by its ``sign key`` with the release key verifies with sealfl's
  :func:`verify_model_signature` (even with the high-S signatures ``cryptography`` makes), and
  sealfl's release verification refuses it naming what sealfl demands more (the enclave's
  signed manifest and attestation).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sealfl.attestation import keys
from sealfl.attestation.errors import SignatureError, VerificationError
from sealfl.attestation.model_sig import key_hint, verify_model_signature
from sealfl.attestation.release import load_release, load_trust_anchors, verify_release
from tests.support.releases import MODEL_FILE, default_payload, resigned_model_sig


def _ms_verify(model_dir: Path, public_key: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", str(model_dir), "--signature",
                           str(model_dir / "model.sig"), "--public_key", str(public_key)],
                          capture_output=True, text=True, timeout=120)


def _ms_sign(model_dir: Path, private_key: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "model_signing", "sign", "key", str(model_dir), "--signature",
                           str(model_dir / "model.sig"), "--private_key", str(private_key)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _release_key_file(enclave, tmp_path: Path) -> Path:
    """The release key as PKCS#8 PEM under tmp_path (a test stands in for the enclave)."""
    path = tmp_path / "release-key.pem"
    path.write_bytes(keys.private_key_to_pem(enclave._key))
    return path


def test_model_signing_verify_key_accepts_a_sealfl_release_and_refuses_a_flipped_byte(release_dir, trust_dir,
                                                                                       tmp_path):
    pub = trust_dir / "release-signing.pub"
    done = _ms_verify(release_dir, pub)
    assert done.returncode == 0 and "Verification succeeded" in done.stdout, done.stdout + done.stderr
    for name in (MODEL_FILE, "attestation.json", "manifest.json"):
        copy = tmp_path / f"flipped-{name}"
        shutil.copytree(release_dir, copy)
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (copy / name).write_bytes(bytes(data))
        refused = _ms_verify(copy, pub)
        assert refused.returncode != 0, name
        out = refused.stdout + refused.stderr
        assert "Hash mismatch for" in out and name in out.split("Hash mismatch for", 1)[1][:40], out


def test_model_signing_verify_key_refuses_another_key(release_dir, tmp_path):
    other = tmp_path / "other.pub"
    other.write_bytes(keys.public_key_to_pem(keys.generate_key()))
    assert _ms_verify(release_dir, other).returncode != 0


def test_a_directory_signed_by_model_signing_verifies_as_a_signature_and_is_refused_as_a_release(
        enclave, trust_dir, tmp_path):
    model = tmp_path / "signed-by-model-signing"
    model.mkdir()
    for name, data in default_payload().items():
        (model / name).write_bytes(data)
    _ms_sign(model, _release_key_file(enclave, tmp_path))
    trust = load_trust_anchors(trust_dir)
    signed = verify_model_signature((model / "model.sig").read_bytes(), trust.release_public_keys)
    # the files and digests it signs, recomputed here with hashlib
    assert signed.files == {name: hashlib.sha256(data).hexdigest() for name, data in default_payload().items()}
    assert signed.name == model.name and signed.keyid == keys.keyid(enclave.release_public_key)
    # its root digest: SHA-256 over the raw digests in name order (model_signing's definition)
    raw = b"".join(hashlib.sha256(default_payload()[n]).digest() for n in sorted(default_payload()))
    assert signed.root_digest == hashlib.sha256(raw).hexdigest()
    with pytest.raises(VerificationError) as info:
        load_release(model, trust)
    err = info.value
    assert (err.file, err.check) == ("manifest.dsse.json", "missing-file")
    assert "model.sig verifies with the pinned release key" in str(err) and "attestation.json" in str(err)
    # signed by a key the device does not pin: neither accepted nor described as valid
    with pytest.raises(SignatureError, match="hint"):
        verify_model_signature((model / "model.sig").read_bytes(), [keys.generate_key().public_key()])


def test_our_key_hint_is_model_signings(enclave, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "w.bin").write_bytes(b"weights")
    _ms_sign(model, _release_key_file(enclave, tmp_path))
    bundle = json.loads((model / "model.sig").read_bytes())
    assert bundle["verificationMaterial"]["publicKey"]["hint"] == key_hint(enclave.release_public_key)


def _with_signature(sig_file: bytes, signature: bytes) -> bytes:
    bundle = json.loads(sig_file)
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(signature).decode()
    return json.dumps(bundle).encode()


def test_a_high_s_signature_in_model_sig_verifies(release_files, trust_dir):
    """cryptography (model_signing's signer) does not normalise s: (r, n - s) is accepted in
    model.sig, where the signed statement, not the signature's bytes, is the identity."""
    sig = base64.b64decode(json.loads(release_files["model.sig"])["dsseEnvelope"]["signatures"][0]["sig"])
    r_len = sig[3]
    r = int.from_bytes(sig[4:4 + r_len], "big")
    s = int.from_bytes(sig[6 + r_len:], "big")
    high = keys.P256_ORDER - s

    def der(v: int) -> bytes:
        body = v.to_bytes((v.bit_length() + 8) // 8, "big")
        return b"\x02" + bytes([len(body)]) + body
    body = der(r) + der(high)
    high_sig = b"\x30" + bytes([len(body)]) + body
    assert keys.signature_problem(high_sig) is not None  # sealfl's own signatures refuse it
    trust = load_trust_anchors(trust_dir)
    verify_release({**release_files, "model.sig": _with_signature(release_files["model.sig"], high_sig)}, trust)


def test_model_sig_that_omits_or_misstates_a_file_is_refused_naming_it(release_files, trust_dir, enclave):
    trust = load_trust_anchors(trust_dir)
    without = {k: v for k, v in release_files.items() if k != "labels.json"}
    sig = resigned_model_sig(without, enclave._key)  # signs every file but labels.json
    with pytest.raises(VerificationError) as info:
        verify_release({**release_files, "model.sig": sig}, trust)
    assert (info.value.file, info.value.check) == ("model.sig", "model-signature")
    assert "missing from model.sig: 'labels.json'" in str(info.value)
    other = resigned_model_sig({**release_files, "attestation.json": b"{}"}, enclave._key)
    with pytest.raises(VerificationError) as info:
        verify_release({**release_files, "model.sig": other}, trust)
    assert info.value.check == "model-signature" and "'attestation.json' has sha256" in str(info.value)
    stranger = resigned_model_sig(release_files, keys.generate_key())  # right files, wrong key
    with pytest.raises(VerificationError) as info:
        verify_release({**release_files, "model.sig": stranger}, trust)
    assert info.value.check == "model-signature" and "not pinned" in str(info.value)
    flipped = bytearray(base64.b64decode(json.loads(release_files["model.sig"])["dsseEnvelope"]["payload"]))
    flipped[-5] ^= 0x01
    bundle = json.loads(release_files["model.sig"])
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(bytes(flipped)).decode()
    with pytest.raises(VerificationError) as info:
        verify_release({**release_files, "model.sig": json.dumps(bundle).encode()}, trust)
    assert info.value.check == "model-signature" and "no signature verifies" in str(info.value)


def test_a_release_without_model_sig_is_refused(release_files, trust_dir):
    files = {k: v for k, v in release_files.items() if k != "model.sig"}
    with pytest.raises(VerificationError) as info:
        verify_release(files, load_trust_anchors(trust_dir))
    assert (info.value.file, info.value.check) == ("model.sig", "missing-file")


def test_trust_dir_release_signing_pub_must_be_a_pinned_key(trust_dir):
    from sealfl.attestation.errors import TrustAnchorError

    assert keys.load_public_key((trust_dir / "release-signing.pub").read_bytes())
    (trust_dir / "release-signing.pub").write_bytes(keys.public_key_to_pem(keys.generate_key()))
    with pytest.raises(TrustAnchorError, match="release-signing.pub"):
        load_trust_anchors(trust_dir)


@given(cut=st.integers(min_value=0, max_value=4000), flip=st.integers(min_value=0, max_value=4000),
       junk=st.binary(max_size=64))
@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_kind_any_damaged_model_sig_raises_only_signature_error(release_files, trust_dir, cut, flip, junk):
    """Hypothesis: model.sig truncated, with a flipped byte or junk appended: SignatureError, nothing else."""
    trust = load_trust_anchors(trust_dir)
    data = bytearray(release_files["model.sig"])
    for damaged in (bytes(data[:cut % len(data)]), bytes(data) + junk,
                    bytes(data[:flip % len(data)] + bytes([data[flip % len(data)] ^ 0x20]) + data[flip % len(data) + 1:])):
        try:
            verify_model_signature(damaged, trust.release_public_keys)
        except SignatureError:
            pass
