"""Device boot: good release boots and predicts; tampered/rolled-back releases are refused
without touching state.json; boot_last_good brings the last good release back."""

from __future__ import annotations

import base64
import hashlib
import json

import numpy as np
import pytest

from sealfl.attestation.quote import pcr_after, verify_quote
from sealfl.enclave.device.boot import boot, boot_last_good, read_device_state
from sealfl.enclave.device.evidence import measure_config
from sealfl.enclave.device.verify import verify_dir
from sealfl.enclave.errors import BootError
from sealfl.enclave.measurement import measure_device_runtime
from tests.support.releases import (
    MODEL_FILE,
    default_payload,
    direct_outputs,
    make_onnx_model,
    sample_inputs,
    write_signed_release,
)


def _sandbox_children() -> list[int]:
    """Pids of this process's live children that run the sandbox child script."""
    import os

    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"sandbox/child.py" in cmd:
            out.append(int(pid))
    return out


def test_good_release_boots_and_predicts(trust_dir, release_dir, tmp_path):
    state = tmp_path / "device"
    x = sample_inputs(6)
    with boot(trust_dir, release_dir, state, backend="sim") as device:
        np.testing.assert_array_equal(device.predict(x), direct_outputs(make_onnx_model(), x))
        assert device.model_file == MODEL_FILE and device.release.version == 3
        assert _sandbox_children() == [device.runtime.pid]  # the prestarted child serves; no other
        assert device.runtime.loaded_from_stage  # the model crossed while its hash was checked
        # PCR 16 = runtime code then configuration, PCR 23 = release root digest, each extended once after reset
        root = device.release.root_digest
        pcrs = device.tee.read([16, 23])
        assert pcrs[16].hex() == pcr_after([measure_device_runtime(), measure_config(trust_dir)])
        assert pcrs[23] == hashlib.sha256(b"\0" * 32 + bytes.fromhex(root)).digest()
        quote = device.attest(b"\x07" * 32)
        verify_quote(quote, device.tee.ak_public_key(), "challenge", b"\x07" * 32, {23: pcrs[23].hex()})
    recorded = read_device_state(state).last_good
    statement = base64.b64decode(json.loads((release_dir / "manifest.dsse.json").read_bytes())["payload"])
    assert (recorded.name, recorded.version, recorded.root_digest, recorded.source_dir, recorded.model_file) == (
        "heart-mlp", 3, root, str(release_dir.resolve()), MODEL_FILE)
    assert recorded.statement_digest == hashlib.sha256(statement).hexdigest()
    assert recorded.slot.startswith("slots/v3-") and [p.name for p in (state / "slots").iterdir()] == [
        recorded.slot.split("/")[1]]
    slot = state / recorded.slot
    # the slot holds exactly the verified files, byte for byte
    assert sorted(p.name for p in slot.iterdir()) == sorted(p.name for p in release_dir.iterdir())
    for p in release_dir.iterdir():
        assert (slot / p.name).read_bytes() == p.read_bytes()


def test_tampered_new_release_refused_and_last_good_served(trust_dir, release_dir, enclave, tmp_path):
    state = tmp_path / "device"
    boot(trust_dir, release_dir, state, backend="sim").close()
    before = (state / "state.json").read_bytes()

    new_model = make_onnx_model(weights=np.array([[1.0], [1.0], [1.0], [1.0]], dtype=np.float32))
    new_dir = tmp_path / "release-v4"
    enclave.write_release(new_dir, {**default_payload(), MODEL_FILE: new_model}, "heart-mlp", 4,
                          {"model_file": MODEL_FILE})
    data = bytearray((new_dir / MODEL_FILE).read_bytes())
    data[-3] ^= 0x10
    (new_dir / MODEL_FILE).write_bytes(bytes(data))

    with pytest.raises(BootError) as info:
        boot(trust_dir, new_dir, state, backend="sim")
    err = info.value
    assert (err.reason, err.file, err.check) == ("verification", MODEL_FILE, "hash")
    # the runtime child boot prestarts while it verifies is gone with the refusal
    assert _sandbox_children() == []
    assert MODEL_FILE in str(err) and "hash" in str(err)
    assert (state / "state.json").read_bytes() == before
    assert json.loads(before)["last_good"]["source_dir"] == str(release_dir.resolve())

    # the device keeps its own copy: the last good release survives its install dir going away
    for child in release_dir.iterdir():
        child.unlink()
    release_dir.rmdir()
    x = sample_inputs(3)
    with boot_last_good(trust_dir, state) as device:
        assert device.release.version == 3
        np.testing.assert_array_equal(device.predict(x), direct_outputs(make_onnx_model(), x))


