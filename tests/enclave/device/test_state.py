"""The device's trusted state: one typed object with pure transitions (DeviceState), and
crash-consistent storage (slots + state.json) checked by injecting an I/O error at every
step of a state change in turn."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from sealfl.attestation.device_state import STATE_SCHEMA, STATE_SCHEMA_V1, DeviceState, LastGood
from sealfl.attestation.errors import DeviceStateError
from sealfl.attestation.release import load_release, load_trust_anchors
from sealfl.enclave.device import slots
from sealfl.enclave.device import tabular_boot as device  # where the tabular runtime is started
from sealfl.enclave.device.boot import boot, boot_last_good, read_device_state
from sealfl.enclave.errors import BootError
from tests.support.releases import MODEL_FILE, default_payload, sample_inputs

H1, H2 = "1" * 64, "2" * 64


def _last(version=3, statement=H1, slot="slots/v3-a") -> LastGood:
    return LastGood("heart-mlp", version, H2, statement, slot, "/src/release", MODEL_FILE)


# -- pure transitions ------------------------------------------------------------------


def test_kind_state_round_trips_through_bytes():
    state = DeviceState(_last())
    assert DeviceState.from_bytes(state.to_bytes()) == state
    with pytest.raises(DeviceStateError):
        DeviceState().to_bytes()  # a fresh device has no state.json at all
    doc = json.loads(DeviceState(_last()).to_bytes())
    assert doc == {"schema": STATE_SCHEMA, "last_good": {
        "name": "heart-mlp", "version": 3, "root_digest": H2, "statement_digest": H1, "slot": "slots/v3-a",
        "source_dir": "/src/release", "model_file": MODEL_FILE}}


def test_kind_version_one_state_is_still_read():
    v1 = {"schema": STATE_SCHEMA_V1, "last_good": {"name": "heart-mlp", "version": 5, "root_digest": H2,
                                                   "release_dir": "slots/" + "ab" * 32, "source_dir": "/x",
                                                   "model_file": MODEL_FILE}}
    state = DeviceState.from_bytes(json.dumps(v1).encode())
    assert state.last_good == LastGood("heart-mlp", 5, H2, None, "slots/" + "ab" * 32, "/x", MODEL_FILE)
    assert state.floor == 5


def test_kind_accept_moves_the_floor_and_never_lowers_it():
    fresh = DeviceState()
    assert fresh.floor is None
    one = fresh.accept(name="n", version=3, root_digest=H2, statement_digest=H1, slot="slots/a", source_dir="/s",
                       model_file=MODEL_FILE)
    assert one.floor == 3 and fresh.last_good is None  # immutable: a new object
    again = one.accept(name="n", version=3, root_digest=H2, statement_digest=H1, slot="slots/b", source_dir="/s",
                       model_file=MODEL_FILE)
    assert again.last_good.slot == "slots/b"
    for version, statement in ((2, H1), (3, "3" * 64)):
        with pytest.raises(DeviceStateError):
            one.accept(name="n", version=version, root_digest=H2, statement_digest=statement, slot="slots/c",
                       source_dir="/s", model_file=MODEL_FILE)
    for bad in (2**31, -1, True, 3.0):
        with pytest.raises(DeviceStateError):
            fresh.accept(name="n", version=bad, root_digest=H2, statement_digest=H1, slot="slots/c",
                         source_dir="/s", model_file=MODEL_FILE)


@pytest.mark.parametrize("field, value, named", [
    ("version", 2**31, "last_good.version"),
    ("version", 2**62, "last_good.version"),
    ("version", "3", "last_good.version"),
    ("slot", "../../etc", "last_good.slot"),
    ("slot", "/var/lib/other", "last_good.slot"),
    ("slot", "slots/../x", "last_good.slot"),
    ("statement_digest", "XYZ", "last_good.statement_digest"),
    ("model_file", "../model.onnx", "last_good.model_file"),
    ("extra", 1, "last_good.extra"),
])
def test_kind_malformed_state_fields_are_named(field, value, named):
    doc = json.loads(DeviceState(_last()).to_bytes())
    doc["last_good"][field] = value
    with pytest.raises(DeviceStateError) as info:
        DeviceState.from_bytes(json.dumps(doc).encode())
    assert "state.json" in str(info.value) and repr(named) in str(info.value)


def test_kind_unreadable_state_is_a_boot_error_naming_the_file(tmp_path):
    (tmp_path / "state.json").write_text('{"schema": "sealfl.device-state/v2", "last_good": [["sim"]]}')
    with pytest.raises(BootError) as info:
        read_device_state(tmp_path)
    assert info.value.reason == "state" and "state.json" in str(info.value) and "'last_good'" in str(info.value)


# -- crash consistency -------------------------------------------------------------------


class _InProcessRuntime:
    """Stands in for SandboxedRuntime in the fault loop: the same model bytes in an in-process
    onnxruntime session (the child process is tested in test_enclave_runtime.py)."""

    def __init__(self, model_bytes: bytes | None, **_options) -> None:
        if model_bytes is not None:
            self.load(model_bytes)

    @classmethod
    def prestart(cls, **options) -> "_InProcessRuntime":
        return cls(None, **options)

    def stage(self, model_bytes: bytes) -> None:
        pass  # nothing crosses a pipe here: load() gets the bytes

    def load(self, model_bytes: bytes) -> "_InProcessRuntime":
        self._session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
        self.inputs = [{"name": i.name, "shape": i.shape, "type": i.type} for i in self._session.get_inputs()]
        self.input_names = [i["name"] for i in self.inputs]
        self.output_names = [o.name for o in self._session.get_outputs()]
        return self

    def health_check(self) -> dict:
        return {"ok": True}

    def run(self, feed):
        return self._session.run(self.output_names, dict(feed))

    def close(self) -> None:
        pass


_STEPS = ("open", "write", "fsync", "rename", "replace", "mkdir", "fchmod", "chmod", "unlink", "rmdir")


class _Injector:
    """Counts the file-system steps of a state change; raises OSError(EIO) at step ``fail_at``."""

    def __init__(self, monkeypatch, fail_at: int | None) -> None:
        self.fail_at, self.count, self.armed, self.failed = fail_at, 0, False, None
        for name in _STEPS:
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))
        real_commit = slots.commit

        def armed_commit(*args, **kwargs):
            self.armed = True
            try:
                return real_commit(*args, **kwargs)
            finally:
                self.armed = False

        monkeypatch.setattr(slots, "commit", armed_commit)

    def _wrap(self, name, real):
        def step(*args, **kwargs):
            if self.armed:
                self.count += 1
                if self.count == self.fail_at:
                    self.failed = f"{name}({args[0]!r})"
                    raise OSError(errno.EIO, f"injected I/O error at step {self.count}: {name}")
            return real(*args, **kwargs)
        return step


def _assert_consistent(trust_dir: Path, state_dir: Path, allowed_statements: set[str]) -> None:
    state = read_device_state(state_dir)
    assert state.last_good is not None
    slot = state_dir / state.last_good.slot
    assert slot.is_dir(), f"state.json names {state.last_good.slot}, which does not exist"
    verified = load_release(slot, load_trust_anchors(trust_dir), state=state)
    assert verified.statement_digest == state.last_good.statement_digest in allowed_statements
    x = sample_inputs(2)
    with boot_last_good(trust_dir, state_dir) as dev:
        assert dev.release.statement_digest == state.last_good.statement_digest
        expected = ort.InferenceSession(verified.payload[MODEL_FILE], providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]
        np.testing.assert_array_equal(dev.predict(x), expected)


@pytest.mark.parametrize("scenario", ["same-release-again", "newer-release"])
def test_kind_every_state_change_step_can_fail_and_last_good_survives(trust_dir, release_dir, enclave, tmp_path,
                                                                      monkeypatch, scenario):
    """The issue's input: booting the same release again deleted its slot before the new copy
    was in place, so an I/O error then left state.json pointing at nothing. Now every step of a
    state change (write, fsync, rename, replace, remove) is made to fail in turn, and after
    each failure state.json names an existing, verifiable slot that boot_last_good boots."""
    monkeypatch.setattr(device, "SandboxedRuntime", _InProcessRuntime)
    base = tmp_path / "base-device"
    boot(trust_dir, release_dir, base, backend="sim").close()
    first = read_device_state(base).last_good.statement_digest
    target = release_dir
    if scenario == "newer-release":
        target = tmp_path / "release-v4"
        enclave.write_release(target, default_payload(), "heart-mlp", 4, {"model_file": MODEL_FILE})
    counter = _Injector(monkeypatch, fail_at=None)
    probe = tmp_path / "probe-device"
    shutil.copytree(base, probe)
    boot(trust_dir, target, probe, backend="sim").close()
    steps = counter.count
    second = read_device_state(probe).last_good.statement_digest
    if scenario == "same-release-again":  # identified by its signed statement: nothing is rewritten at all
        assert steps == 0 and second == first
        assert (probe / "state.json").read_bytes() == (base / "state.json").read_bytes()
        assert sorted(p.name for p in (probe / "slots").iterdir()) == sorted(p.name for p in (base / "slots").iterdir())
        return
    assert steps >= 20  # slot dir, 5 files x (open, write, fsync), renames, state.json, removal of the old slot
    failures = []
    for fail_at in range(1, steps + 1):
        state_dir = tmp_path / f"device-{fail_at}"
        shutil.copytree(base, state_dir)
        injector = _Injector(monkeypatch, fail_at=fail_at)
        try:
            boot(trust_dir, target, state_dir, backend="sim").close()
        except BootError as exc:
            assert exc.reason == "state" and "injected I/O error" in str(exc)
        assert injector.failed, f"step {fail_at} was not reached"
        injector.armed = False
        monkeypatch.undo()  # real file system again for the checks
        monkeypatch.setattr(device, "SandboxedRuntime", _InProcessRuntime)
        _assert_consistent(trust_dir, state_dir, {first, second})
        failures.append(injector.failed)
    assert len(failures) == steps
    # a clean boot afterwards leaves exactly one slot: stale copies from failed attempts are pruned
    state_dir = tmp_path / f"device-{steps}"
    boot(trust_dir, target, state_dir, backend="sim").close()
    assert [p.name for p in (state_dir / "slots").iterdir()] == [Path(read_device_state(state_dir).last_good.slot).name]
