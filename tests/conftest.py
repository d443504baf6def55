"""Shared fixtures for the attestation/enclave tests (pytest loads this conftest itself;
helper functions are imported with ``from conftest import ...``).

Everything secret is created under pytest's ``tmp_path``; nothing is written into the repo.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

# Make ``import sealfl`` work when pytest runs from the console script without an install.
_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from sealfl.attestation.bundle import assemble_release  # noqa: E402
from sealfl.attestation.quote import RELEASE_PURPOSE  # noqa: E402
from sealfl.attestation.release import read_release_dir  # noqa: E402
from sealfl.enclave.release_enclave import ReleaseEnclave  # noqa: E402
from swtpm_fixture import backend, swtpm  # noqa: E402,F401  (fixtures: a real swtpm, each TEE backend)

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


@pytest.fixture
def enclave(tmp_path: Path) -> ReleaseEnclave:
    """A freshly provisioned sim release enclave in tmp_path/enclave."""
    return ReleaseEnclave.create(tmp_path / "enclave")


@pytest.fixture
def trust_dir(tmp_path: Path, enclave: ReleaseEnclave) -> Path:
    """Trust anchors exported by ``enclave`` (min_version 0)."""
    return enclave.export_trust(tmp_path / "trust")


@pytest.fixture
def release_dir(tmp_path: Path, enclave: ReleaseEnclave) -> Path:
    """A good release (version 3) written by ``enclave``."""
    out = tmp_path / "release-v3"
    enclave.write_release(out, default_payload(), "heart-mlp", 3, {"model_file": MODEL_FILE})
    return out


@pytest.fixture
def release_files(release_dir: Path) -> dict[str, bytes]:
    """All files of ``release_dir`` as {name: bytes}."""
    return read_release_dir(release_dir)


@pytest.fixture
def server_identity(monkeypatch):
    """The identity a ServerApp process has when it creates messages (run 1, SuperLink node 1)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1, raising=False)
