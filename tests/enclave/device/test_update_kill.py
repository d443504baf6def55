"""A/B update survives a kill between every pair of steps (on ``sim`` and on a real swtpm):
the device still boots a good release afterwards, with the right rollback floor.

Steps of an update (:mod:`sealfl.enclave.device.slots`, then the TEE floor): new slot written ->
renamed into place -> ``state.json`` replaced -> old slots removed -> floor raised. The CLI
``device boot`` of v4 is paused at each step by a test pause point
(:mod:`sealfl.common.testpoints`) and SIGKILLed there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sealfl.common.testpoints import ENV_DIR, ENV_STAGE, event_path
from sealfl.enclave.device.boot import boot, boot_last_good, read_device_state
from sealfl.enclave.device.provision import provision
from sealfl.enclave.errors import BootError
from tests.support.releases import default_payload, sample_inputs

REPO = str(Path(__file__).resolve().parents[3])
#: stage -> the version the device runs after a kill there
STAGES = {"slot-written": 3, "slot-renamed": 3, "state-written": 4, "slots-pruned": 4}


def _kill_at(stage: str, args: list, tmp_path: Path) -> None:
    pause = tmp_path / f"pause-{stage}"
    pause.mkdir()
    env = dict(os.environ, **{ENV_STAGE: stage, ENV_DIR: str(pause)})
    env["PYTHONPATH"] = os.pathsep.join([REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.Popen([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        end = time.monotonic() + 240
        while not os.path.exists(event_path(stage, pause)):
            assert proc.poll() is None, f"boot ended before {stage}: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < end, f"{stage} not reached within 240 s"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_kind_kill_between_update_steps_still_boots_a_good_release(stage, backend, trust_dir, enclave, tmp_path):
    state = tmp_path / "device"
    provision(state, backend)
    rel = {}
    for v in (3, 4):
        rel[v] = tmp_path / f"release-v{v}"
        enclave.write_release(rel[v], default_payload(), "heart-mlp", v, {"model_file": "model.int8.onnx"})
    boot(trust_dir, rel[3], state).close()
    _kill_at(stage, ["device", "boot", "--release", rel[4], "--trust", trust_dir, "--state", state], tmp_path)

    want = STAGES[stage]
    assert read_device_state(state).last_good.version == want
    with boot_last_good(trust_dir, state) as dev:  # a good model boots from its own slot
        assert dev.release.version == want
        assert dev.predict(sample_inputs(2)).shape == (2, 1)
        assert dev.tee.read_floor().version == want  # the TEE floor caught up
    slots = sorted(p.name for p in (state / "slots").iterdir() if not p.name.startswith(".tmp"))
    assert any(s.startswith(f"v{want}-") for s in slots)
    if want == 4:
        with pytest.raises(BootError) as info:
            boot(trust_dir, rel[3], state)
        assert info.value.check == "rollback"
    with boot(trust_dir, rel[4], state) as dev:  # the interrupted update completes on retry
        assert dev.release.version == 4
    assert [p.name for p in (state / "slots").iterdir()] == [read_device_state(state).last_good.slot.split("/")[1]]
