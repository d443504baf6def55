"""Partners' text for the causal-LM task: the Python documentation, one manual per partner.

Source: the reStructuredText sources of the Python 3 documentation as Debian ships them
in ``python3.X-doc`` (``/usr/share/doc/python3.X/html/_sources/<manual>/*.rst.txt``;
installed by ``make llm-deps``). Written by the Python developers, not generated.

Licence: PSF License Agreement (Python 2.0 licence) for the documentation text; code
examples in the documentation are also available under the Zero-Clause BSD licence
(Python docs, "History and License"; Debian: ``/usr/share/doc/python3.X-doc/copyright``).
:data:`LICENCE` records it and the release metadata repeats it.

Partners are the natural sources -- one manual of the documentation each
(:data:`PARTNER_MANUALS`): the Tutorial, the HOWTOs, the FAQs and the Language Reference.

Held-out text (:func:`split_text`): every document is cut at blank lines into chunks of at
most :data:`CHUNK_CHARS` characters; chunks are shuffled with a seeded NumPy PCG64
generator and taken in that order into the held-out set until it holds at least
:data:`HELDOUT_FRACTION` (10 %) of the partner's characters; the rest is training text.
The split depends only on the files and the seed.

Everything read here is checked before use: only regular files named ``*.rst.txt`` (no
symbolic links), each at most :data:`MAX_FILE_BYTES`, a manual at most
:data:`MAX_MANUAL_BYTES` in total, strict UTF-8; otherwise :class:`CorpusError` names the
file and what to do.
"""

from __future__ import annotations

import glob
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sealfl.clients.errors import DataError

__all__ = ["CorpusError", "PARTNER_MANUALS", "LICENCE", "SOURCE", "HELDOUT_FRACTION", "CHUNK_CHARS",
           "MAX_FILE_BYTES", "MAX_MANUAL_BYTES", "PartnerText", "find_sources_dir", "read_manual",
           "split_text", "load_partner_text", "load_own_text", "OWN_TEXT_SUFFIXES"]

log = logging.getLogger(__name__)

#: Partner name -> manual directory under ``_sources`` (the natural split of the docs).
PARTNER_MANUALS: dict[str, str] = {
    "tutorial": "tutorial",
    "howto": "howto",
    "faq": "faq",
    "reference": "reference",
}
SOURCE = "Python 3 documentation, reStructuredText sources (Debian package python3.X-doc)"
LICENCE = ("PSF License Agreement (Python 2.0 licence); documentation code examples also Zero-Clause BSD. "
           "Copyright Python Software Foundation. See /usr/share/doc/python3.X-doc/copyright.")
#: Environment variable naming another ``_sources`` directory (tests, other installs).
SOURCES_ENV = "SEALFL_CORPUS_DIR"
_DEFAULT_GLOB = "/usr/share/doc/python3*/html/_sources"
HELDOUT_FRACTION = 0.10
CHUNK_CHARS = 2000
MAX_FILE_BYTES = 4 * 1024**2
MAX_MANUAL_BYTES = 64 * 1024**2
MAX_FILES = 2000


class CorpusError(DataError):
    """The partner's text is missing or unreadable; the message names the file and the fix."""


@dataclass(frozen=True)
class PartnerText:
    """One partner's text, split.

    Attributes:
        partner: partner name (a key of :data:`PARTNER_MANUALS`).
        manual: the manual directory it came from.
        files: relative paths of the documents read (sorted).
        train: training chunks (str), in document order.
        heldout: held-out chunks (str), in document order.
    """

    partner: str
    manual: str
    files: tuple[str, ...]
    train: tuple[str, ...] = field(repr=False)
    heldout: tuple[str, ...] = field(repr=False)

    @property
    def heldout_fraction(self) -> float:
        """Held-out characters / all characters."""
        h = sum(map(len, self.heldout))
        return h / max(h + sum(map(len, self.train)), 1)


