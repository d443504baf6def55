"""The ``causal-lm`` task: federated LoRA of SmolLM2-135M-Instruct on each partner's manual.

Flat vector: the LoRA adapters (:mod:`.lora`; 460,800 values for r=8 on q_proj/v_proj).
Partner data (:meth:`CausalLMTask.load_data`): its manual of the Python documentation
(:mod:`sealfl.clients.causal_lm.corpus`), tokenised with the base model's tokenizer into training
blocks of ``block-len`` tokens and up to ``eval-blocks`` held-out blocks of the same length.
``n`` (the FedAvg weight) is the number of training blocks.

Statistics round: ``[n, Σx, Σx²]`` with ``x`` = text tokens per training block (the block
length minus its document separators) -- the aggregator learns only the pooled sums,
and the round binds each partner to its ``n`` as in every task.

Training settings (round config, defaults :meth:`CausalLMTask.train_defaults`, chosen to fit
``make llm-demo`` into 25 minutes on 2 cores): ``local-steps`` AdamW steps of
``batch-size`` blocks at learning rate ``lr``.

Evaluation: ``n`` = predicted held-out positions, ``correct`` = positions whose top-1 token
is the true next token, ``loss`` = mean NLL (perplexity = exp(loss)).

Release gate scoring (:meth:`CausalLMTask.score_candidates`): on the held-out blocks, the
float32 merged model (base + global adapters, merged here) is the reference (``fp32``); the
base model is scored as ``base`` (perplexity before fine-tuning); each candidate ONNX model
is run as a device runs it. Per name: ``correct`` = positions whose top-1 equals the
reference's, ``n`` = positions, ``nll`` = summed NLL of the true next tokens.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from sealfl.clients.causal_lm.base import load_base_model
from sealfl.clients.causal_lm.corpus import PARTNER_MANUALS, load_partner_text
from sealfl.clients.causal_lm.lora import (
    LMTrainConfig,
    LoraSpec,
    attach_lora,
    init_adapters,
    load_adapters,
    train_local,
)
from sealfl.clients.causal_lm.text import token_blocks
from sealfl.he.decrypted import DecryptBounds

__all__ = ["CausalLMTask", "LMData", "BASE_ARCH"]

log = logging.getLogger(__name__)

#: SmolLM2-135M's architecture (the pinned GGUF's header), for sizes known without loading it.
BASE_ARCH = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
             "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}


@dataclass
class LMData:
    """One partner's tokenised text.

    Attributes:
        partner: partner name.
        train: int64 (n, L) training blocks.
        heldout: int64 (m, L) held-out blocks (m <= eval-blocks).
        eos_id: the separator token id.
    """

    partner: str
    train: np.ndarray
    heldout: np.ndarray
    eos_id: int


class CausalLMTask:
    """Federated LoRA on the causal LM (module docstring)."""

    name = "causal-lm"
    release_kind = "causal-lm"
    release_name = "smollm2-python-docs"
    partners = tuple(PARTNER_MANUALS)
    partners_doc = "the Python documentation manuals"
    spec = LoraSpec()
    stats_length = 3
    #: LoRA values stay far below 100 (A starts within ±1/sqrt(576) ≈ 0.04, B at 0); a
    #: decrypted average beyond that is corrupt or poisoned. Token counts per block < 10^4.
    decrypt_bounds = DecryptBounds(param_abs_max=100.0, feature_abs_max=1e4)
    candidate_sums = ("nll",)
    reference_candidates = ("fp32", "base")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._bundle = None
        self._peft = None
        self._n_params = None

    # -- sizes ------------------------------------------------------------------------

    @property
    def n_params(self) -> int:
        """Length of the adapter vector (from the base architecture, no weights loaded)."""
        if self._n_params is None:
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM

            from sealfl.clients.causal_lm.lora import n_adapter_params

            with torch.device("meta"):
                model = LlamaForCausalLM(LlamaConfig(**BASE_ARCH))
            self._n_params = n_adapter_params(model, self.spec)
        return self._n_params

    def init_params(self, seed: int = 0) -> np.ndarray:
        """The public initial adapters (B = 0: the initial model is the base model)."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**BASE_ARCH))
        return init_adapters(model, self.spec, seed)

    def train_defaults(self) -> dict:
        return {"local-steps": 6, "batch-size": 4, "lr": 4e-3, "block-len": 128, "eval-blocks": 8, "seed": 0}

    # -- partner side -------------------------------------------------------------------

    def bundle(self):
        """The base model (loaded once per process; :func:`.base.load_base_model`)."""
        with self._lock:
            if self._bundle is None:
                self._bundle = load_base_model()
            return self._bundle

    def _peft_model(self):
        with self._lock:
            if self._peft is None:
                self._peft = attach_lora(self._bundle_model_clone(), self.spec)
            return self._peft

    def _bundle_model_clone(self):
        return self.bundle().clone().model

    def load_data(self, partner: str, config: Mapping) -> LMData:
        """Tokenised training and held-out blocks of the partner's manual."""
        b = self.bundle()
        L = int(config.get("block-len", 128))
        if config.get("data-path"):  # the partner's own directory of text files
            from sealfl.clients.causal_lm.corpus import load_own_text

            pt = load_own_text(partner, str(config["data-path"]), seed=int(config.get("data-seed", 0)))
        else:
            pt = load_partner_text(partner, seed=int(config.get("data-seed", 0)))
        eos = int(b.generation["eos_token_ids"][0])
        train = token_blocks(b.tokenizer_json, pt.train, L, eos)
        held = token_blocks(b.tokenizer_json, pt.heldout, L, eos, max_blocks=int(config.get("eval-blocks", 8)))
        if len(train) < 1 or len(held) < 1:
            from sealfl.clients.errors import DataError

            raise DataError(f"partner {partner}: not enough text for one {L}-token training and held-out block")
        return LMData(partner, train, held, eos)

    def local_stats(self, data: LMData) -> np.ndarray:
        x = np.sum(data.train != data.eos_id, axis=1).astype(np.float64)
        return np.array([len(x), x.sum(), np.square(x).sum()], dtype=np.float64)

    def n_train(self, data: LMData) -> int:
        return int(len(data.train))

    def train_round(self, params, data: LMData, mean, std, config: Mapping, seed: int) -> tuple[np.ndarray, dict]:
        d = self.train_defaults()
        cfg = LMTrainConfig(steps=int(config.get("local-steps", d["local-steps"])),
                            batch_size=int(config.get("batch-size", d["batch-size"])),
                            lr=float(config.get("lr", d["lr"])), seed=int(config.get("seed", d["seed"])))
        return train_local(self._peft_model(), self.spec, params, data.train, cfg, cfg.seed + seed)

    def dp_gradient_sum(self, params, data: LMData, idx: np.ndarray, mean, std, clip: float) -> np.ndarray:
        """Σ over the training blocks ``idx`` of each block's clipped adapter gradient
        (Opacus; :func:`.lora.dp_gradient_sum`): float64 (P,)."""
        from sealfl.clients.causal_lm.lora import dp_gradient_sum

        return dp_gradient_sum(self._peft_model(), self.spec, params, data.train[np.asarray(idx, dtype=np.int64)], clip)

    def evaluate_round(self, params, data: LMData, mean, std) -> dict:
        import torch

        pm = self._peft_model()
        load_adapters(pm, self.spec, params)
        nll, correct, n = 0.0, 0, 0
        with torch.no_grad():
            for b in data.heldout:
                ids = torch.as_tensor(b[None], dtype=torch.long)
                logits = pm(input_ids=ids).logits[0, :-1].double()
                tgt = ids[0, 1:]
                nll += float(-torch.log_softmax(logits, -1).gather(-1, tgt[:, None]).sum())
                correct += int((logits.argmax(-1) == tgt).sum())
                n += int(tgt.numel())
        return {"n": n, "correct": correct, "loss": nll / max(n, 1)}

    def score_candidates(self, candidates: Mapping[str, bytes], data: LMData, params, mean=None, std=None) -> dict:
        """Gate counts (module docstring) for ``fp32``, ``base`` and every candidate."""
        from sealfl.clients.causal_lm.merge import merge_adapters
        from sealfl.clients.causal_lm.scoring import candidate_scores, reference_scores

        base = self.bundle().clone()
        cfg = base.model.config
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        base_scores = reference_scores(base.model, data.heldout)
        merged = merge_adapters(base.model, self.spec, params)
        ref = reference_scores(merged, data.heldout)
        del merged, base

        def counts(scores) -> dict:
            return {"correct": int(sum(int(np.sum(c[0] == r[0])) for c, r in zip(scores, ref))),
                    "n": int(sum(len(r[0]) for r in ref)), "nll": float(sum(float(c[1].sum()) for c in scores))}

        out = {"fp32": counts(ref), "base": counts(base_scores)}
        prefill = max(1, data.heldout.shape[1] // 2)
        for name, blob in candidates.items():
            out[name] = counts(candidate_scores(blob, data.heldout, head_dim, prefill))
        return out
