"""The Open Inference Protocol (KServe "v2" REST) for a tabular release: parsing of
inference requests and the metadata and response bodies. Pure: bytes and parsed data in,
arrays and dicts out; :mod:`sealfl.enclave.device.serve.oip_routes` does the HTTP.

Source: KServe's "Open Inference Protocol (V2 Inference Protocol)", REST section
(https://kserve.github.io/website/docs/concepts/architecture/data-plane/v2-protocol, also
Triton's ``docs/protocol``): a request is ``{"id"?: str, "parameters"?: {...}, "inputs":
[{"name", "shape", "datatype", "parameters"?, "data"}], "outputs"?: [{"name", ...}]}``;
tensor ``data`` is in row-major order, flat (the protocol's form) or nested as the shape
says (accepted, as Triton does); an error is ``{"error": "<message>"}`` with a 4xx status.

What a device accepts is stricter than the protocol: exactly one input, named as the
release's signed input spec names it, datatype ``FP32``, shape ``[N, d]`` with ``d`` the
spec's feature count and ``1 <= N <= max_rows``, exactly ``N * d`` numbers (no booleans,
strings or nulls), each finite as a float32 and inside its feature's signed range
(:func:`sealfl.enclave.device.inputs.check_rows`, which names the row and the column).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sealfl.attestation.canonical import JSONFormatError, loads_strict
from sealfl.enclave.device.inputs import InputSpec, check_rows
from sealfl.enclave.errors import EnclaveError, InputRangeError

__all__ = ["OIPError", "InferRequest", "parse_infer_request", "model_metadata", "infer_response",
           "DEFAULT_MAX_ROWS", "MAX_ID_CHARS"]

#: Rows one request may score at most (``--max-rows`` of ``device serve``).
DEFAULT_MAX_ROWS = 4096
#: Longest request ``id`` echoed back, characters.
MAX_ID_CHARS = 256
_FP32_MAX = float(np.finfo(np.float32).max)
_REQUEST_KEYS = {"id", "parameters", "inputs", "outputs"}
_TENSOR_KEYS = {"name", "shape", "datatype", "parameters", "data"}


class OIPError(EnclaveError):
    """A request the protocol endpoint cannot serve: ``status`` (HTTP) and the message that
    goes into the protocol's ``{"error": ...}`` body."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def body(self) -> dict:
        """The protocol's error body."""
        return {"error": str(self)}


@dataclass(frozen=True)
class InferRequest:
    """A checked inference request: ``rows`` float32 of shape ``(N, d)``, the request
    ``id`` to echo (``""`` if none), and the output names asked for (empty: all)."""

    rows: np.ndarray
    id: str
    outputs: tuple[str, ...]