def find_sources_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The documentation ``_sources`` directory: ``explicit``, else ``$SEALFL_CORPUS_DIR``,
    else the newest ``/usr/share/doc/python3*/html/_sources``.

    Raises:
        CorpusError: none exists (install it with ``make llm-deps``, i.e.
            ``apt-get install python3-doc``).
    """
    if explicit is None:
        explicit = os.environ.get(SOURCES_ENV) or None
    if explicit is not None:
        p = Path(explicit)
        if not p.is_dir():
            raise CorpusError(f"corpus directory {p} does not exist; point {SOURCES_ENV} at the "
                              "documentation's _sources directory")
        return p
    # Debian links several python3* doc directories to the one real python3.X/html; use
    # each real directory once, the highest Python version
    real = {os.path.realpath(p) for p in glob.glob(_DEFAULT_GLOB)}
    found = sorted((p for p in real if os.path.isdir(os.path.join(p, "tutorial"))),
                   key=lambda s: [int(x) if x.isdigit() else x for x in s.replace(".", "/").split("/")])
    if not found:
        raise CorpusError("the Python documentation sources are not installed (no "
                          f"{_DEFAULT_GLOB}); run 'make llm-deps' (apt-get install python3-doc) "
                          f"or set {SOURCES_ENV}")
    return Path(found[-1])


#: what to do about a bad file of the bundled manuals / of a partner's own --data directory
_FIX_BUNDLED = "this is not the documentation sealfl expects; reinstall the documentation"
_FIX_OWN = "fix or remove it in your --data directory"


def _read_file(root_fd: int, rel: str, remaining: int, fix: str = _FIX_BUNDLED) -> str:
    try:
        fd = os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=root_fd)
    except OSError as exc:
        raise CorpusError(f"corpus file {rel}: cannot open ({exc.strerror or exc}); symbolic links are not read") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorpusError(f"corpus file {rel} is not a regular file")
        cap = min(MAX_FILE_BYTES, remaining)
        if st.st_size > cap:
            raise CorpusError(f"corpus file {rel} has {st.st_size} bytes, over the cap of {cap}; {fix}")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise CorpusError(f"corpus file {rel} grew past the cap of {cap} bytes while read; {fix}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"corpus file {rel} is not UTF-8 text (byte {exc.start}); {fix}") from exc


def read_manual(sources: str | os.PathLike, manual: str, suffixes: tuple[str, ...] = (".rst.txt",), *,
                own: bool = False) -> dict[str, str]:
    """Read every document of one manual whose name ends with one of ``suffixes``
    (default ``*.rst.txt``; recursively), sorted by path. ``own``: the directory is a
    partner's own ``--data`` (messages name it so and say to fix the file, not to reinstall
    the documentation).

    Returns:
        ``{path relative to sources: text}`` (at least one document).

    Raises:
        CorpusError: the manual is missing or empty, a file is not a regular file, is over
            the caps or not UTF-8.
    """
    root = Path(sources) / manual
    what = f"--data {root}" if own else f"manual {manual!r} under {sources}"
    if not root.is_dir() or root.is_symlink():
        raise CorpusError(f"{what} not found (expected a directory {root})")
    rels = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for f in sorted(filenames):
            if f.endswith(suffixes):
                rels.append(os.path.relpath(os.path.join(dirpath, f), sources))
        if len(rels) > MAX_FILES:
            raise CorpusError(f"{what} has more than {MAX_FILES} documents")
    if not rels:
        raise CorpusError(f"{what} has no {' / '.join('*' + x for x in suffixes)} documents")
    out: dict[str, str] = {}
    total = 0
    dfd = os.open(str(sources), os.O_RDONLY | os.O_DIRECTORY)
    try:
        for rel in sorted(rels):
            text = _read_file(dfd, rel, MAX_MANUAL_BYTES - total, _FIX_OWN if own else _FIX_BUNDLED)
            total += len(text.encode("utf-8"))
            out[rel] = text
    finally:
        os.close(dfd)
    return out


def _chunks(text: str, limit: int) -> list[str]:
    """Cut at blank lines into chunks of at most ``limit`` characters (a longer paragraph
    is cut at ``limit``)."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        while len(para) > limit:
            if cur:
                out.append(cur)
                cur = ""
            out.append(para[:limit])
            para = para[limit:]
        piece = para if not cur else cur + "\n\n" + para
        if len(piece) > limit:
            out.append(cur)
            cur = para
        else:
            cur = piece
    if cur.strip():
        out.append(cur)
    return [c for c in out if c.strip()]


