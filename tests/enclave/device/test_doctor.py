"""Hardware baseline: doctor reports CPU features, memory, disk, TPM banks (a real swtpm),
execution providers; a release whose signed requirements the device cannot meet is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sealfl.attestation.errors import VerificationError
from sealfl.attestation.requirements import CPU_FEATURES, parse_requirements, unmet
from sealfl.enclave.device.boot import boot
from sealfl.enclave.device.doctor import parse_pcr_banks, profile
from sealfl.enclave.errors import BootError
from tests.support.releases import default_payload


def test_kind_doctor_reports_the_tpm_banks_and_cpu_flags(swtpm, tmp_path):
    p = profile(tmp_path)
    assert p["tpm"]["present"] and p["tpm_sha256_bank"]
    assert p["tpm"]["banks"]["sha256"] == list(range(24))
    flags = open("/proc/cpuinfo").read().split()
    assert set(p["cpu_features"]) == {f for f in CPU_FEATURES if f in flags}
    assert "CPUExecutionProvider" in p["execution_providers"] and p["memory_total_bytes"] > 0
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "device", "doctor", "--require-tpm"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert "sha256 (24 PCRs)" in out.stdout


def test_kind_no_tpm_is_reported_and_required_tpm_fails(monkeypatch, tmp_path):
    monkeypatch.setenv("SEALFL_TPM_TCTI", "swtpm:host=127.0.0.1,port=1")
    p = profile(tmp_path)
    assert not p["tpm"]["present"] and not p["tpm_sha256_bank"]
    assert unmet({"tpm_sha256_bank": True}, p) == ["a TPM with a SHA-256 PCR bank is required but none was found"]


def test_parse_pcr_banks_of_tpm2_getcap_output():
    text = "selected-pcrs:\n  - sha1: [ ]\n  - sha256: [ 0, 1, 2, 23 ]\n  - sha384: [ ]\n"
    assert parse_pcr_banks(text) == {"sha1": [], "sha256": [0, 1, 2, 23], "sha384": []}


def test_kind_unmet_requirements_refuse_boot_naming_each(trust_dir, enclave, tmp_path):
    impossible = {"min_memory_bytes": 2**61, "execution_providers": ["NoSuchExecutionProvider"],
                  "cpu_features": [f for f in CPU_FEATURES]}
    enclave.write_release(tmp_path / "r", default_payload(), "heart-mlp", 1,
                          {"model_file": "model.int8.onnx", "requirements": impossible})
    with pytest.raises(BootError) as info:
        boot(trust_dir, tmp_path / "r", tmp_path / "state", backend="sim")
    msg = str(info.value)
    assert info.value.reason == "requirements" and "min_memory_bytes" in msg and "NoSuchExecutionProvider" in msg
    assert not (tmp_path / "state" / "state.json").exists()
    enclave.write_release(tmp_path / "ok", default_payload(), "heart-mlp", 1,
                          {"model_file": "model.int8.onnx", "requirements": {"min_memory_bytes": 1,
                                                                             "execution_providers":
                                                                             ["CPUExecutionProvider"]}})
    boot(trust_dir, tmp_path / "ok", tmp_path / "state", backend="sim").close()


_WRONG = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@given(key=st.sampled_from(["cpu_features", "min_memory_bytes", "min_free_disk_bytes", "tpm_sha256_bank",
                            "execution_providers"]), value=_WRONG)
def test_kind_every_requirements_field_with_a_wrong_type_names_the_field(key, value):
    good = {"cpu_features": ["avx2"], "min_memory_bytes": 5, "min_free_disk_bytes": 5, "tpm_sha256_bank": True,
            "execution_providers": ["CPUExecutionProvider"]}
    try:
        parse_requirements({key: value})
    except VerificationError as exc:
        assert exc.check == "requirements" and key in str(exc)
        return
    # accepted only if the value is of the right shape
    assert type(value) is type(good[key]) or (key.startswith("min_") and isinstance(value, int))
