"""A device installs only onnxruntime, pycryptodome and numpy: the verify/boot path and
the CLI must not import torch, TenSEAL or Flower."""

import subprocess
import sys

HEAVY = ("torch", "tenseal", "flwr", "ray")


def _imported_after(code: str) -> set[str]:
    probe = code + "\nimport sys\nprint(' '.join(sorted(m for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_device_path_imports_no_training_stack():
    mods = _imported_after(
        "import sealfl.enclave.device, sealfl.enclave.verify_cli, sealfl.attestation.release, sealfl.platform.cli")
    assert "sealfl.enclave.device" in mods  # the probe did import the device path
    assert not {m for m in mods if m.split(".")[0] in HEAVY}


def test_cli_help_lists_every_persona():
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for cmd in ("consortium", "campaign", "release", "partner", "device", "verify", "demo"):
        assert cmd in out
