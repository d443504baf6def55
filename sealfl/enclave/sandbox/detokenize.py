"""Incremental detokenisation: the text of a growing token sequence, one token at a time,
without decoding the whole sequence again at every step.

The method is the windowed one of vLLM's ``detokenize_incrementally``
(``vllm/transformers_utils/detokenizer_utils.py``) and of Hugging Face's ``TextStreamer``:
two offsets into the ids, ``prefix`` (where the last window began) and ``read`` (the ids
whose text has been handed out). Per new token the ids ``[prefix:]`` are decoded and
compared with the text of ``[prefix:read]``; the difference is new text unless it ends in
U+FFFD -- the replacement a byte-level tokenizer decodes for the first bytes of a UTF-8
character whose remaining bytes have not been generated yet (``"é"`` = ``c3 a9`` split over
two tokens). Held back, those bytes come out as the character once the token that
completes it arrives, or as U+FFFD at :meth:`IncrementalDetokenizer.flush` if it never does.

Why the window and the difference rather than one token's text on its own: decoders such
as SentencePiece's Metaspace drop the leading space of the *first* token they decode, and
a lone token of a split character decodes to U+FFFD. Both windows start at the same id, so
what the decoder does at a window's start cancels out.

The concatenation of every piece and the flush equals ``tokenizer.decode(ids,
skip_special_tokens=True)`` of the whole sequence for byte-level BPE (SmolLM2's
tokenizer): UTF-8 is self-synchronising, so the decoding of bytes that end on a complete
character is a prefix of the decoding of any continuation (tests/enclave/sandbox/
test_detokenize.py checks it on split characters, invalid bytes and special tokens).
Cost per token: two decodes of a window of a few ids, whatever the length so far.
"""

from __future__ import annotations

__all__ = ["IncrementalDetokenizer"]

_PENDING = "\ufffd"


class IncrementalDetokenizer:
    """Text of a token sequence built one id at a time (module docstring).

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (its ``decode(ids, skip_special_tokens=True)``).
    """

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = self._read = 0
        self._prefix_text = ""  # text of ids[prefix:read]

    def _decode(self, ids) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def _advance(self, text: str) -> str:
        new = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix:self._read])
        return new

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes ("" while a character is still
        unfinished, or for a special token)."""
        self.ids.append(int(token_id))
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(self._prefix_text) or text.endswith(_PENDING):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """The text held back (bytes of an unfinished character, decoded as U+FFFD);
        after it the pieces handed out join to the whole sequence's text."""
        if self._read == len(self.ids):
            return ""
        return self._advance(self._decode(self.ids[self._prefix:]))