def _kind(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


def _flatten(data: Any, shape: tuple[int, int], where: str) -> list:
    """``data`` flat (``N*d`` numbers) or nested (``N`` lists of ``d``) -> a flat list."""
    n, d = shape
    if not isinstance(data, list):
        raise OIPError(f"{where}.data must be an array of numbers, got {_kind(data)}")
    if len(data) == n and n > 0 and all(isinstance(r, list) for r in data):
        flat: list = []
        for i, row in enumerate(data):
            if len(row) != d:
                raise OIPError(f"{where}.data[{i}] has {len(row)} values; shape {list(shape)} needs {d}")
            flat.extend(row)
        return flat
    if len(data) != n * d:
        raise OIPError(f"{where}.data has {len(data)} values; shape {list(shape)} needs {n * d} "
                       "(row-major, flat or nested by row)")
    return data


def _to_float32(flat: list, shape: tuple[int, int], where: str) -> np.ndarray:
    out = np.empty(len(flat), dtype=np.float32)
    d = shape[1]
    for k, v in enumerate(flat):
        if type(v) not in (int, float):  # bool is an int subclass: refused by the exact type check
            raise OIPError(f"{where}.data[{k}] (row {k // d + 1}, column {k % d + 1}) must be a number, "
                           f"got {_kind(v)}")
        try:
            x = float(v)
        except OverflowError:
            x = math.inf
        if not math.isfinite(x) or abs(x) > _FP32_MAX:
            raise OIPError(f"{where}.data[{k}] (row {k // d + 1}, column {k % d + 1}) is not a finite FP32 number")
        out[k] = x
    return out.reshape(shape)


def _shape(v: Any, where: str, d: int, max_rows: int) -> tuple[int, int]:
    if not isinstance(v, list) or len(v) != 2 or any(type(x) is not int for x in v):
        raise OIPError(f"{where}.shape must be [N, {d}] (two integers), got {v!r:.80}")
    n, width = v
    if width != d:
        raise OIPError(f"{where}.shape is {v}; this model takes {d} features per row: [N, {d}]")
    if not 1 <= n <= max_rows:
        raise OIPError(f"{where}.shape asks for {n} rows; a request may hold 1..{max_rows} rows")
    return n, width


def parse_infer_request(body: bytes, input_name: str, width: int, spec: InputSpec | None,
                        output_names: tuple[str, ...], *, max_rows: int = DEFAULT_MAX_ROWS) -> InferRequest:
    """Check an ``/infer`` request body against the model's input and the release's signed
    input spec.

    Args:
        body: the raw request body (UTF-8 JSON; the caller caps its size).
        input_name: the model's input name.
        width: features per row (``d``).
        spec: the release's parsed input spec (its ``d`` feature ranges), or None when the
            release states none (then only finiteness is checked, as ``device boot --input`` does).
        output_names: the model's output names (a request's ``outputs`` must be among them).
        max_rows: most rows per request.

    Returns:
        an :class:`InferRequest` (rows float32, shape ``(N, d)``).

    Raises:
        OIPError: status 400 with a message naming the field, the row and the column at
            fault: not one strict JSON object, unknown keys, not exactly one input, another
            input name or datatype than the model's, a wrong shape, values that are not
            finite FP32 numbers, or a value outside its feature's signed range.
    """
    try:
        doc = loads_strict(bytes(body))
    except (JSONFormatError, TypeError) as exc:
        raise OIPError(f"the body is not one JSON object: {exc}") from exc
    unknown = sorted(set(doc) - _REQUEST_KEYS)
    if unknown:
        raise OIPError(f"unknown request field(s) {unknown}; the protocol's are {sorted(_REQUEST_KEYS)}")
    rid = doc.get("id", "")
    if not isinstance(rid, str) or len(rid) > MAX_ID_CHARS:
        raise OIPError(f"id must be a string of at most {MAX_ID_CHARS} characters")
    if not isinstance(doc.get("parameters", {}), dict):
        raise OIPError("parameters must be an object")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1:
        raise OIPError(f"inputs must be an array of exactly one tensor ({input_name!r}), got "
                       f"{len(inputs) if isinstance(inputs, list) else _kind(inputs)}")
    tensor = inputs[0]
    if not isinstance(tensor, dict):
        raise OIPError(f"inputs[0] must be an object, got {_kind(tensor)}")
    unknown = sorted(set(tensor) - _TENSOR_KEYS)
    missing = sorted({"name", "shape", "datatype", "data"} - set(tensor))
    if unknown or missing:
        raise OIPError(f"inputs[0]: {'unknown field(s) ' + str(unknown) if unknown else ''}"
                       f"{'; ' if unknown and missing else ''}{'missing ' + str(missing) if missing else ''}")
    if tensor["name"] != input_name:
        raise OIPError(f"inputs[0].name is {str(tensor['name'])[:80]!r}; this model's input is {input_name!r}")
    if tensor["datatype"] != "FP32":
        raise OIPError(f"inputs[0].datatype is {str(tensor['datatype'])[:20]!r}; this model takes FP32")
    if not isinstance(tensor.get("parameters", {}), dict):
        raise OIPError("inputs[0].parameters must be an object")
    shape = _shape(tensor["shape"], "inputs[0]", width, max_rows)
    rows = _to_float32(_flatten(tensor["data"], shape, "inputs[0]"), shape, "inputs[0]")
    try:
        check_rows(spec, rows)
    except InputRangeError as exc:
        raise OIPError(f"inputs[0]: {exc}") from exc
    wanted = doc.get("outputs", [])
    if not isinstance(wanted, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in wanted):
        raise OIPError("outputs must be an array of objects with a name")
    names = tuple(o["name"] for o in wanted)
    for name in names:
        if name not in output_names:
            raise OIPError(f"outputs names {name[:80]!r}; this model's outputs are {list(output_names)}")
    return InferRequest(rows, rid, names)


def model_metadata(name: str, version: int, input_name: str, width: int, spec: InputSpec | None,
                   output_names: tuple[str, ...], root_digest: str) -> dict:
    """The ``GET /v2/models/{name}`` body: the model's name (the release's), its version,
    platform, the one FP32 input ``[-1, d]`` with the documented column order (the signed
    spec's feature names, units and allowed values, in ``parameters``, when the release has
    one), and the FP32 outputs ``[-1, 1]``."""
    tensor: dict = {"name": input_name, "datatype": "FP32", "shape": [-1, width]}
    if spec is not None:
        tensor["parameters"] = {"columns": [f.name for f in spec.features], "units": [f.unit for f in spec.features],
                                "allowed": [f.describe() for f in spec.features]}
    return {
        "name": name,
        "versions": [str(version)],
        "platform": "onnxruntime_onnx",
        "inputs": [tensor],
        "outputs": [{"name": o, "datatype": "FP32", "shape": [-1, 1]} for o in output_names],
        "parameters": {"root_digest": root_digest},
    }


def infer_response(name: str, version: int, req: InferRequest, outputs: Mapping[str, np.ndarray]) -> dict:
    """The ``/infer`` response body: each requested output (all if none were named) as a
    flat FP32 tensor of shape ``[N, 1]``, with the request's ``id``.

    Raises:
        OIPError: status 500 -- an output is not ``N`` finite values (the model misbehaved).
    """
    n = req.rows.shape[0]
    tensors = []
    for out_name in req.outputs or tuple(outputs):
        values = np.asarray(outputs[out_name], dtype=np.float32).reshape(-1)
        if values.shape[0] != n or not np.all(np.isfinite(values)):
            raise OIPError(f"the model's output {out_name!r} is not {n} finite values", status=500)
        tensors.append({"name": out_name, "datatype": "FP32", "shape": [n, 1],
                        "data": [float(v) for v in values]})
    body = {"model_name": name, "model_version": str(version), "outputs": tensors}
    if req.id:
        body["id"] = req.id
    return body
