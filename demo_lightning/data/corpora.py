"""Named text corpora assembled from what this Python installation ships: no download, rebuilt by rule.

Three kinds of text, so a default chosen on one can be checked on the others:

``"stdlib"``: Python source code
    Every ``.py`` file of the running Python's standard library (``sysconfig``'s ``stdlib`` folder,
    ``site-packages`` left out), in sorted relative-path order. Split by file: a file goes to
    validation when ``crc32(relative path) % 10000 < val_fraction * 10000``.

``"prose"``: English prose (documentation, change logs, licences, the Python reference)
    * every ``.md``, ``.rst`` and ``.txt`` file (any case) under the standard library folder
      (``site-packages`` left out) and under the environment's ``purelib`` / ``platlib``
      (``site-packages``), except files below a folder named ``test``, ``tests`` or ``testing``;
    * kept when it decodes as UTF-8, holds at least 1,000 bytes and at least 70 % of its characters
      are ASCII letters or spaces (numeric tables and data files fall out);
    * plus one document ``pydoc_data/topics``: the Python language reference that ships inside the
      standard library (``pydoc_data.topics.topics``), its texts joined in sorted key order;
    * de-duplicated in sorted order (standard library first, then site-packages, each by relative
      path): a document whose first 2,000 letters (lower-cased, letters only) equal an earlier
      one's is dropped (licence copies, the same change log under two package names);
    * each document contributes at most its first 256 KiB, so no single file dominates.

    Split by position: the last ``val_fraction`` of every document's bytes is validation, the rest
    training, so both splits hold every kind of document (a file split would put a handful of large
    documents on one side).

``"cpp"``: C, C++ and CUDA source
    Every ``.h``, ``.hpp``, ``.cuh``, ``.c``, ``.cc`` and ``.cpp`` file under Python's ``include``
    folder and under ``purelib`` / ``platlib`` (the headers torch, numpy and others ship), except
    below ``test`` / ``tests`` / ``testing``, that decodes as UTF-8; exact duplicates (same bytes)
    dropped after the first in sorted order. Split by file, as ``"stdlib"``.

Each corpus reads documents in that order until both splits hold their share of ``max_bytes``
(``val_fraction`` of it for validation). What is installed decides the bytes: :func:`corpus_digest`
names the result, and the benchmarks record it beside their figures. ``python benchmarks/parity.py
corpora`` prints every corpus's documents, bytes and digest on this machine.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sysconfig
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from demo_lightning.validation import check_choice

__all__ = [
    "CORPORA", "CorpusName", "Document", "corpus_digest", "corpus_documents", "is_validation_file", "load_corpus",
    "split_by_file", "split_by_position", "stdlib_source_root",
]

CorpusName = Literal["stdlib", "prose", "cpp"]
CORPORA: tuple[str, ...] = get_args(CorpusName)

_PROSE_SUFFIXES = {".md", ".rst", ".txt"}
_CPP_SUFFIXES = {".h", ".hpp", ".cuh", ".c", ".cc", ".cpp"}
_TEST_FOLDERS = {"test", "tests", "testing"}
_PROSE_MIN_BYTES = 1000
_PROSE_MIN_LETTERS = 0.7
_PROSE_KEY_LETTERS = 2000
_PROSE_MAX_BYTES = 256 * 1024


@dataclass(frozen=True)
class Document:
    """One file's text: ``name`` is its path relative to the standard library for ``"stdlib"``, else
    ``<root>/<relative path>`` with the roots ``stdlib``, ``include`` and ``site``."""

    name: str
    data: bytes


def stdlib_source_root() -> Path:
    """Folder of the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _site_roots() -> list[Path]:
    return [Path(p) for p in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})]


@functools.lru_cache(maxsize=8)
def _listing(root: str, prune_site: bool) -> tuple[str, ...]:
    """Every file under ``root`` as its relative posix path, sorted (one walk per root and process).

    Walked with :func:`os.scandir` (no :class:`~pathlib.Path` per entry: the standard library folder
    holds tens of thousands of files, most of them under ``site-packages``). Like ``Path.rglob("*")``
    it does not descend into symbolic links to folders and lists what ``is_file()`` accepts (links to
    files included); with ``prune_site`` it does not descend into folders named ``site-packages``.
    """
    found: list[str] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            with os.scandir(os.path.join(root, rel_dir) if rel_dir else root) as entries:
                for entry in entries:
                    rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            if not (prune_site and entry.name == "site-packages"):
                                pending.append(rel)
                        elif entry.is_file():
                            found.append(rel)
                    except OSError:
                        continue
        except (PermissionError, FileNotFoundError, NotADirectoryError):
            continue
    return tuple(sorted(found))


def _files(root: Path, suffixes: set[str], skip_site: bool = True, skip_tests: bool = True) -> Iterator[tuple[str, Path]]:
    """``(relative path, file)`` under ``root`` with one of ``suffixes`` (any case), in sorted
    relative-path order; without ``site-packages`` (``skip_site``) and test folders (``skip_tests``)."""
    if not root.is_dir():
        return
    if skip_site and "site-packages" in root.parts:  # every file below names the folder
        return
    for rel in _listing(str(root), skip_site):
        if os.path.splitext(rel)[1].lower() not in suffixes:
            continue
        if skip_tests and _TEST_FOLDERS & set(rel.split("/")[:-1]):
            continue
        yield rel, root / rel


def _stdlib_documents() -> Iterator[Document]:
    # the library's default corpus since its first release: every .py file, test folders included
    root = stdlib_source_root()
    return (Document(rel, f.read_bytes()) for rel, f in _files(root, {".py"}, skip_tests=False) if f.suffix == ".py")


