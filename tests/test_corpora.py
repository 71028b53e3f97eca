"""The named corpora's rules (demo_lightning.data.corpora), on a fake installation built here, and on this one.

Oracle: the files each rule must keep and drop are written by hand into temporary ``stdlib`` /
``site-packages`` / ``include`` folders that ``sysconfig`` is pointed at; the expected bytes of each
split are spelled out from the rule in the module docstring.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import pytest

from demo_lightning.data import TextDataModule
from demo_lightning.data import corpora
from demo_lightning.data.corpora import corpus_digest, corpus_documents, load_corpus

PROSE = b"The quick brown fox jumps over the lazy dog and keeps running through the field. " * 20  # 1,620 bytes


@pytest.fixture
def installation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    stdlib, site, include = tmp_path / "lib", tmp_path / "lib" / "site-packages", tmp_path / "include"
    files = {
        stdlib / "a.py": b"print('a')\n" * 50,
        stdlib / "test" / "t.py": b"assert True\n" * 50,  # stdlib keeps its test folders (the default corpus always did)
        stdlib / "README.txt": PROSE.replace(b"fox", b"cat"),
        site / "pkg" / "README.md": PROSE,
        site / "pkg" / "copy" / "LICENSE.txt": PROSE,  # a copy of README.md: dropped
        site / "pkg" / "numbers.txt": b"1.5 2.25 3.125 4\n" * 100,  # not prose
        site / "pkg" / "short.rst": b"Too short.",  # under 1,000 bytes
        site / "pkg" / "tests" / "guide.md": PROSE.replace(b"dog", b"cow"),  # below a test folder
        site / "pkg" / "latin1.txt": PROSE.replace(b"fox", b"f\xf6x"),  # not UTF-8
        site / "pkg" / "big.md": (b"Long prose about many things, word after word. " * 7000),  # over 256 KiB: capped
        site / "pkg" / "mod.py": b"x = 1\n" * 100,  # site-packages' .py files are not the stdlib corpus
        site / "pkg" / "k.h": b"int f(void);\n" * 30,
        site / "pkg" / "dup" / "k.h": b"int f(void);\n" * 30,  # the same bytes: dropped
        site / "pkg" / "k.cu": b"__global__ void g();\n",  # not a listed suffix
        include / "Python.h": b"#define PY 1\n" * 40,
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    paths = {"stdlib": str(stdlib), "purelib": str(site), "platlib": str(site), "include": str(include)}
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: dict(paths))
    corpora._listing.cache_clear()
    monkeypatch.setattr(corpora, "_pydoc_topics", lambda: b"The reference manual explains the language in plain words. " * 30)
    return tmp_path


def test_prose_keeps_utf8_prose_once_and_caps_each_document(installation: Path) -> None:
    docs = corpus_documents("prose")
    assert [d.name for d in docs] == ["stdlib/README.txt", "stdlib/pydoc_data/topics", "site/pkg/README.md", "site/pkg/big.md"]
    assert len(docs[-1].data) == 256 * 1024  # the cap
    train, val = load_corpus("prose", max_bytes=10_000_000, val_fraction=0.1)
    # by position: the last tenth of every document is validation, in reading order
    want_train = b"".join(d.data[: len(d.data) - int(len(d.data) * 0.1)] for d in docs)
    want_val = b"".join(d.data[len(d.data) - int(len(d.data) * 0.1) :] for d in docs)
    assert (train, val) == (want_train, want_val)


def test_stdlib_is_every_py_file_of_the_stdlib_split_by_file(installation: Path) -> None:
    docs = corpus_documents("stdlib")
    assert [d.name for d in docs] == ["a.py", "test/t.py"]
    val_fraction = 0.3  # crc32 % 10000: a.py 1502 (validation), test/t.py 4995 (training)
    train, val = load_corpus("stdlib", max_bytes=10_000, val_fraction=val_fraction)
    to_val = {n: zlib.crc32(n.encode()) % 10_000 < val_fraction * 10_000 for n in ("a.py", "test/t.py")}
    assert val == b"".join(d.data for d in docs if to_val[d.name])[:3000]
    assert train == b"".join(d.data for d in docs if not to_val[d.name])[:7000]


def test_cpp_is_every_header_and_source_once(installation: Path) -> None:
    # the first of two identical files in sorted order is kept
    assert [d.name for d in corpus_documents("cpp")] == ["include/Python.h", "site/pkg/dup/k.h"]


def test_unknown_corpus_names_the_argument_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"corpus.*one of \('stdlib', 'prose', 'cpp'\).*your own text"):
        TextDataModule(corpus="english")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="corpus"):
        corpus_documents("wiki")  # type: ignore[arg-type]


def test_this_installation_has_all_three_corpora() -> None:
    """Each named corpus yields real, distinct text here (the benchmarks' three kinds)."""
    corpora._listing.cache_clear()  # the fake installations of the other tests were listed
    seen = set()
    for name in ("stdlib", "prose", "cpp"):
        train, val = load_corpus(name, max_bytes=400_000)  # type: ignore[arg-type]
        assert len(train) > 100_000 and len(val) > 5_000, name
        seen.add(corpus_digest(train, val))
    assert len(seen) == 3
    module = TextDataModule(corpus="prose", block_size=32, max_bytes=100_000)
    module.setup("fit")
    assert module.train_set is not None and len(module.train_set) > 1000


def test_path_and_a_named_corpus_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"either path=.*or corpus=.*not both"):
        TextDataModule(path=str(tmp_path), corpus="prose")
    with pytest.raises(ValueError, match="max_bytes must be an integer >= 2"):
        load_corpus("stdlib", max_bytes=1)


