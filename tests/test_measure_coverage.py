"""The measurements cover the code that runs: every sealfl module a fresh process has
loaded after importing the device boot path (or the release enclave's key holder and
what it imports to decrypt, bound and step) is in the measured list, so changing any of
them changes the PCR value a quote reports and the secrets sealed to it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sealfl.enclave.measure import DEVICE_RUNTIME_MODULES, RELEASE_ENCLAVE_MODULES

#: what the key holder imports lazily when it decrypts (keyholder.py)
_KEYHOLDER_USES = "sealfl.common.codecs, sealfl.common.decrypted, sealfl.common.server_opt, sealfl.common.framed"


def _loaded(imports: str) -> list[str]:
    code = (f"import sys, json\nimport {imports}\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'sealfl' or m.startswith('sealfl.'))))")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    return json.loads(out.stdout.strip().splitlines()[-1])


def _as_measured(module: str) -> str:
    """Package modules are listed as ``pkg.__init__``."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    return f"{module}.__init__" if spec is not None and spec.submodule_search_locations is not None else module


@pytest.mark.parametrize("imports, measured", [
    ("sealfl.enclave.device, sealfl.enclave.serve, sealfl.enclave.llm_runtime", DEVICE_RUNTIME_MODULES),
    (f"sealfl.enclave.keyholder, {_KEYHOLDER_USES}", RELEASE_ENCLAVE_MODULES),
], ids=["device", "release-enclave"])
def test_every_loaded_sealfl_module_is_measured(imports, measured):
    loaded = [_as_measured(m) for m in _loaded(imports)]
    assert loaded, "nothing loaded?"
    missing = sorted(set(loaded) - set(measured))
    assert missing == [], f"loaded but not measured: {missing}"