def split_text(docs: dict[str, str], fraction: float = HELDOUT_FRACTION, seed: int = 0,
               chunk_chars: int = CHUNK_CHARS) -> tuple[list[str], list[str]]:
    """Split documents into (train, heldout) chunks (module docstring). ``fraction`` in (0, 1).

    Returns two lists of chunks in document order; held-out holds at least ``fraction``
    of the characters (and at least one chunk), training at least one chunk.

    Raises:
        CorpusError: fewer than two chunks, or ``fraction`` outside (0, 1).
    """
    if not 0 < fraction < 1:
        raise CorpusError(f"held-out fraction must lie in (0, 1), got {fraction}")
    chunks = [c for rel in sorted(docs) for c in _chunks(docs[rel], chunk_chars)]
    if len(chunks) < 2:
        raise CorpusError(f"{len(chunks)} text chunk(s) cannot be split into training and held-out text")
    order = np.random.default_rng(seed).permutation(len(chunks))
    total = sum(map(len, chunks))
    held, got = set(), 0
    for i in order:
        if got >= fraction * total:
            break
        held.add(int(i))
        got += len(chunks[i])
    if len(held) == len(chunks):
        held.discard(int(order[-1]))
    return ([c for i, c in enumerate(chunks) if i not in held], [c for i, c in enumerate(chunks) if i in held])


def load_partner_text(partner: str, sources: str | os.PathLike | None = None, seed: int = 0) -> PartnerText:
    """Read and split one partner's manual.

    Raises:
        CorpusError: unknown partner, missing corpus, or a bad file (see :func:`read_manual`).
    """
    if partner not in PARTNER_MANUALS:
        raise CorpusError(f"no text for partner {partner!r}; the causal-LM partners are {sorted(PARTNER_MANUALS)}")
    src = find_sources_dir(sources)
    docs = read_manual(src, PARTNER_MANUALS[partner])
    train, held = split_text(docs, seed=seed)
    log.info("partner %s: %d documents, %d train / %d held-out chunks", partner, len(docs), len(train), len(held))
    return PartnerText(partner, PARTNER_MANUALS[partner], tuple(sorted(docs)), tuple(train), tuple(held))


#: documents read from a partner's own text directory (``sealfl partner start KIT --data DIR``)
OWN_TEXT_SUFFIXES = (".txt", ".md", ".rst")


def load_own_text(partner: str, directory: str | os.PathLike, seed: int = 0) -> PartnerText:
    """Read and split a partner's own directory of text files (``*.txt``, ``*.md``,
    ``*.rst``, recursively; the same checks and caps as a manual: regular files only, no
    symbolic links, UTF-8, at most :data:`MAX_FILES` files and :data:`MAX_MANUAL_BYTES`).

    Raises:
        CorpusError: not a directory, no text file, or a bad file (named).
    """
    d = Path(directory).absolute()
    if not d.is_dir() or d.is_symlink():
        raise CorpusError(f"--data {d} is not a directory; the causal-LM task reads a directory of text files "
                          f"({', '.join('*' + x for x in OWN_TEXT_SUFFIXES)})")
    docs = read_manual(d.parent, d.name, OWN_TEXT_SUFFIXES, own=True)
    train, held = split_text(docs, seed=seed)
    log.info("partner %s: %d own documents, %d train / %d held-out chunks", partner, len(docs), len(train), len(held))
    return PartnerText(partner, str(d), tuple(sorted(docs)), tuple(train), tuple(held))