def test_newer_release_updates_state_and_rollback_is_refused(trust_dir, release_dir, enclave, tmp_path):
    state = tmp_path / "device"
    v5 = tmp_path / "release-v5"
    enclave.write_release(v5, default_payload(), "heart-mlp", 5, {"model_file": MODEL_FILE})
    boot(trust_dir, v5, state, backend="sim").close()
    assert read_device_state(state).last_good.version == 5
    with pytest.raises(BootError) as info:
        boot(trust_dir, release_dir, state, backend="sim")  # v3 after v5
    assert (info.value.file, info.value.check) == ("manifest.json", "rollback")
    assert read_device_state(state).last_good.version == 5


def test_boot_last_good_detects_replaced_directory(trust_dir, release_dir, enclave, tmp_path):
    state = tmp_path / "device"
    boot(trust_dir, release_dir, state, backend="sim").close()
    slot = state / read_device_state(state).last_good.slot
    # replace the slot's content with another validly signed release of the same version
    for child in slot.iterdir():
        child.unlink()
    slot.rmdir()
    enclave.write_release(slot, {MODEL_FILE: make_onnx_model(bias=np.array([1.0], np.float32))},
                          "heart-mlp", 3)
    with pytest.raises(BootError, match="already ran|replaced"):
        boot_last_good(trust_dir, state)


def test_boot_last_good_without_state(trust_dir, tmp_path):
    with pytest.raises(BootError) as info:
        boot_last_good(trust_dir, tmp_path / "fresh-device")
    assert info.value.reason == "state"


def test_kind_unloadable_model_is_refused_at_verification_without_recording(trust_dir, enclave, tmp_path):
    bad = write_signed_release(enclave, tmp_path / "release-bad", {"model.onnx": b"this is not onnx"}, "heart-mlp", 9)
    with pytest.raises(BootError) as info:
        boot(trust_dir, bad, tmp_path / "device", backend="sim")
    assert (info.value.reason, info.value.file, info.value.check) == ("verification", "model.onnx", "onnx")
    assert read_device_state(tmp_path / "device").last_good is None


def test_kind_model_onnxruntime_refuses_is_refused_without_recording(trust_dir, enclave, tmp_path):
    # parses as ONNX (so verification passes) but names an operator onnxruntime does not have
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], domain="sealfl.nowhere")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("sealfl.nowhere", 1)])
    bad = tmp_path / "release-bad"
    enclave.write_release(bad, {"model.onnx": model.SerializeToString()}, "heart-mlp", 9)
    with pytest.raises(BootError) as info:
        boot(trust_dir, bad, tmp_path / "device", backend="sim")
    assert info.value.reason == "runtime"
    assert read_device_state(tmp_path / "device").last_good is None


def test_verify_dir(trust_dir, release_dir):
    verified = verify_dir(trust_dir, release_dir)
    assert (verified.name, verified.version, verified.backend) == ("heart-mlp", 3, "sim")
    (release_dir / "extra.bin").write_bytes(b"x")
    with pytest.raises(Exception) as info:
        verify_dir(trust_dir, release_dir)
    assert "'extra.bin'" in str(info.value) and "'extra-file'" in str(info.value)


def test_same_model_new_version_then_refused_update_falls_back(trust_dir, enclave, tmp_path):
    """v4 and v5 carry the same model bytes (same root digest); after v5 runs, a refused
    update must bring back v5 -- not v4's copy -- even from another working directory."""
    state = tmp_path / "device"
    for v in (4, 5):
        enclave.write_release(tmp_path / f"r{v}", default_payload(), "heart-mlp", v, {"model_file": MODEL_FILE})
    boot(trust_dir, tmp_path / "r4", state, backend="sim").close()
    boot(trust_dir, tmp_path / "r5", state, backend="sim").close()
    with pytest.raises(BootError):
        boot(trust_dir, tmp_path / "r4", state, backend="sim")  # rollback
    moved = tmp_path / "moved-device"
    state.rename(moved)  # state dirs are relocatable: slot paths are relative
    with boot_last_good(trust_dir, moved) as device:
        assert device.release.version == 5


