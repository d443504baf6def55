"""The rollback floor lives in the TEE: state.json deleted or restored cannot lower it; TEE
state missing or bound to another AK refuses to boot until re-provisioned on purpose.
Every test runs on ``sim`` and on ``tpm`` (a real swtpm)."""

from __future__ import annotations

import shutil

import pytest

from sealfl.enclave.device.boot import boot, read_device_state
from sealfl.enclave.device.policy import NothingRuns, boot_or_last_good
from sealfl.enclave.device.provision import provision
from sealfl.enclave.errors import BootError, TEEStateError
from tests.support.releases import default_payload


def _release(enclave, tmp_path, version: int):
    out = tmp_path / f"release-v{version}"
    enclave.write_release(out, default_payload(), "heart-mlp", version, {"model_file": "model.int8.onnx"})
    return out


def test_kind_deleted_or_restored_state_json_cannot_lower_the_floor(backend, trust_dir, enclave, tmp_path):
    """... and the device recovers from the floor plus the slots that verify: the newest
    release's slot is still on disk, so it runs (exit 3) and state.json is rebuilt."""
    state = tmp_path / "device"
    provision(state, backend)
    v3, v4 = _release(enclave, tmp_path, 3), _release(enclave, tmp_path, 4)
    boot(trust_dir, v3, state).close()
    old_state = (state / "state.json").read_bytes()
    with boot(trust_dir, v4, state) as dev:
        assert dev.tee.backend == backend and dev.tee.read_floor().version == 4
    good_state = (state / "state.json").read_bytes()
    # both damages on both backends would double the boots; the recovery does not depend on the backend
    for damage in (["deleted"] if backend == "sim" else ["restored from an old backup"]):
        if damage == "deleted":
            (state / "state.json").unlink()
        else:
            (state / "state.json").write_bytes(old_state)  # names v3, whose slot was removed when v4 came
        with pytest.raises(BootError) as info:
            boot(trust_dir, v3, state)
        assert (info.value.reason, info.value.check) == ("verification", "rollback")
        assert "floor kept in the device TEE (4)" in str(info.value)
        outcome = boot_or_last_good(trust_dir, v3, state)  # what `device boot` does
        with outcome.device as dev:
            assert outcome.exit_code == 3 and dev.release.version == 4  # not exit 2: the v4 slot verifies
        assert (state / "state.json").read_bytes() == good_state.replace(
            str(v4.resolve()).encode(), str(state.resolve() / read_device_state(state).last_good.slot).encode())
    boot(trust_dir, v4, state).close()  # the very same release still re-boots
    shutil.rmtree(state / "slots")
    (state / "state.json").unlink()
    with pytest.raises(NothingRuns, match="no slot in .* holds the release at the TEE floor"):
        boot_or_last_good(trust_dir, v3, state)  # nothing the floor allows is left: refused, said why


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
