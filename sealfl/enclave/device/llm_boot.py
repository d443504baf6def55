"""Booting a causal-LM release: which files, how to start the runtime, how to accept it.

A release is a causal LM when its signed metadata says ``"runtime": "onnx-causal-lm/v1"``.
Its metadata then carries (all file names are payload files, so every byte went through
the manifest, the DSSE signature and the attestation before anything here reads it)::

    "variants": {"int4": {"file": "model.int4.onnx", "canary": {sealfl.llm-canary/v1}, ...},
                 "int8": {...}},
    "default_variant": "int4",
    "files": {"tokenizer": "tokenizer.json", "chat_template": "chat_template.jinja",
              "generation_config": "generation_config.json"}

``generation_config.json`` (strict JSON): ``bos_token_id``, ``eos_token_ids`` (non-empty),
``pad_token_id``, ``head_dim``, ``max_context`` (16..131072) and ``special_tokens`` (names
to strings, passed to the chat template).

:func:`boot_llm` starts :class:`~sealfl.enclave.sandbox.llm_runtime.LLMRuntime` from those verified
bytes, then accepts the model only if a one-token greedy generation works and the
variant's signed canary holds on this device (:func:`sealfl.attestation.llm_canary.check_llm_canary`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sealfl.attestation.canonical import JSONFormatError, loads_strict
from sealfl.attestation.errors import CanaryError
from sealfl.attestation.llm_canary import check_llm_canary, parse_llm_canary
from sealfl.enclave.errors import BootError, RuntimeSandboxError
from sealfl.enclave.sandbox.decode import SamplingParams
from sealfl.enclave.sandbox.llm_runtime import LLMRuntime

__all__ = ["LLM_RUNTIME", "LLMReleaseSpec", "is_llm_release", "llm_spec", "llm_files_to_keep", "parse_generation_config",
           "boot_llm"]

log = logging.getLogger(__name__)

LLM_RUNTIME = "onnx-causal-lm/v1"
_FILE_ROLES = ("tokenizer", "chat_template", "generation_config")


@dataclass(frozen=True)
class LLMReleaseSpec:
    """What :func:`llm_spec` found in a verified causal-LM release.

    Attributes:
        variant: the chosen model variant (e.g. ``"int4"``).
        model_file: its payload file.
        files: role -> payload file name (tokenizer, chat_template, generation_config).
        generation: the parsed generation settings.
        canary: the variant's raw canary object.
    """

    variant: str
    model_file: str
    files: dict
    generation: dict
    canary: dict


def is_llm_release(metadata: Mapping) -> bool:
    """True if the signed metadata names the causal-LM runtime."""
    return metadata.get("runtime") == LLM_RUNTIME


def llm_files_to_keep(metadata: Mapping, payload_names, variant: str | None = None) -> set[str] | None:
    """The payload files a device booting ``variant`` (default: ``default_variant``) of a
    causal-LM release must hold: every payload file but the *other* variants' model files
    -- those are verified as they stream past and dropped
    (:func:`sealfl.attestation.reader.load_release` ``keep``): for SmolLM2 the parent then
    holds the 125 MB INT4 model, not 125 + 172 MB. Pure; never raises: None (keep
    everything) for a release that is not a causal LM or whose variants do not name the
    chosen one (:func:`llm_spec` then refuses it with the reason).

    Args:
        metadata: the signed metadata.
        payload_names: every signed payload file name.
        variant: the variant the device runs, or None for the release's default.
    """
    variants = metadata.get("variants") if is_llm_release(metadata) else None
    name = variant or (metadata.get("default_variant") if isinstance(variants, dict) else None)
    if not isinstance(variants, dict) or not isinstance(variants.get(name), dict) \
            or not isinstance(variants[name].get("file"), str):
        return None
    others = {v.get("file") for k, v in variants.items() if k != name and isinstance(v, dict)}
    others.discard(variants[name]["file"])
    return {n for n in payload_names if n not in others}


def _bad(msg: str) -> BootError:
    return BootError(msg, reason="model")


def parse_generation_config(data: bytes) -> dict:
    """Parse and check ``generation_config.json`` (module docstring).

    Raises:
        BootError: (reason ``"model"``) not strict JSON or a field missing / of the wrong type.
    """
    try:
        doc = loads_strict(data)
    except JSONFormatError as exc:
        raise _bad(f"generation_config.json is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise _bad("generation_config.json must be a JSON object")

    def integer(key: str, lo: int, hi: int) -> int:
        v = doc.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise _bad(f"generation_config.json field {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
        return v

    out: dict[str, Any] = {"bos_token_id": integer("bos_token_id", 0, 10**7),
                           "pad_token_id": integer("pad_token_id", 0, 10**7),
                           "head_dim": integer("head_dim", 1, 4096),
                           "max_context": integer("max_context", 16, 131072)}
    eos = doc.get("eos_token_ids")
    if not isinstance(eos, list) or not 1 <= len(eos) <= 16 or \
            any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e <= 10**7 for e in eos):
        raise _bad("generation_config.json field 'eos_token_ids' must be a list of 1..16 token ids")
    out["eos_token_ids"] = list(eos)
    special = doc.get("special_tokens", {})
    if not isinstance(special, dict) or len(special) > 32 or \
            any(not isinstance(k, str) or not isinstance(v, str) or len(v) > 256 for k, v in special.items()):
        raise _bad("generation_config.json field 'special_tokens' must map up to 32 names to short strings")
    out["special_tokens"] = dict(special)
    return out


def llm_spec(payload: Mapping[str, bytes], metadata: Mapping, variant: str | None = None) -> LLMReleaseSpec:
    """Select the variant and its files from a verified causal-LM release.

    Raises:
        BootError: (reason ``"model"``) unknown variant, a file role missing or not a
            payload file, or a generation config that does not parse.
    """
    variants = metadata.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise _bad("causal-LM release metadata has no 'variants'")
    name = variant or metadata.get("default_variant")
    if name not in variants or not isinstance(variants[name], dict):
        raise _bad(f"the release has no model variant {name!r}; it has {sorted(variants)}")
    v = variants[name]
    files = metadata.get("files")
    if not isinstance(files, dict) or any(not isinstance(files.get(r), str) for r in _FILE_ROLES):
        raise _bad(f"causal-LM release metadata 'files' must name {list(_FILE_ROLES)}")
    for role, f in [("model", v.get("file"))] + [(r, files[r]) for r in _FILE_ROLES]:
        if not isinstance(f, str) or f not in payload:
            raise _bad(f"the release's {role} file {f!r} is not one of its verified payload files")
    gen = parse_generation_config(payload[files["generation_config"]])
    return LLMReleaseSpec(name, v["file"], {r: files[r] for r in _FILE_ROLES}, gen, v.get("canary"))


def boot_llm(payload: Mapping[str, bytes], metadata: Mapping, variant: str | None = None,
             runtime_options: Mapping[str, Any] | None = None) -> tuple[LLMRuntime, LLMReleaseSpec, dict]:
    """Start and accept the causal-LM runtime of a verified release.

    Returns:
        ``(runtime, spec, canary statistics)``; the caller closes the runtime.

    Raises:
        BootError: reason ``"model"`` (metadata/files), ``"runtime"`` (the child could not
            load the model, or the tokenizer/template do not parse), ``"health-check"``
            (one-token generation failed) or ``"canary"`` (missing, malformed or failed).
    """
    spec = llm_spec(payload, metadata, variant)
    try:
        template = payload[spec.files["chat_template"]].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(f"{spec.files['chat_template']} is not UTF-8 text") from exc
    gen = dict(spec.generation)
    try:
        runtime = LLMRuntime(payload[spec.model_file], payload[spec.files["tokenizer"]], template, gen,
                             **dict(runtime_options or {}))
    except (RuntimeSandboxError, ValueError) as exc:
        raise BootError(f"cannot start the LLM runtime for {spec.model_file}: {exc}", reason="runtime") from exc
    try:
        runtime.health_check()
        runtime.generate(runtime.encode("Hello"), SamplingParams(max_tokens=1))
    except (RuntimeSandboxError, ValueError) as exc:
        runtime.close()
        raise BootError(f"health check of {spec.model_file} failed: {exc}", reason="health-check") from exc
    try:
        if spec.canary is None:
            raise CanaryError(f"model variant {spec.variant!r} carries no canary; a causal-LM release must")
        canary = parse_llm_canary(spec.canary)
        if any(t >= canary.vocab for s in canary.sequences for t in s):
            raise CanaryError("canary token ids exceed its vocabulary")
        stats = check_llm_canary(canary, runtime.score(canary.sequences, canary.prefill, top_k=1))
    except CanaryError as exc:
        runtime.close()
        raise BootError(f"{spec.model_file} fails its signed canary on this device: {exc}", reason="canary") from exc
    except (RuntimeSandboxError, ValueError) as exc:
        runtime.close()
        raise BootError(f"cannot run the canary of {spec.model_file}: {exc}", reason="health-check") from exc
    log.info("LLM variant %s accepted: canary agreement %.3f, mean |Δ| %.3f", spec.variant, stats["agreement"],
             stats["mean_abs_diff"])
    return runtime, spec, stats
