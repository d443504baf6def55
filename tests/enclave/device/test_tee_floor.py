"""The rollback floor lives in the TEE: state.json deleted or restored cannot lower it; TEE
state missing or bound to another AK refuses to boot until re-provisioned on purpose.
Every test runs on ``sim`` and on ``tpm`` (a real swtpm)."""

from __future__ import annotations

import shutil

import pytest

from sealfl.enclave.device.boot import boot
from sealfl.enclave.device.provision import provision
from sealfl.enclave.errors import BootError, TEEStateError
from tests.support.releases import default_payload


def _release(enclave, tmp_path, version: int):
    out = tmp_path / f"release-v{version}"
    enclave.write_release(out, default_payload(), "heart-mlp", version, {"model_file": "model.int8.onnx"})
    return out


def test_kind_deleted_or_restored_state_json_cannot_lower_the_floor(backend, trust_dir, enclave, tmp_path):
    state = tmp_path / "device"
    provision(state, backend)
    v3, v4 = _release(enclave, tmp_path, 3), _release(enclave, tmp_path, 4)
    boot(trust_dir, v3, state).close()
    old_state = (state / "state.json").read_bytes()
    with boot(trust_dir, v4, state) as dev:
        assert dev.tee.backend == backend and dev.tee.read_floor().version == 4
    (state / "state.json").unlink()  # deleted
    with pytest.raises(BootError) as info:
        boot(trust_dir, v3, state)
    assert (info.value.reason, info.value.check) == ("verification", "rollback")
    assert "floor kept in the device TEE (4)" in str(info.value)
    (state / "state.json").write_bytes(old_state)  # restored from an old backup
    with pytest.raises(BootError) as info:
        boot(trust_dir, v3, state)
    assert info.value.check == "rollback"
    boot(trust_dir, v4, state).close()  # the very same release still re-boots


def test_kind_missing_tee_state_refuses_until_reprovisioned(backend, trust_dir, enclave, tmp_path):
    state = tmp_path / "device"
    provision(state, backend)
    v3, v4 = _release(enclave, tmp_path, 3), _release(enclave, tmp_path, 4)
    boot(trust_dir, v4, state).close()
    shutil.rmtree(state / "tee")
    for rel in (v3, v4):
        with pytest.raises(BootError) as info:
            boot(trust_dir, rel, state)
        assert info.value.reason == "tee-state" and "--force" in str(info.value)
    assert not (state / "tee").exists()  # no attestation key was created silently
    with pytest.raises(TEEStateError):
        provision(state, backend)  # a used device is re-provisioned only on purpose
    provision(state, backend, force=True)
    with pytest.raises(BootError) as info:  # the floor survived re-provisioning
        boot(trust_dir, v3, state)
    assert info.value.check == "rollback"
    boot(trust_dir, v4, state).close()


def test_kind_tee_floor_of_another_ak_refuses_boot(backend, trust_dir, enclave, tmp_path):
    state, other = tmp_path / "device", tmp_path / "other"
    provision(state, backend)
    v3 = _release(enclave, tmp_path, 3)
    boot(trust_dir, v3, state).close()
    provision(other, backend, force=True)  # on tpm: taking the TPM's AK over, on purpose
    if backend == "sim":  # a sealed record from another device's TEE cannot be unsealed here
        shutil.copy(other / "tee" / "floor.seal", state / "tee" / "floor.seal")
    # on tpm, provisioning `other` on the same TPM (--force) replaced the AK: state's tee/ is foreign now
    with pytest.raises(BootError) as info:
        boot(trust_dir, v3, state)
    assert info.value.reason == "tee-state" and "re-provision" in str(info.value)
