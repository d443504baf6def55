"""Helpers for messages about hostile or foreign text (sealfl.common.errors)."""

from sealfl.common.errors import plain_text


def test_kind_text_from_another_program_is_plain_in_messages():
    coloured = "\x1b[0;93mwarning\x1b[m\n\x1b]0;title\x07\x1b[2K\rERROR: it broke\x00\n"
    assert plain_text(coloured) == "warning | ERROR: it broke"
    assert plain_text("x" * 50 + "the end", 10) == "...the end"
