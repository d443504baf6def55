"""Helpers that make real releases for the tests: a real ONNX model, its inputs, an
independent onnxruntime reference, and releases signed by a real (sim) release enclave."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from sealfl.attestation.bundle import assemble_release
from sealfl.attestation.quote import RELEASE_PURPOSE
from sealfl.enclave.release.enclave import ReleaseEnclave

__all__ = ["MODEL_FILE", "N_FEATURES", "WEIGHTS", "BIAS", "make_onnx_model", "sample_inputs", "direct_outputs",
           "default_payload", "signed_release_files", "write_signed_release", "resigned_model_sig",
           "commit_round"]

MODEL_FILE = "model.int8.onnx"
N_FEATURES = 4
WEIGHTS = np.array([[0.5], [-1.25], [2.0], [0.125]], dtype=np.float32)
BIAS = np.array([0.25], dtype=np.float32)


def make_onnx_model(weights: np.ndarray = WEIGHTS, bias: np.ndarray = BIAS) -> bytes:
    """A real ONNX model: y = sigmoid(x @ W + b), x float32 (n, 4), y float32 (n, 1)."""
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["logit"]),
         helper.make_node("Sigmoid", ["logit"], ["y"])],
        "tiny_logreg",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", weights.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", weights.shape[1]])],
        [numpy_helper.from_array(weights, "W"), numpy_helper.from_array(bias, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def sample_inputs(n: int = 5, seed: int = 0) -> np.ndarray:
    """Deterministic float32 (n, 4) inputs."""
    return np.random.default_rng(seed).normal(size=(n, N_FEATURES)).astype(np.float32)


def direct_outputs(model: bytes, x: np.ndarray) -> np.ndarray:
    """The first output of ``model`` on input ``x`` in an in-process onnxruntime session:
    the independent reference for the sandboxed runtime and the device."""
    import onnxruntime as ort

    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def default_payload() -> dict[str, bytes]:
    """Payload of a typical release: the model plus a small labels file."""
    return {MODEL_FILE: make_onnx_model(), "labels.json": b'{"0": "healthy", "1": "disease"}\n'}


def signed_release_files(enclave: ReleaseEnclave, payload: dict[str, bytes], name: str, version: int,
                         metadata: dict | None = None) -> dict[str, bytes]:
    """Every file of a release validly signed and attested by ``enclave``, *without* the
    enclave's own self-verification -- for releases the device must refuse on content
    (e.g. an ONNX file with external data), which ``write_release`` would not write."""
    return assemble_release(payload, name, version, metadata, enclave._key,
                            lambda data: enclave.tee.quote(RELEASE_PURPOSE, data, [16]))


def write_signed_release(enclave: ReleaseEnclave, out: Path, payload: dict[str, bytes], name: str, version: int,
                         metadata: dict | None = None) -> Path:
    """Write :func:`signed_release_files` into the new directory ``out``; return it."""
    out.mkdir(parents=True)
    for file_name, data in signed_release_files(enclave, payload, name, version, metadata).items():
        (out / file_name).write_bytes(data)
    return out


def resigned_model_sig(files: dict[str, bytes], key) -> bytes:
    """A ``model.sig`` over every other file of ``files`` (digests by hashlib here), signed with
    ``key``: for tests that rewrite a release's documents and must sign it again."""
    import hashlib
    import json

    from sealfl.attestation.model_sig import build_model_signature

    name = json.loads(files["manifest.json"])["name"]
    return build_model_signature(name, {n: hashlib.sha256(d).hexdigest() for n, d in files.items()
                                        if n != "model.sig"}, key)


def commit_round(campaign_dir, server_round: int, model_ct: bytes, model_weight: float, stats_ct: bytes,
                 accepted: list[str]) -> None:
    """Commit one round of a fabricated campaign the way the aggregator does
    (:meth:`CampaignDir.end_round`: checkpoint, then its ``rounds.jsonl`` record with the
    aggregate's digest and the partners that counted)."""
    from sealfl.server.bookkeeping import CampaignDir

    cd = CampaignDir(campaign_dir)
    cd.dir.mkdir(parents=True, exist_ok=True)
    cd.note(accepted=list(accepted))
    cd.stage_checkpoint(server_round, model_ct, model_weight, stats_ct)
    cd.end_round(server_round)
