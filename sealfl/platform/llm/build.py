"""Build a causal-LM release inside the release enclave: merge -> ONNX -> INT4/INT8 ->
gate -> canary -> signed, attested release directory.

Release payload (flat directory; every file goes through the manifest, the DSSE
signature and the attestation like any release file):

============================  ===================================================
``model.int4.onnx``           default variant (:mod:`.quantize` ``int4``)
``model.int8.onnx``           INT8 variant
``tokenizer.json``            the base model's tokenizer (``tokenizers`` JSON)
``chat_template.jinja``       the base model's chat template
``generation_config.json``    BOS/EOS/pad ids, head size, context limit, special tokens
============================  ===================================================

Signed metadata: ``runtime`` (``onnx-causal-lm/v1``, what devices dispatch on),
``task`` (``causal-lm``), ``variants`` (file, size, quantisation scheme, gate figures and
thresholds, canary), ``default_variant``, ``files`` (roles), ``model`` (dimensions),
``base_model`` (name, SHA-256, licence), ``adapters`` (LoRA settings), ``corpus``
(source, licence) and whatever the caller adds (campaign facts).
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from sealfl.clients.causal_lm.base import LMBundle
from sealfl.clients.causal_lm.corpus import LICENCE, SOURCE
from sealfl.clients.causal_lm.lora import LoraSpec, adapter_layout
from sealfl.clients.causal_lm.merge import merge_adapters
from sealfl.enclave.device.llm_boot import LLM_RUNTIME
from sealfl.platform.errors import ReleaseError
from sealfl.platform.llm.canary import build_llm_canary
from sealfl.platform.llm.export import export_fp32
from sealfl.platform.llm.gate import THRESHOLDS, GateCounts, candidate_scores, check_gate, compare, reference_scores
from sealfl.platform.llm.quantize import SCHEMES, QuantizeError, quantize_llm

__all__ = ["VARIANTS", "LLMBuild", "adapter_low_rank", "build_candidates", "quantize_variants", "score_candidates",
           "llm_release_files"]

log = logging.getLogger(__name__)

VARIANTS = ("int4", "int8")
DEFAULT_VARIANT = "int4"
MAX_CONTEXT = 2048


@dataclass
class LLMBuild:
    """The candidates of one release build.

    Attributes:
        merged: the float32 merged model (torch) -- the gate's reference.
        variants: ``{"int4": bytes, "int8": bytes}``.
        generation: the generation settings written to ``generation_config.json``.
        head_dim: attention head size.
        seconds: ``{"merge", "export", "quantize"}`` wall times.
    """

    merged: object
    variants: dict
    generation: dict
    head_dim: int
    seconds: dict


def _special_tokens(bundle: LMBundle) -> dict:
    """``bos_token``/``eos_token``/``pad_token`` strings, which transformers passes to chat
    templates (``apply_chat_template`` renders with the tokenizer's special tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(bundle.tokenizer_json.decode("utf-8"))
    g = bundle.generation
    out = {}
    for key, tid in (("bos_token", g["bos_token_id"]), ("eos_token", g["eos_token_ids"][0]),
                     ("pad_token", g["pad_token_id"])):
        s = tok.id_to_token(int(tid))
        if s is not None:
            out[key] = s
    return out


_MODULE = re.compile(r"\Amodel\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\Z")


def adapter_low_rank(merged, spec: LoraSpec, adapters: np.ndarray, proto) -> dict:
    """The adapters of ``adapters`` as low-rank terms of the exported graph's MatMuls, for
    :func:`~sealfl.platform.llm.quantize.quantize_llm` ``low_rank``: ``{node name: (A, B)}``
    with ``x @ A @ B`` = the LoRA update of that node's weight (``W = base + A @ B``, x @ W
    layout: A float32 (K, R), B float32 (R, N)). A fused ``qkv_proj`` gets the q/k/v
    modules' terms side by side (their ranks stacked, each ``B`` in its own columns).

    Every mapping is checked on the bytes: the node's weight columns must equal the merged
    module's weight (transposed) exactly, so a layout the export changed is refused, not
    guessed.

    Raises:
        ReleaseError: an adapted module has no MatMul node, or its columns differ.
    """
    from onnx import numpy_helper

    cfg = merged.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    nq, nk = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    inits = {i.name: i for i in proto.graph.initializer}
    nodes = {n.name: n for n in proto.graph.node if n.op_type == "MatMul" and len(n.input) == 2}
    modules = dict(merged.named_modules())
    vec = np.asarray(adapters, dtype=np.float64)
    parts, pos = {}, 0
    for name, (rows, cols) in adapter_layout(merged, spec):
        parts[name] = vec[pos:pos + rows * cols].reshape(rows, cols)
        pos += rows * cols
    groups: dict[str, list] = {}
    for module in [n[:-2] for n in parts if n.endswith(".A")]:
        m = _MODULE.match(module)
        where = None if m is None else (m.group(1), "attn" if m.group(2) == "self_attn" else "mlp", m.group(3))
        node, col = None, 0
        if where is not None and where[1] == "attn" and where[2] in ("q_proj", "k_proj", "v_proj") \
                and f"/model/layers.{where[0]}/attn/qkv_proj/MatMul" in nodes:
            node = f"/model/layers.{where[0]}/attn/qkv_proj/MatMul"
            col = {"q_proj": 0, "k_proj": nq, "v_proj": nq + nk}[where[2]]
        elif where is not None:
            node = f"/model/layers.{where[0]}/{where[1]}/{where[2]}/MatMul"
        if node not in nodes or nodes[node].input[1] not in inits:
            raise ReleaseError(f"adapted module {module} has no MatMul with a constant weight in the export")
        a, b = parts[module + ".A"], parts[module + ".B"]  # (r, in), (out, r)
        w = numpy_helper.to_array(inits[nodes[node].input[1]])
        mine = modules[module].weight.detach().float().numpy().T
        if w.shape[0] != mine.shape[0] or not np.array_equal(w[:, col:col + mine.shape[1]], mine):
            raise ReleaseError(f"the export's {node} columns {col}..{col + mine.shape[1]} are not {module}'s weight")
        groups.setdefault(node, []).append((col, a, b, w.shape))
    out = {}
    for node, terms in groups.items():
        k, n = terms[0][3]
        rank = sum(a.shape[0] for _, a, _, _ in terms)
        big_a, big_b, r0 = np.zeros((k, rank)), np.zeros((rank, n)), 0
        for col, a, b, _ in terms:
            r = a.shape[0]
            big_a[:, r0:r0 + r] = a.T
            big_b[r0:r0 + r, col:col + b.shape[0]] = spec.scale * b.T
            r0 += r
        out[node] = (big_a.astype(np.float32), big_b.astype(np.float32))
    return out


def _quantize_task(model: bytes, scheme: str, eight_bit: tuple[str, ...], low_rank: dict | None) -> tuple[bytes, str]:
    """One variant as a Ray task: ``(quantised bytes, id of the node that built it)``."""
    import ray

    return quantize_llm(model, scheme, eight_bit=eight_bit, low_rank=low_rank), ray.get_runtime_context().get_node_id()


def quantize_variants(proto, eight_bit: tuple[str, ...], variants: tuple[str, ...] = VARIANTS,
                      low_rank: dict | None = None) -> tuple[dict, dict]:
    """Quantise the exported float32 graph ``proto`` into every variant.

    On the Ray cluster this process is connected to (``ray.is_initialized()``), each
    variant is one task (1 CPU, spread over the nodes: a two-node cluster builds INT4 and
    INT8 at once; the graph is put in the object store once); otherwise one after the
    other here. The bytes are the same either way (:func:`quantize_llm` is a pure function
    of the graph). Returns ``({variant: bytes}, {variant: node id or "local"})``.

    Raises:
        QuantizeError: from :func:`quantize_llm` (a task's error is re-raised as it).
    """
    import ray

    if not ray.is_initialized():
        return ({v: quantize_llm(proto, v, eight_bit=eight_bit, low_rank=low_rank) for v in variants},
                {v: "local" for v in variants})
    task = ray.remote(_quantize_task).options(num_cpus=1, scheduling_strategy="SPREAD", max_retries=2)
    model = ray.put(proto.SerializeToString())
    refs = {v: task.remote(model, v, tuple(eight_bit), low_rank) for v in variants}
    out, nodes = {}, {}
    for v, ref in refs.items():
        try:
            out[v], nodes[v] = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            raise (cause if isinstance(cause, QuantizeError) else QuantizeError(f"{v}: {exc}")) from exc
    log.info("quantised %s on Ray nodes %s", ", ".join(variants), sorted(set(nodes.values())))
    return out, nodes


def build_candidates(bundle: LMBundle, spec: LoraSpec, adapters: np.ndarray, *, ray_address: str | None = None
                     ) -> LLMBuild:
    """Merge ``adapters`` into ``bundle``'s model (in place), export and quantise
    (``ray_address``: quantise the variants as tasks on that Ray cluster, see
    :func:`quantize_variants` and :func:`sealfl.platform.simulate.attached_ray`).

    Raises:
        AdapterError: the adapter vector does not fit.
        ExportError / ReleaseError: the export or the quantisation failed.
    """
    t = {}
    t0 = time.perf_counter()
    merged = merge_adapters(bundle.model, spec, adapters)
    t["merge"] = time.perf_counter() - t0
    cfg = merged.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    gen = {**bundle.generation, "head_dim": head_dim,
           "max_context": int(min(MAX_CONTEXT, getattr(cfg, "max_position_embeddings", MAX_CONTEXT))),
           "special_tokens": _special_tokens(bundle)}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sealfl-export-") as work:
        proto = export_fp32(merged, bundle.tokenizer_json, bundle.chat_template, bundle.generation, work)
    t["export"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # the adapted layers: base blocks quantised, the LoRA update exact beside them (quantize.py)
    low_rank = adapter_low_rank(merged, spec, adapters, proto)
    try:
        if ray_address and ray_address != "local":
            from sealfl.platform.simulate import attached_ray

            with attached_ray(ray_address):
                variants, _ = quantize_variants(proto, (), low_rank=low_rank)
        else:
            variants, _ = quantize_variants(proto, (), low_rank=low_rank)
    except QuantizeError as exc:
        raise ReleaseError(f"cannot quantise the merged model: {exc}") from exc
    t["quantize"] = time.perf_counter() - t0
    del proto
    return LLMBuild(merged, variants, gen, head_dim, t)


def score_candidates(build: LLMBuild, blocks: np.ndarray, prefill: int | None = None) -> dict[str, GateCounts]:
    """Gate counts of every variant on held-out blocks (int64 (n, L)); ``prefill`` defaults
    to half a block (the rest is decoded token by token, as on a device)."""
    blocks = np.asarray(blocks)
    if blocks.ndim != 2 or blocks.shape[0] < 1:
        raise ReleaseError(f"the gate needs held-out blocks (n >= 1, L), got shape {blocks.shape}")
    p = prefill or max(1, blocks.shape[1] // 2)
    ref = reference_scores(build.merged, blocks)
    return {v: compare(ref, candidate_scores(b, blocks, build.head_dim, p)) for v, b in build.variants.items()}


def llm_release_files(build: LLMBuild, bundle: LMBundle, spec: LoraSpec, gate_counts: dict[str, GateCounts],
                      extra_metadata: dict | None = None, thresholds: dict = THRESHOLDS) -> tuple[dict, dict]:
    """Gate the candidates, build their canaries and assemble ``(payload, metadata)`` for
    :meth:`sealfl.enclave.release.enclave.ReleaseEnclave.write_release`.

    Raises:
        ReleaseError: a variant fails the gate (nothing is written).
    """
    report = check_gate(gate_counts, thresholds)
    cfg = build.merged.config
    payload = {f"model.{v}.onnx": b for v, b in build.variants.items()}
    payload["tokenizer.json"] = bundle.tokenizer_json
    payload["chat_template.jinja"] = bundle.chat_template.encode("utf-8")
    payload["generation_config.json"] = json.dumps(build.generation, sort_keys=True, indent=1).encode("utf-8")
    variants = {}
    for v, b in build.variants.items():
        canary = build_llm_canary(b, bundle.tokenizer_json, bundle.chat_template, build.generation, build.head_dim)
        variants[v] = {"file": f"model.{v}.onnx", "bytes": len(b), "quantization": dict(SCHEMES[v]),
                       "gate": report[v], "canary": canary}
    metadata = {
        "runtime": LLM_RUNTIME, "task": "causal-lm", "model_file": f"model.{DEFAULT_VARIANT}.onnx",
        "default_variant": DEFAULT_VARIANT, "variants": variants,
        "files": {"tokenizer": "tokenizer.json", "chat_template": "chat_template.jinja",
                  "generation_config": "generation_config.json"},
        "model": {"architecture": "llama", "layers": int(cfg.num_hidden_layers), "hidden": int(cfg.hidden_size),
                  "heads": int(cfg.num_attention_heads), "kv_heads": int(cfg.num_key_value_heads),
                  "head_dim": build.head_dim, "vocab": int(cfg.vocab_size), "tied_embeddings": True},
        "base_model": dict(bundle.source), "adapters": {"method": "LoRA", **spec.to_dict()},
        "corpus": {"source": SOURCE, "licence": LICENCE},
        "gate": {"reference": "float32 merged model (torch)", "thresholds": thresholds,
                 "held_out_positions": next(iter(gate_counts.values())).positions},
    }
    metadata.update(extra_metadata or {})
    return payload, metadata