def test_same_version_with_other_content_is_refused(trust_dir, enclave, tmp_path):
    state = tmp_path / "device"
    enclave.write_release(tmp_path / "a", default_payload(), "heart-mlp", 6, {"model_file": MODEL_FILE})
    other = {**default_payload(), MODEL_FILE: make_onnx_model(bias=np.array([2.0], np.float32))}
    enclave.write_release(tmp_path / "b", other, "heart-mlp", 6, {"model_file": MODEL_FILE})
    boot(trust_dir, tmp_path / "a", state, backend="sim").close()
    boot(trust_dir, tmp_path / "a", state, backend="sim").close()  # the same release again is a plain re-boot
    with pytest.raises(BootError) as info:
        boot(trust_dir, tmp_path / "b", state, backend="sim")
    assert info.value.check == "rollback"


def test_kind_implausible_version_jump_is_refused_by_policy(enclave, tmp_path):
    trust = enclave.export_trust(tmp_path / "trust-step", max_version_step=10)
    state = tmp_path / "device"
    for v in (3, 13, 24):
        enclave.write_release(tmp_path / f"r{v}", default_payload(), "heart-mlp", v, {"model_file": MODEL_FILE})
    boot(trust, tmp_path / "r3", state, backend="sim").close()
    boot(trust, tmp_path / "r13", state, backend="sim").close()  # +10: allowed
    with pytest.raises(BootError) as info:
        boot(trust, tmp_path / "r24", state, backend="sim")  # +11
    assert (info.value.file, info.value.check) == ("manifest.json", "version")
    assert "max_version_step" in str(info.value)
    assert read_device_state(state).last_good.version == 13


def test_a_staging_failure_only_costs_time(trust_dir, release_dir, tmp_path, monkeypatch):
    """Staging ahead of verification is an optimisation: whatever it raises (here: no thread
    can be started), boot loads the verified bytes the ordinary way."""
    from sealfl.enclave.sandbox.runtime import SandboxedRuntime

    def cannot(self, model_bytes):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(SandboxedRuntime, "stage", cannot)
    x = sample_inputs(3)
    with boot(trust_dir, release_dir, tmp_path / "device", backend="sim") as device:
        assert not device.runtime.loaded_from_stage
        np.testing.assert_array_equal(device.predict(x), direct_outputs(make_onnx_model(), x))


def _rewrite_envelope(src, dst, edit) -> None:
    import shutil

    shutil.copytree(src, dst)
    env = json.loads((dst / "manifest.dsse.json").read_bytes())
    edit(env)
    (dst / "manifest.dsse.json").write_text(json.dumps(env, indent=3))


def test_kind_release_identity_is_the_signed_statement_not_the_envelope_bytes(trust_dir, release_dir, tmp_path):
    from Crypto.Util.asn1 import DerSequence

    from sealfl.enclave.device.policy import boot_or_last_good

    state = tmp_path / "device"
    boot(trust_dir, release_dir, state, backend="sim").close()
    before = (state / "state.json").read_bytes()
    slots = sorted(p.name for p in (state / "slots").iterdir())

    def high_s(env):  # (r, s) -> (r, n - s): still a valid ECDSA signature over the same statement
        seq = DerSequence().decode(base64.b64decode(env["signatures"][0]["sig"]))
        n = int("FFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551", 16)
        env["signatures"][0]["sig"] = base64.b64encode(DerSequence([int(seq[0]), n - int(seq[1])]).encode()).decode()

    def extra_entry(env):  # an unsigned extra: another signature entry, another layout
        env["signatures"].append({"keyid": "00" * 32, "sig": base64.b64encode(b"\x30\x06\x02\x01\x01\x02\x01\x01").decode()})

    _rewrite_envelope(release_dir, tmp_path / "high-s", high_s)
    outcome = boot_or_last_good(trust_dir, tmp_path / "high-s", state)
    with outcome.device:
        assert outcome.kept_last_good and outcome.refused.file == "manifest.dsse.json"
        assert "high S" in str(outcome.refused)
    _rewrite_envelope(release_dir, tmp_path / "re-wrapped", extra_entry)
    # the envelope's own signature still holds, but model.sig signs every file byte for byte: a
    # re-wrapped envelope is refused there, and the device keeps the release it runs
    outcome = boot_or_last_good(trust_dir, tmp_path / "re-wrapped", state)
    with outcome.device:
        assert outcome.kept_last_good and outcome.refused.file == "model.sig"
        assert outcome.refused.check == "model-signature" and "'manifest.dsse.json' has sha256" in str(outcome.refused)
        assert outcome.device.release.statement_digest == read_device_state(state).last_good.statement_digest
    assert (state / "state.json").read_bytes() == before  # same release: nothing renamed, nothing rewritten
    assert sorted(p.name for p in (state / "slots").iterdir()) == slots
    assert (state / read_device_state(state).last_good.slot / "manifest.dsse.json").read_bytes() == \
        (release_dir / "manifest.dsse.json").read_bytes()


