"""Incremental detokenisation against the tokenizer's own decoding of the whole sequence:
characters split over tokens, invalid bytes, special tokens, and a decoder that treats the
first token of a window differently."""

import pytest
from tokenizers import Tokenizer, decoders, models

from sealfl.enclave.sandbox.detokenize import IncrementalDetokenizer
from tests.support.llm_tiny import tokenizer_json


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_str(tokenizer_json().decode())


def _pieces(tok, ids):
    d = IncrementalDetokenizer(tok)
    pieces = [d.add(i) for i in ids]
    return pieces, d.flush()


def test_kind_a_character_split_over_tokens_comes_out_whole_once_complete(tok):
    ids = tok.encode("café", add_special_tokens=False).ids
    # the tiny tokenizer never saw "é": its two UTF-8 bytes (c3 a9) are two tokens, and
    # either alone decodes to U+FFFD
    assert len(ids) == 5 and tok.decode(ids[3:4]) == "\ufffd" and tok.decode(ids[4:5]) == "\ufffd"
    pieces, rest = _pieces(tok, ids)
    assert pieces == ["c", "a", "f", "", "é"] and rest == ""


@pytest.mark.parametrize("text", ["🙂 ok", "日本語のテキスト", "naïve café — 10 €", "def f(x):\n    return x + 1\n"])
def test_kind_pieces_join_to_the_whole_sequence_decoded_and_hold_no_partial_character(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.split())  # characters really are split over tokens
    pieces, rest = _pieces(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in p for p in pieces) and rest == ""
    # after each token, what was handed out is the longest complete prefix of the text so far
    d, out = IncrementalDetokenizer(tok), ""
    for n, i in enumerate(ids, 1):
        out += d.add(i)
        assert tok.decode(ids[:n]).rstrip("\ufffd") == out


def test_kind_invalid_bytes_and_special_tokens_decode_as_the_whole_sequence_does(tok):
    a, b = tok.encode("a", add_special_tokens=False).ids, tok.encode("b", add_special_tokens=False).ids
    lone = tok.encode("é", add_special_tokens=False).ids  # [c3, a9]
    eos = tok.token_to_id("<|im_end|>")
    cases = [a + lone[1:] + b,  # a continuation byte with no lead byte: U+FFFD in the middle
             a + lone[:1] + b,  # a lead byte whose continuation never comes
             a + [eos] + lone + [eos] + b,  # special tokens are skipped, also inside a character
             a + lone[:1]]  # the sequence ends inside a character: the flush hands out U+FFFD
    for ids in cases:
        pieces, rest = _pieces(tok, ids)
        assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=True), ids
    assert _pieces(tok, a + lone[:1])[1] == "\ufffd"
    assert _pieces(tok, [eos])[0] == [""]


def test_kind_a_decoder_that_strips_the_first_space_of_a_window_loses_no_space():
    """SentencePiece's Metaspace decoder drops the leading space of the first token it
    decodes: decoding each token alone would glue the words together."""
    vocab = {"▁hello": 0, "▁world": 1, "!": 2, "<unk>": 3}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    ids = [0, 1, 2, 1]
    assert t.decode([1]) == "world"  # alone, the space is gone
    pieces, rest = _pieces(t, ids)
    assert "".join(pieces) + rest == t.decode(ids) == "hello world! world"
