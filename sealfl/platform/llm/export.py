"""Export a (merged) causal LM to a float32 ONNX graph with a KV cache.

Route: onnxruntime-genai's model builder (``onnxruntime_genai/models/builder.py``, run as
``python builder.py -i <HF dir> -o <out> -p fp32 -e cpu``) on the merged model saved as a
Hugging Face directory (``save_pretrained``, safetensors). It writes one decoder graph with

* inputs ``input_ids`` int64 (batch, seq), ``attention_mask`` int64 (batch, past + seq),
  ``past_key_values.{i}.key|value`` float32 (batch, kv_heads, past, head_dim);
* outputs ``logits`` float32 (batch, seq, vocab), ``present.{i}.key|value`` (batch,
  kv_heads, past + seq, head_dim);
* ``GroupQueryAttention`` (rotary embedding inside, causal), ``SkipSimplifiedLayerNormalization``
  and the tied embedding as a ``Gather`` on the transposed ``lm_head`` weight.

Measured here (SmolLM2-135M, 2 busy cores): the builder exports in ~16 s with ~2 GB peak;
``torch.onnx.export(dynamo=True)`` of the same model took ~43 s and 4.3 GB peak (issue 6)
and its graph has no fused attention. The builder's own int4 path is not used (see
:mod:`.quantize` for why); sealfl quantises the float32 graph itself.

:func:`export_fp32` then adds the ``logits_start`` input (:mod:`.head`): a device asks for
the last position's logits only.

The builder runs in a child process with ``HF_HUB_OFFLINE=1``: it reads only the given
directory; nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sealfl.platform.errors import ReleaseError
from sealfl.platform.llm.head import add_logits_start

__all__ = ["ExportError", "builder_script", "save_hf_dir", "export_fp32"]

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 1800


class ExportError(ReleaseError):
    """The ONNX export failed (the message carries the builder's last output lines)."""


def builder_script() -> Path:
    """Path of onnxruntime-genai's ``models/builder.py`` (the package is not imported).

    Raises:
        ExportError: onnxruntime-genai is not installed (the ``llm`` extra installs it).
    """
    spec = importlib.util.find_spec("onnxruntime_genai")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "models" / "builder.py"
        if p.is_file():
            return p
    raise ExportError("onnxruntime-genai's model builder is not installed; pip install 'sealfl[llm]'")


def save_hf_dir(model, tokenizer_json: bytes, chat_template: str, generation: dict, out: str | os.PathLike) -> Path:
    """Write ``model`` (float32, safetensors) and its tokenizer files as a Hugging Face
    directory the builder can read. Returns ``out`` as a Path."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_bytes(tokenizer_json)
    (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template,
        "bos_token_id": generation["bos_token_id"], "eos_token_id": generation["eos_token_ids"][0],
        "model_max_length": int(getattr(model.config, "max_position_embeddings", 2048))}), encoding="utf-8")
    return out


def export_fp32(model, tokenizer_json: bytes, chat_template: str, generation: dict, work_dir: str | os.PathLike,
                timeout_s: float = EXPORT_TIMEOUT_S):
    """Export ``model`` to float32 ONNX with a KV cache and the ``logits_start`` input;
    return the ``onnx.ModelProto`` (external data loaded into memory).

    Args:
        model: float32 ``LlamaForCausalLM`` (merged).
        tokenizer_json, chat_template, generation: as in
            :class:`sealfl.clients.causal_lm.base.LMBundle`.
        work_dir: an existing private directory for the intermediate files.
        timeout_s: the builder is killed after this many seconds.

    Raises:
        ExportError: the builder is missing, fails or times out.
    """
    import onnx

    work = Path(work_dir)
    hf_dir = save_hf_dir(model, tokenizer_json, chat_template, generation, work / "hf")
    out = work / "onnx"
    cmd = [sys.executable, str(builder_script()), "-m", "sealfl-merged", "-i", str(hf_dir), "-o", str(out),
           "-p", "fp32", "-e", "cpu", "-c", str(work / "cache"), "--extra_options", "hf_token=false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": ""}
    with tempfile.TemporaryFile() as logf:
        try:
            proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                                  cwd=str(work))
        except subprocess.TimeoutExpired as exc:
            raise ExportError(f"the ONNX export did not finish within {timeout_s:.0f} s") from exc
        logf.seek(0)
        tail = logf.read()[-3000:].decode("utf-8", "replace")
    if proc.returncode != 0 or not (out / "model.onnx").is_file():
        raise ExportError(f"the ONNX export failed (exit code {proc.returncode}): {tail.strip()[-1500:]}")
    log.info("exported float32 ONNX with KV cache to %s", out)
    proto = onnx.load(str(out / "model.onnx"), load_external_data=True)
    add_logits_start(proto)
    return proto