def test_kind_a_fresh_device_never_runs_the_simulation_by_itself(swtpm, trust_dir, release_dir, tmp_path):
    import os
    import subprocess
    import sys

    fresh = tmp_path / "fresh"
    with pytest.raises(BootError) as info:  # a TPM is right there (SEALFL_TPM_TCTI): still no silent sim
        boot(trust_dir, release_dir, fresh)
    assert info.value.reason == "tee-state" and "sealfl device provision" in str(info.value)
    assert "--tee sim" in str(info.value) and not (fresh / "tee").exists()
    r = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "device", "boot", "-t", str(trust_dir), "-r",
                        str(release_dir), "-s", str(fresh), "--tee", "tpm"], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert r.returncode == 4 and "not provisioned" in r.stderr and not (fresh / "tee").exists()
    with boot(trust_dir, release_dir, fresh, backend="sim") as dev:  # asked for by name: tests, demos
        assert dev.tee.backend == "sim" and dev.tee.insecure
    from sealfl.enclave.device.doctor import format_profile, profile

    lines = format_profile(profile(fresh))
    assert any(ln.startswith("device TEE: sim (INSECURE simulation") for ln in lines), lines
    assert any("TPM keys of sealfl roles: none" in ln for ln in lines), lines


def test_kind_a_failed_file_operation_in_the_state_dir_is_a_boot_error(trust_dir, release_dir, enclave, tmp_path):
    import shutil

    as_file = tmp_path / "state-is-a-file"
    as_file.write_bytes(b"")
    lock_is_dir = tmp_path / "lock-is-a-dir"
    (lock_is_dir / ".lock").mkdir(parents=True)
    for state in (as_file, lock_is_dir):
        with pytest.raises(BootError) as info:  # not an OSError escaping the boot
            boot(trust_dir, release_dir, state, backend="sim")
        assert info.value.reason == "state" and str(state) in str(info.value)
    state = tmp_path / "device"
    boot(trust_dir, release_dir, state, backend="sim").close()
    before = (state / "state.json").read_bytes()
    slot = state / read_device_state(state).last_good.slot
    shutil.move(str(slot), str(tmp_path / "kept-slot"))
    (state / "slots").rmdir()
    (state / "slots").write_bytes(b"a file where the slots directory belongs")
    v5 = tmp_path / "release-v5"
    enclave.write_release(v5, default_payload(), "heart-mlp", 5, {"model_file": MODEL_FILE})
    with pytest.raises(BootError) as info:  # the new slot cannot be written
        boot(trust_dir, v5, state)
    assert info.value.reason == "state" and "slots" in str(info.value)
    assert (state / "state.json").read_bytes() == before


def test_kind_a_release_the_command_cannot_serve_is_refused_before_any_runtime_starts(trust_dir, release_dir,
                                                                                     tmp_path):
    state = tmp_path / "device"
    with pytest.raises(BootError) as info:  # `device serve` / `generate` of a tabular release
        boot(trust_dir, release_dir, state, backend="sim", require_llm=True)
    assert info.value.reason == "model" and "not a causal language model" in str(info.value)
    assert _sandbox_children() == []  # refused right after verification: no child was started, nothing recorded
    assert read_device_state(state).last_good is None