def _is_prose(data: bytes) -> bool:
    if len(data) < _PROSE_MIN_BYTES:
        return False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    letters = sum(1 for c in text if c == " " or ("a" <= c <= "z") or ("A" <= c <= "Z"))
    return letters >= _PROSE_MIN_LETTERS * len(text)


def _pydoc_topics() -> bytes:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python built without its documentation
        return b""
    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def _prose_documents() -> list[Document]:
    candidates: list[Document] = []
    for rel, f in _files(stdlib_source_root(), _PROSE_SUFFIXES):
        candidates.append(Document(f"stdlib/{rel}", f.read_bytes()))
    topics = _pydoc_topics()
    if topics:
        candidates.append(Document("stdlib/pydoc_data/topics", topics))
    for root in _site_roots():
        for rel, f in _files(root, _PROSE_SUFFIXES, skip_site=False):
            candidates.append(Document(f"site/{rel}", f.read_bytes()))
    seen: set[str] = set()
    out = []
    for doc in candidates:
        if not _is_prose(doc.data):
            continue
        key = re.sub(r"[^a-z]", "", doc.data.decode("utf-8").lower())[:_PROSE_KEY_LETTERS]
        if key in seen:
            continue
        seen.add(key)
        out.append(Document(doc.name, doc.data[:_PROSE_MAX_BYTES]))
    return out


def _cpp_documents() -> Iterator[Document]:
    roots = [("include", Path(sysconfig.get_paths()["include"]))] + [("site", r) for r in _site_roots()]
    seen: set[bytes] = set()
    for label, root in roots:
        for rel, f in _files(root, _CPP_SUFFIXES, skip_site=False):
            data = f.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            digest = hashlib.sha256(data).digest()
            if not data or digest in seen:
                continue
            seen.add(digest)
            yield Document(f"{label}/{rel}", data)


def corpus_documents(name: CorpusName) -> list[Document]:
    """The documents of corpus ``name`` in reading order (see the module docstring for the rules).

    Raises:
        ValueError: an unknown ``name``.
    """
    return list(_documents(name))


def _documents(name: str) -> Iterable[Document]:
    """The documents of ``name`` as they are read (``"stdlib"`` and ``"cpp"`` lazily: a split that
    fills its caps early reads no further; ``"prose"`` must see them all to drop the duplicates)."""
    check_choice("corpus", name, CORPORA, "or give a path to your own text (a file or a folder)")
    return {"stdlib": _stdlib_documents, "prose": _prose_documents, "cpp": _cpp_documents}[name]()


def _caps(max_bytes: int, val_fraction: float) -> tuple[int, int]:
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 2:
        raise ValueError(f"max_bytes must be an integer >= 2 (bytes of both splits together), got {max_bytes!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    return max_bytes - int(max_bytes * val_fraction), max(1, int(max_bytes * val_fraction))


def is_validation_file(relative: str, val_fraction: float) -> bool:
    """The by-file split: ``crc32(relative path) % 10000 < val_fraction * 10000``."""
    return (zlib.crc32(relative.encode()) % 10_000) < val_fraction * 10_000


def split_by_file(documents: Iterable[Document], max_bytes: int, val_fraction: float) -> tuple[bytes, bytes]:
    """Whole documents to one split or the other by :func:`is_validation_file` of their name, read
    in order (lazily: an iterator is consumed only as far as needed) until both splits hold their
    share of ``max_bytes``."""
    train_cap, val_cap = _caps(max_bytes, val_fraction)
    train, val = bytearray(), bytearray()
    for doc in documents:
        if len(train) >= train_cap and len(val) >= val_cap:
            break
        target, cap = (val, val_cap) if is_validation_file(doc.name, val_fraction) else (train, train_cap)
        if len(target) < cap:
            target.extend(doc.data[: cap - len(target)])
    return bytes(train), bytes(val)


def split_by_position(documents: Sequence[Document], max_bytes: int, val_fraction: float) -> tuple[bytes, bytes]:
    """The last ``val_fraction`` of every document's bytes to validation, the rest to training, read
    in order until both splits hold their share of ``max_bytes``."""
    train_cap, val_cap = _caps(max_bytes, val_fraction)
    train, val = bytearray(), bytearray()
    for doc in documents:
        if len(train) >= train_cap and len(val) >= val_cap:
            break
        cut = len(doc.data) - max(1, int(len(doc.data) * val_fraction))
        train.extend(doc.data[:cut][: max(0, train_cap - len(train))])
        val.extend(doc.data[cut:][: max(0, val_cap - len(val))])
    return bytes(train), bytes(val)


def load_corpus(name: CorpusName, max_bytes: int = 8_000_000, val_fraction: float = 0.05) -> tuple[bytes, bytes]:
    """``(train_bytes, val_bytes)`` of corpus ``name`` under its split rule.

    Raises:
        ValueError: an unknown ``name``, or ``max_bytes`` / ``val_fraction`` out of range.
        FileNotFoundError: this installation holds no document of the corpus.
    """
    _caps(max_bytes, val_fraction)
    documents = _documents(name)
    if name == "prose":
        train, val = split_by_position(documents, max_bytes, val_fraction)
    else:
        train, val = split_by_file(documents, max_bytes, val_fraction)
    if not train or not val:
        raise FileNotFoundError(f"corpus {name!r} found no documents in this installation; give a path to your own text instead")
    return train, val


def corpus_digest(train: bytes, val: bytes) -> str:
    """A short name for a corpus's bytes (16 hex digits of SHA-256 over both splits), to tell
    whether two machines trained on the same text."""
    h = hashlib.sha256()
    h.update(len(train).to_bytes(8, "little"))
    h.update(train)
    h.update(val)
    return h.hexdigest()[:16]
