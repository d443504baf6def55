"""The partners' text: one documentation manual per partner, 10 % held out, every file checked."""

import os

import pytest

from sealfl.clients.causal_lm.corpus import (
    CHUNK_CHARS,
    MAX_FILE_BYTES,
    PARTNER_MANUALS,
    CorpusError,
    find_sources_dir,
    load_partner_text,
    read_manual,
    split_text,
)


def _tree(root, manuals=PARTNER_MANUALS.values(), docs=6, paras=40):
    for m in manuals:
        for d in range(docs):
            p = root / m / (f"sub/doc{d}.rst.txt" if d == 0 else f"doc{d}.rst.txt")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("\n\n".join(f"{m} document {d} paragraph {i}: " + "word " * (5 + (i * 7) % 30)
                                     for i in range(paras)), encoding="utf-8")
    return root


def test_kind_each_partner_reads_only_its_own_manual(tmp_path):
    _tree(tmp_path)
    for partner, manual in PARTNER_MANUALS.items():
        pt = load_partner_text(partner, tmp_path)
        assert pt.files and all(f.startswith(manual + "/") for f in pt.files)
        assert all(c.startswith(f"{manual} document") for c in pt.train + pt.heldout)
    assert len(PARTNER_MANUALS) >= 4


def test_kind_heldout_is_at_least_ten_percent_and_disjoint_and_deterministic(tmp_path):
    _tree(tmp_path)
    a = load_partner_text("howto", tmp_path, seed=3)
    b = load_partner_text("howto", tmp_path, seed=3)
    c = load_partner_text("howto", tmp_path, seed=4)
    assert a.train == b.train and a.heldout == b.heldout
    assert a.heldout != c.heldout
    assert 0.10 <= a.heldout_fraction < 0.10 + CHUNK_CHARS / sum(map(len, a.train + a.heldout)) + 1e-9
    assert not set(a.train) & set(a.heldout)
    # nothing lost, nothing invented: the chunks hold every paragraph once
    docs = read_manual(tmp_path, "howto")
    paras = sorted(p for t in docs.values() for p in t.split("\n\n"))
    assert sorted(p for c in a.train + a.heldout for p in c.split("\n\n")) == paras


def test_kind_split_needs_two_chunks_and_a_fraction_in_range():
    with pytest.raises(CorpusError):
        split_text({"a.rst.txt": "only one short paragraph"})
    with pytest.raises(CorpusError):
        split_text({"a.rst.txt": "x\n\ny"}, fraction=1.0)


@pytest.mark.parametrize("kind", ["symlink", "not-utf8", "oversize", "fifo"])
def test_kind_hostile_corpus_files_are_refused_naming_the_file(tmp_path, kind):
    _tree(tmp_path, manuals=["faq"])
    bad = tmp_path / "faq" / "bad.rst.txt"
    if kind == "symlink":
        bad.symlink_to(tmp_path / "faq" / "doc1.rst.txt")
    elif kind == "not-utf8":
        bad.write_bytes(b"caf\xe9 au lait\n")
    elif kind == "oversize":
        with open(bad, "wb") as fh:
            fh.truncate(MAX_FILE_BYTES + 1)
    else:
        os.mkfifo(bad)
    with pytest.raises(CorpusError, match="bad.rst.txt"):
        read_manual(tmp_path, "faq")


def test_kind_missing_corpus_or_partner_says_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(CorpusError, match="not found"):
        read_manual(tmp_path, "faq")
    with pytest.raises(CorpusError, match="causal-LM partners"):
        load_partner_text("cleveland", tmp_path)
    monkeypatch.setenv("SEALFL_CORPUS_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(CorpusError, match="SEALFL_CORPUS_DIR"):
        find_sources_dir()
