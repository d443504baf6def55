"""The release canary and the device's input ranges: pure decisions, and the device
refusing a release whose canary fails on it (keeping its last good release)."""

import copy
import json

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sealfl.attestation.canary import check_canary, parse_canary
from sealfl.attestation.errors import CanaryError
from sealfl.clients.heart.data import FEATURE_SPEC
from sealfl.enclave.device.boot import boot, boot_last_good
from sealfl.enclave.device.inputs import check_rows, parse_input_spec
from sealfl.enclave.errors import BootError, InputRangeError, InputSpecError
from sealfl.platform.canary import build_canary, canary_rows
from sealfl.platform.quantize import quantize_int8
from tests.support.releases import MODEL_FILE, make_onnx_model

ROW = [63, 1, 145, 233, 1, 150, 0, 2.3, 0, 0, 1, 0, 0]


def _spec():
    return parse_input_spec({"name": "features", "features": [dict(f) for f in FEATURE_SPEC]})


def _tiny():
    model = quantize_int8(make_onnx_model())
    rows = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32) * 3
    return model, build_canary(model, "x", "y", rows)


def _run(model, canary):
    s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    c = parse_canary(canary)
    return s.run(["y"], {"x": c.inputs})[0], [s.run(["y"], {"x": c.inputs[i:i + 1]})[0] for i in range(len(c.inputs))]


def test_kind_canary_accepts_what_was_released():
    model, canary = _tiny()
    check_canary(parse_canary(canary), *_run(model, canary))


def test_kind_canary_names_the_row_that_differs():
    model, canary = _tiny()
    bad = copy.deepcopy(canary)
    bad["expected"][3][0] += 10 * canary["tolerance"]
    with pytest.raises(CanaryError, match="canary row 3, output 0"):
        check_canary(parse_canary(bad), *_run(model, bad))


def test_kind_canary_catches_a_batch_dependent_model(tmp_path):
    """onnxruntime's own dynamic quantisation takes one activation scale per batch: a model
    quantised that way fails the row-alone-vs-batch check on an outlier canary."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    src.write_bytes(make_onnx_model())
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QUInt8)
    rows = np.array([[0.1, 0.2, -0.1, 0.3], [1000.0, -1000.0, 1000.0, 1000.0]], np.float32)
    model, canary = _tiny()
    canary = build_canary(model, "x", "y", rows)
    per_tensor = dst.read_bytes()
    s = ort.InferenceSession(per_tensor, providers=["CPUExecutionProvider"])
    batch = s.run(["y"], {"x": rows})[0]
    alone = [s.run(["y"], {"x": rows[i:i + 1]})[0] for i in range(2)]
    with pytest.raises(CanaryError):
        check_canary(parse_canary(canary), batch, alone)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                     max_leaves=8)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:2]):
            yield from _paths(v, prefix + (i,))


def _replace(doc, path, value):
    doc = copy.deepcopy(doc)
    if not path:
        return value
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return doc


_CANARY = _tiny()[1]
_CANARY["inputs"], _CANARY["expected"] = _CANARY["inputs"][:2], _CANARY["expected"][:2]
_CANARY_PATHS = list(_paths(_CANARY))
_INPUT = {"name": "features", "features": [dict(f) for f in FEATURE_SPEC[:4]]}
_INPUT_PATHS = list(_paths(_INPUT))


#: (parser, document, the error it may raise, a field path in it)
_CASES = [(parse_canary, _CANARY, CanaryError, p) for p in _CANARY_PATHS] + \
         [(parse_input_spec, _INPUT, InputSpecError, p) for p in _INPUT_PATHS]


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(_CASES), _json)
def test_kind_malformed_canary_or_input_spec_field_raises_only_its_error(case, value):
    parse, doc, error, path = case
    try:
        parse(_replace(doc, path, value))
    except error:
        pass


@pytest.mark.parametrize("col, value, words", [
    (3, 100000.0, "row 2, column 'chol': 100000 is outside the documented range 50..1000 mg/dl"),
    (0, 200.0, "column 'age'"),
    (1, 2.0, "column 'sex'"),
    (7, float("nan"), "is not a finite number"),
    (2, 20.0, "column 'trestbps'"),
])
def test_kind_device_inputs_outside_documented_ranges_are_refused(col, value, words):
    x = np.array([ROW, ROW], np.float32)
    x[1, col] = value
    with pytest.raises(InputRangeError) as exc:
        check_rows(_spec(), x)
    assert words in str(exc.value)


def test_kind_device_inputs_one_hot_groups_and_missing_codes():
    x = np.array([ROW], np.float32)
    x[0, 3] = 0.0  # chol 0 = not recorded, as the source data codes it: accepted
    check_rows(_spec(), x)
    x[0, 8] = x[0, 9] = 1.0  # two chest-pain types at once
    with pytest.raises(InputRangeError, match="row 1: more than one of the one-hot columns"):
        check_rows(_spec(), x)
    with pytest.raises(InputRangeError, match="shape"):
        check_rows(_spec(), np.zeros((2, 12), np.float32))


def test_canary_rows_stay_inside_the_ranges_and_are_deterministic():
    mean = np.array([54, 0.8, 132, 220, 0.15, 140, 0.4, 0.9, 0.2, 0.2, 0.05, 0.6, 0.2])
    std = np.array([9, 0.4, 18, 90, 0.35, 25, 0.5, 1.1, 0.4, 0.4, 0.2, 0.5, 0.4])
    a = canary_rows(FEATURE_SPEC, mean, std)
    np.testing.assert_array_equal(a, canary_rows(FEATURE_SPEC, mean, std))
    check_rows(_spec(), a)
    assert a[:, 3].max() == 1000.0 and a[:, 3].min() == 0.0  # the range ends and the missing code


def test_kind_device_refuses_a_release_whose_canary_fails_and_keeps_the_last_good(enclave, trust_dir, tmp_path):
    model, canary = _tiny()
    meta = {"model_file": MODEL_FILE, "canary": canary}
    enclave.write_release(tmp_path / "v1", {MODEL_FILE: model}, "tiny", 1, meta)
    with boot(trust_dir, tmp_path / "v1", tmp_path / "state", backend="sim") as dev:
        assert dev.release.version == 1
    bad = copy.deepcopy(canary)
    bad["expected"] = [[v + 0.5] for (v,) in bad["expected"]]  # signed, but not what the model computes
    enclave.write_release(tmp_path / "v2", {MODEL_FILE: model}, "tiny", 2, {"model_file": MODEL_FILE, "canary": bad})
    with pytest.raises(BootError) as exc:
        boot(trust_dir, tmp_path / "v2", tmp_path / "state", backend="sim")
    assert exc.value.reason == "canary" and "canary row" in str(exc.value) and "> tolerance" in str(exc.value)
    refused = json.loads((tmp_path / "state" / "last_refused.json").read_text())  # the device records why
    assert refused["reason"] == "canary" and refused["release_dir"] == str(tmp_path / "v2")
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["last_good"]["version"] == 1
    with boot_last_good(trust_dir, tmp_path / "state") as dev:
        assert dev.release.version == 1
