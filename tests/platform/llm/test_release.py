"""A causal-LM release end to end on the tiny model: merge, export, INT4/INT8, gate, canary,
sign; the device boots it and generates; tampered tokenizer, chat template or generation
settings are refused at boot; a canary this device cannot meet is refused; perplexity
equals a direct torch computation."""

import functools
import math

import numpy as np
import pytest
import torch

from sealfl.clients.causal_lm.lora import LoraSpec, n_adapter_params
from sealfl.clients.causal_lm.text import nll_sums, perplexity, token_blocks
from sealfl.enclave.device.boot import boot
from sealfl.enclave.errors import BootError
from sealfl.enclave.release.enclave import ReleaseEnclave
from sealfl.enclave.sandbox.decode import SamplingParams
from sealfl.platform.errors import ReleaseError
from sealfl.platform.llm.build import build_candidates, llm_release_files, score_candidates
from sealfl.platform.llm.gate import GateCounts, candidate_scores, check_gate, compare, reference_scores
from tests.support.llm_tiny import HEAD_DIM, TEXTS, tiny_bundle, tiny_fp32_onnx, tokenizer_json

SPEC = LoraSpec(r=4, alpha=8)
LOOSE = {"int4": {"min_top1_agreement": 0.5, "max_perplexity_ratio": 1.5},
         "int8": {"min_top1_agreement": 0.5, "max_perplexity_ratio": 1.5}}


@functools.lru_cache(maxsize=1)
def _built():
    b = tiny_bundle()
    v = np.random.default_rng(0).normal(scale=0.05, size=n_adapter_params(b.model, SPEC))
    build = build_candidates(b, SPEC, v)
    blocks = token_blocks(tokenizer_json(), TEXTS * 3, 24, eos_id=2)
    counts = score_candidates(build, blocks)
    return b, build, counts


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm-release")
    enclave = ReleaseEnclave.create(root / "enclave")
    enclave.export_trust(root / "trust")
    b, build, counts = _built()
    payload, metadata = llm_release_files(build, b, SPEC, counts, {"campaign": {"rounds": 1}}, thresholds=LOOSE)
    enclave.write_release(root / "release", payload, "tiny-llm", 1, metadata)
    return root, enclave, payload, metadata


def test_kind_llm_release_carries_every_file_and_boots_to_generate(released, tmp_path):
    root, _, payload, metadata = released
    assert set(payload) == {"model.int4.onnx", "model.int8.onnx", "tokenizer.json", "chat_template.jinja",
                            "generation_config.json"}
    assert metadata["variants"]["int4"]["gate"]["passed"] and metadata["gate"]["thresholds"] == LOOSE
    for variant in ("int4", "int8"):
        with boot(root / "trust", root / "release", tmp_path / f"state-{variant}", variant=variant, backend="sim") as dev:
            assert dev.is_llm and dev.model_file == f"model.{variant}.onnx"
            assert dev.canary_stats["agreement"] >= metadata["variants"][variant]["canary"]["min_agreement"]
            r = dev.chat([{"role": "user", "content": "What is a list?"}], SamplingParams(max_tokens=5))
            assert 1 <= r.completion_tokens <= 5 and r.prompt_tokens > 5
            with pytest.raises(BootError):
                dev.predict(np.zeros((1, 4), np.float32))


@pytest.mark.parametrize("victim", ["tokenizer.json", "chat_template.jinja", "generation_config.json",
                                    "model.int8.onnx"])
def test_kind_tampered_llm_files_are_refused_at_boot(released, tmp_path, victim):
    import shutil

    root = released[0]
    rel = tmp_path / "release"
    shutil.copytree(root / "release", rel)
    data = bytearray((rel / victim).read_bytes())
    data[len(data) // 2] ^= 0x20  # e.g. one letter of the template changes case
    (rel / victim).write_bytes(bytes(data))
    with pytest.raises(BootError) as err:
        boot(root / "trust", rel, tmp_path / "state", backend="sim")
    assert err.value.reason == "verification" and err.value.file == victim and err.value.check == "hash"


def test_kind_a_canary_this_device_cannot_meet_is_refused(released, tmp_path):
    root, enclave, payload, metadata = released
    bad = {**metadata, "variants": {**metadata["variants"]}}
    canary = dict(bad["variants"]["int4"]["canary"])
    canary["expected_top1"] = [[(t + 1) % canary["vocab"] for t in row] for row in canary["expected_top1"]]
    bad["variants"]["int4"] = {**bad["variants"]["int4"], "canary": canary}
    enclave.write_release(tmp_path / "release", payload, "tiny-llm", 2, bad)
    with pytest.raises(BootError) as err:
        boot(root / "trust", tmp_path / "release", tmp_path / "state", backend="sim")
    assert err.value.reason == "canary" and "agree" in str(err.value)


def test_kind_gate_refuses_a_variant_below_its_thresholds():
    _, _, counts = _built()
    strict = {v: {"min_top1_agreement": 1.01, "max_perplexity_ratio": 9} for v in counts}
    with pytest.raises(ReleaseError, match="top-1 agreement"):
        check_gate(counts, strict)
    worse = {"int4": GateCounts(100, 99, 100.0, 200.0)}
    with pytest.raises(ReleaseError, match="perplexity"):
        check_gate(worse, {"int4": {"min_top1_agreement": 0.5, "max_perplexity_ratio": 1.1}})
    with pytest.raises(ReleaseError, match="finite"):
        check_gate({"int4": GateCounts()}, LOOSE)


def test_kind_perplexity_matches_a_direct_torch_computation():
    """Three oracles agree on a few sentences: nll_sums (batched, torch), the gate's
    reference and its candidate path (fp32 ONNX via the device decoder), against
    torch.nn.functional.cross_entropy on each sentence alone."""
    b = tiny_bundle()
    tok = __import__("tokenizers").Tokenizer.from_str(tokenizer_json().decode())
    sentences = [tok.encode(t, add_special_tokens=False).ids[:6] for t in TEXTS[:4]]
    blocks = np.array([s for s in sentences if len(s) == 6], dtype=np.int64)
    assert len(blocks) >= 3
    direct_sum, direct_n = 0.0, 0
    with torch.no_grad():
        for s in blocks:
            ids = torch.as_tensor(s)
            logits = b.model(input_ids=ids[None]).logits[0, :-1].double()
            direct_sum += float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
            direct_n += len(s) - 1
    total, n = nll_sums(b.model, blocks, batch_size=2)
    # batching changes torch's float32 sums in the last bits only
    assert n == direct_n and math.isclose(total, direct_sum, rel_tol=1e-7)
    assert math.isclose(perplexity(total, n), math.exp(direct_sum / direct_n), rel_tol=1e-7)
    ref = reference_scores(b.model, blocks)
    cand = candidate_scores(tiny_fp32_onnx(), blocks, HEAD_DIM, prefill=3)
    c = compare(ref, cand)
    assert c.positions == direct_n and c.agree == direct_n
    assert math.isclose(c.nll_reference, direct_sum, rel_tol=1e-9)
    assert math.isclose(c.nll_candidate, direct_sum, rel_tol=1e-5)