def test_the_caps_stop_both_splits_at_their_share(installation: Path) -> None:
    train, val = load_corpus("prose", max_bytes=2_000, val_fraction=0.1)  # caps 1,800 and 200
    assert (len(train), len(val)) == (1_800, 200)
    train, val = load_corpus("stdlib", max_bytes=1_000, val_fraction=0.3)  # caps 700 and 300
    assert (len(train), len(val)) == (600, 300)  # the training file (test/t.py) holds only 600 bytes


def _rglob_files(root: Path, suffixes: set[str], skip_site: bool, skip_tests: bool) -> list[tuple[str, Path]]:
    """The listing as pathlib spells it (the implementation before the scandir walk): the oracle."""
    found = sorted((f.relative_to(root).as_posix(), f) for f in root.rglob("*") if f.is_file())
    return [
        (rel, f) for rel, f in found
        if f.suffix.lower() in suffixes and not (skip_site and "site-packages" in f.parts)
        and not (skip_tests and {"test", "tests", "testing"} & set(rel.split("/")[:-1]))
    ]


def test_the_file_walk_lists_what_rglob_lists(tmp_path: Path) -> None:
    root = tmp_path / "lib"
    for rel in ("a.py", "B.PY", "pkg/z.py", "pkg/.hidden.py", "pkg/tests/t.py", "site-packages/x/y.py", "deep/er/still/m.py",
                "notes.txt", "pkg/readme.md", "folder.py/inside.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "o.py").write_text("o = 1\n")
    (root / "linked_dir").symlink_to(tmp_path / "outside", target_is_directory=True)  # not descended, as rglob
    (root / "linked_file.py").symlink_to(root / "a.py")  # a file: listed
    (root / "broken.py").symlink_to(root / "gone.py")  # no file behind it: not listed
    corpora._listing.cache_clear()
    for suffixes in ({".py"}, {".md", ".txt"}):
        for skip_site in (True, False):
            for skip_tests in (True, False):
                got = list(corpora._files(root, suffixes, skip_site=skip_site, skip_tests=skip_tests))
                assert got == _rglob_files(root, suffixes, skip_site, skip_tests), (suffixes, skip_site, skip_tests)
    names = [rel for rel, _ in corpora._files(root, {".py"}, skip_site=True, skip_tests=True)]
    assert "linked_file.py" in names and "B.PY" in names and "folder.py/inside.py" in names
    assert not any(n.startswith(("linked_dir", "site-packages", "broken")) or "/tests/" in n for n in names)
    assert list(corpora._files(root / "site-packages", {".py"}, skip_site=True)) == []  # every file below names the folder
