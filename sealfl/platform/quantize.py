"""Post-training quantisation of an ONNX model with ``onnxruntime.quantization``.

INT8: dynamic quantisation (``quantize_dynamic``, weights QInt8 per tensor, activations
quantised at run time; onnxruntime docs, "Quantize ONNX models"). It needs no
calibration data, so no partner data reaches the coordinator.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def quantize_int8(model_bytes: bytes) -> bytes:
    """Return the INT8 (dynamic, QInt8 weights) version of a float32 ONNX model.

    Raises ValueError if onnxruntime cannot read or quantise the model.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger("root").setLevel(logging.ERROR)  # ort logs "consider pre-processing" on root
    with tempfile.TemporaryDirectory(prefix="sealfl-quant-") as d:
        src, dst = Path(d) / "fp32.onnx", Path(d) / "int8.onnx"
        src.write_bytes(model_bytes)
        try:
            quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
        except Exception as exc:  # onnx/ort raise many types
            raise ValueError(f"INT8 quantisation failed: {exc}") from exc
        return dst.read_bytes()
