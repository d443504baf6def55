"""Token blocks and perplexity for the causal-LM task.

Blocks (:func:`token_blocks`): each text chunk is encoded with the release's tokenizer
(``tokenizers``; no special tokens added), the chunks are joined with one EOS token between
them, and the stream is cut into non-overlapping blocks of ``block_len`` tokens (a shorter
tail is dropped).

Perplexity (:func:`nll_sums`): for a block ``t_0 .. t_{L-1}`` the model predicts
``t_1 .. t_{L-1}``; the summed negative log-likelihood (natural log) and the count of
predicted tokens are returned, so sums from several partners pool exactly:
``perplexity = exp(Σ nll / Σ n)`` (Jurafsky & Martin, *Speech and Language Processing*,
3rd ed., ch. 3).
"""

from __future__ import annotations

import math

import numpy as np

from sealfl.clients.errors import TaskInputError

__all__ = ["token_blocks", "nll_sums", "perplexity"]


def token_blocks(tokenizer_json: bytes, chunks, block_len: int, eos_id: int, max_blocks: int | None = None) -> np.ndarray:
    """Encode and cut text into int64 blocks of shape (n, block_len) (module docstring).

    ``max_blocks`` keeps only the first blocks. Raises ValueError for ``block_len < 2``.
    """
    from tokenizers import Tokenizer

    if block_len < 2:
        raise TaskInputError(f"block_len must be >= 2, got {block_len}")
    tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    stream: list[int] = []
    need = None if max_blocks is None else max_blocks * block_len
    for c in chunks:
        stream += tok.encode(c, add_special_tokens=False).ids
        stream.append(int(eos_id))
        if need is not None and len(stream) >= need:
            break
    n = len(stream) // block_len
    if max_blocks is not None:
        n = min(n, max_blocks)
    return np.asarray(stream[: n * block_len], dtype=np.int64).reshape(n, block_len)


def nll_sums(model, blocks: np.ndarray, batch_size: int = 4) -> tuple[float, int]:
    """Summed next-token NLL (nats, float) and predicted-token count (int) of a torch
    causal LM (anything returning ``.logits`` (b, L, V)) over int64 blocks (n, L)."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(blocks), batch_size):
            ids = torch.as_tensor(blocks[i:i + batch_size], dtype=torch.long)
            logits = model(input_ids=ids).logits[:, :-1].double()
            logp = torch.log_softmax(logits, dim=-1)
            tgt = ids[:, 1:]
            total += float(-logp.gather(-1, tgt.unsqueeze(-1)).sum())
            count += int(tgt.numel())
    return total, count


def perplexity(nll_sum: float, count: int) -> float:
    """``exp(nll_sum / count)``; NaN for ``count == 0``."""
    return math.exp(nll_sum / count) if count > 0 else float("nan")
