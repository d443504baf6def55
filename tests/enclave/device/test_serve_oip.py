"""``sealfl device serve`` on a tabular release speaks the Open Inference Protocol (KServe
v2 REST): a real server process on a free loopback port, a real HTTP client, a real signed
release (y = sigmoid(x @ W + b), 4 features with signed ranges), and an independent
onnxruntime session as the reference for every score."""

from __future__ import annotations

import json
import signal

import httpx
import numpy as np
import pytest

from sealfl.enclave.device.inputs import parse_input_spec
from sealfl.enclave.device.serve.oip import OIPError, parse_infer_request
from sealfl.enclave.release.enclave import ReleaseEnclave
from tests.support.releases import MODEL_FILE, default_payload, direct_outputs, make_onnx_model
from tests.support.serve import DEADLINE_S, Server, _gone

pytestmark = pytest.mark.slow

NAME = "heart-risk"
FEATURES = [{"name": "age", "unit": "years", "min": -5, "max": 5},
            {"name": "chol", "unit": "mg/dl", "min": -5, "max": 5, "missing_code": 99},
            {"name": "sex", "unit": "code", "values": [0, 1]},
            {"name": "oldpeak", "unit": "mm", "min": -5, "max": 5}]
INPUT = {"name": "x", "dtype": "float32", "shape": ["batch", 4], "features": FEATURES}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("oip")
    enclave = ReleaseEnclave.create(root / "enclave")
    enclave.export_trust(root / "trust")
    enclave.write_release(root / "release", default_payload(), NAME, 2, {"model_file": MODEL_FILE, "input": INPUT})
    return root


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    s = Server(root, tmp_path_factory.mktemp("oip-serve"))
    s.wait_ready()
    yield s
    s.kill()


def _infer(server, body, name=NAME, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}/v2/models/{name}/infer", content=content,
                      headers={"content-type": "application/json"}, timeout=DEADLINE_S, **kw)


ROWS = np.array([[0.5, -1.0, 1.0, 2.0], [-2.0, 99.0, 0.0, 0.25], [4.0, 3.0, 1.0, -4.5]], dtype=np.float32)


def test_kind_infer_scores_rows_as_the_signed_model_does(server):
    body = {"id": "req-7", "inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32",
                                       "data": ROWS.reshape(-1).tolist()}]}
    r = _infer(server, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model_name"] == NAME and out["model_version"] == "2" and out["id"] == "req-7"
    (tensor,) = out["outputs"]
    assert tensor["name"] == "y" and tensor["datatype"] == "FP32" and tensor["shape"] == [3, 1]
    expected = direct_outputs(make_onnx_model(), ROWS).reshape(-1)
    np.testing.assert_allclose(tensor["data"], expected, rtol=1e-6, atol=1e-7)
    # nested by row (as Triton accepts) gives the same scores
    nested = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": ROWS.tolist()}]}
    assert _infer(server, nested).json()["outputs"][0]["data"] == tensor["data"]
    assert server.metric("sealfl_oip_infer_rows_total") >= 6


def test_kind_health_and_metadata_name_the_verified_release(server):
    assert httpx.get(server.url + "/v2/health/live", timeout=DEADLINE_S).json() == {"live": True}
    assert httpx.get(server.url + "/v2/health/ready", timeout=DEADLINE_S).json() == {"ready": True}
    meta = httpx.get(f"{server.url}/v2/models/{NAME}", timeout=DEADLINE_S).json()
    health = server.health().json()
    assert meta["name"] == NAME and meta["versions"] == ["2"]
    assert meta["parameters"]["root_digest"] == health["release"]["root_digest"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4], "parameters": {
        "columns": ["age", "chol", "sex", "oldpeak"], "units": ["years", "mg/dl", "code", "mm"],
        "allowed": ["-5..5 years", "-5..5 mg/dl (or 99 = not recorded)", "one of [0.0, 1.0] (code)", "-5..5 mm"]}}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}]
    assert httpx.get(f"{server.url}/v2/models/{NAME}/versions/2/ready", timeout=DEADLINE_S).json()["ready"] is True
    assert httpx.get(f"{server.url}/v2/models/{NAME}/versions/1", timeout=DEADLINE_S).status_code == 404
    other = httpx.get(f"{server.url}/v2/models/other-model", timeout=DEADLINE_S)
    assert other.status_code == 404 and NAME in other.json()["error"]


def test_kind_the_language_model_api_refuses_a_tabular_release_by_name(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "user", "content": "hi"}]}, timeout=DEADLINE_S)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "model" and f"/v2/models/{NAME}/infer" in err["message"]


def _tensor(**kw):
    t = {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.0, 0.0, 1.0, 0.0]}
    t.update(kw)
    return {"inputs": [t]}


