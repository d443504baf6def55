"""The real base model through the whole path, once: SmolLM2-135M-Instruct (the pinned
GGUF), the four manuals of the Python documentation, one encrypted federated LoRA round
(one local step per partner) on Ray, the INT4/INT8 release with the partners' gate, and
``sealfl device generate`` in a separate process. Slow (minutes); needs ``make llm-deps``
(the GGUF package and python3-doc), which ``make`` installs."""

import json
import math
import subprocess
import sys

import pytest

from sealfl.clients.causal_lm.base import BASE_MODEL, locate_base_gguf
from sealfl.enclave.device.verify import verify_dir
from sealfl.platform.llm.demo import run_llm_demo

pytestmark = pytest.mark.slow


def test_kind_real_model_one_round_release_and_device_generate(tmp_path):
    assert locate_base_gguf().stat().st_size == BASE_MODEL.size
    # One AdamW step at the demo's lr 4e-3 moves every adapter entry by ~lr at once (Adam's
    # first step is sign-like): that one-step model sat at INT8 perplexity ratio 1.048-1.054
    # here, at the gate's 1.05, where a CPU with other int8 kernels could fall either side.
    # A smoke run's model must sit well inside the gate, so it takes a small step.
    report = run_llm_demo(tmp_path / "llm-out", rounds=1, local_steps=1, eval_blocks=2, lr=5e-4)
    saved = json.loads((tmp_path / "llm-out" / "report.json").read_text())
    assert saved["release"]["root_digest"] == report["release"]["root_digest"]
    for key in ("partners", "perplexity_before", "perplexity_after", "per_partner", "gate", "sample", "time"):
        assert key in saved, key
    assert saved["partners"] == ["tutorial", "howto", "faq", "reference"]
    assert all(math.isfinite(v["perplexity_before"]) and math.isfinite(v["perplexity_after"])
               for v in saved["per_partner"].values())
    assert saved["release"]["int4_bytes"] <= 350 * 10**6
    assert all(g["passed"] for g in saved["gate"].values())
    assert saved["sample"]["answer"].strip()
    # the same device answered through its OpenAI-compatible API (device serve)
    chat = saved["chat"]
    assert chat["question"] and chat["answer"].strip() and chat["finish_reason"] in ("stop", "length")
    assert chat["usage"]["prompt_tokens"] > 10 and 1 <= chat["usage"]["completion_tokens"] <= 96
    assert chat["server_exit_code"] == 143  # stopped by SIGTERM, as the interruption rules say
    assert saved["server_has_secret_key"] is False
    assert saved["device"]["peak_rss_bytes"] <= 1.2 * 2**30
    # sealfl verify accepts the release (library and CLI)
    v = verify_dir(saved["trust"]["dir"], saved["release"]["dir"])
    assert v.metadata["runtime"] == "onnx-causal-lm/v1" and set(v.metadata["variants"]) == {"int4", "int8"}
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "verify", "--trust", saved["trust"]["dir"],
                          saved["release"]["dir"]], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