BAD = [  # (body, words the 400 must carry)
    (b"{not json", "not one JSON object"),
    (b'{"inputs": [], "inputs": []}', "duplicate"),
    ({"inputs": []}, "exactly one tensor"),
    ({"inputs": [_tensor()["inputs"][0]] * 2}, "exactly one tensor"),
    (_tensor(name="features"), "input is 'x'"),
    (_tensor(datatype="FP64"), "takes FP32"),
    (_tensor(datatype="BYTES", data=["a", "b", "c", "d"]), "takes FP32"),
    (_tensor(shape=[1, 5], data=[0.0] * 5), "4 features per row"),
    (_tensor(shape=[0, 4], data=[]), "1..4096 rows"),
    (_tensor(shape=[5000, 4], data=[0.0] * 20000), "1..4096 rows"),
    (_tensor(shape=[1.0, 4]), "two integers"),
    (_tensor(shape="1,4"), "two integers"),
    (_tensor(data=[0.0, 0.0, 1.0]), "needs 4"),
    (_tensor(data=[0.0, 0.0, True, 0.0]), "must be a number, got boolean"),
    (_tensor(data=[0.0, None, 1.0, 0.0]), "got null"),
    (_tensor(data=[0.0, "1", 1.0, 0.0]), "got string"),
    (b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 1e999, 1, 0]}]}', "finite FP32"),
    (_tensor(data=[0.0, 10 ** 400, 1.0, 0.0]), "finite FP32"),
    (_tensor(data=[0.0, 1e39, 1.0, 0.0]), "finite FP32"),
    (_tensor(data=[6.0, 0.0, 1.0, 0.0]), "age"),
    (_tensor(data=[0.0, 0.0, 0.5, 0.0]), "sex"),
    (_tensor(extra=1), "unknown field"),
    ({"inputs": _tensor()["inputs"], "outputs": [{"name": "logit"}]}, "outputs are ['y']"),
    ({"id": 7, **_tensor()}, "id must be a string"),
    ({"input": []}, "unknown request field"),
    (b'{"inputs": [{"name": "x\\ud800", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 1, 0]}]}', "Unicode"),
]


@pytest.mark.parametrize("body,words", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_kind_requests_the_model_cannot_score_get_400_saying_why(server, body, words):
    r = _infer(server, body)
    assert r.status_code == 400, (r.status_code, r.text)
    assert words in r.json()["error"], r.json()


def test_kind_a_body_over_the_cap_is_refused_before_it_is_read(server):
    r = _infer(server, b"[" * (2 << 20))
    assert r.status_code == 400 and "at most" in r.json()["error"]
    # the server still scores after every refusal above
    assert _infer(server, _tensor()).status_code == 200


def test_kind_the_parser_names_row_and_column_of_an_out_of_range_cell():
    spec = parse_input_spec(INPUT)
    rows = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 7.5]
    body = json.dumps({"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": rows}]}).encode()
    with pytest.raises(OIPError) as info:
        parse_infer_request(body, "x", 4, spec, ("y",))
    assert "row 2" in str(info.value) and "oldpeak" in str(info.value) and info.value.status == 400
    ok = parse_infer_request(body.replace(b"7.5", b"4.5"), "x", 4, spec, ("y",))
    assert ok.rows.dtype == np.float32 and ok.rows.shape == (2, 4) and ok.rows[1, 3] == 4.5


def test_kind_sigterm_stops_a_tabular_server_and_its_child(root, tmp_path):
    s = Server(root, tmp_path)
    s.wait_ready()
    code, log, kids = s.stop(signal.SIGTERM)
    assert code == 143 and kids, log
    assert all(_gone(pid) for pid in kids)


def test_kind_each_request_gets_one_access_log_line_without_the_data(server):
    secret_value = 1.23456789
    rows = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [secret_value, 0, 1, 0, 0, 0, 1, 0]}]}
    assert _infer(server, rows).status_code == 200
    assert _infer(server, _tensor(datatype="FP64")).status_code == 400
    lines = [ln for ln in server.log.read_text().splitlines() if "method=POST" in ln]
    assert any(f"path=/v2/models/{NAME}/infer status=200 rows=2 total_ms=" in ln for ln in lines), lines
    assert any(f"path=/v2/models/{NAME}/infer status=400 total_ms=" in ln for ln in lines), lines
    assert "1.2345" not in server.log.read_text()  # the rows' values never reach the log


def test_kind_serving_on_a_busy_port_says_which_and_what_to_do(root, tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", "device", "serve", "--trust",
                              root / "trust", "--release", root / "release", "--state", tmp_path / "st", "--tee",
                              "sim", "--port", str(port)], capture_output=True, text=True, timeout=120)
    msg = " ".join(out.stderr.split())
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in msg and "--port" in msg, msg
    assert "Errno" not in msg
