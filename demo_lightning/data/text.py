"""Byte-level text: a named corpus that needs no download, or a user's own text.

By default the corpus is the Python standard library's own ``.py`` source files (real text that
ships with every Python), read as bytes; ``corpus="prose"`` (English documentation and reference
text) and ``corpus="cpp"`` (C/C++/CUDA headers) are the other named corpora, assembled by the rules
in :mod:`demo_lightning.data.corpora`. A user's own text file, or a folder of text files, can be
given instead with ``path``.

Split of a user's folder: deterministic by file. Files are sorted by their path relative to the
folder; a file goes to validation when a CRC32 of that relative path falls in the validation
fraction, so the split does not depend on the machine's file order. A single file is split by
position instead (the last ``val_fraction`` of its bytes). At most ``max_bytes`` are read,
``val_fraction`` of them for validation; files are taken in sorted order until both splits are
full. Each split is cut into non-overlapping windows of ``block_size + 1`` bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset
from typing_extensions import override

from demo_lightning.data.corpora import CORPORA, CorpusName, Document, load_corpus, split_by_file, stdlib_source_root
from demo_lightning.validation import check_choice
from demo_lightning.data.splits import TrainValDataModule

__all__ = ["ByteWindows", "TextDataModule", "load_text_corpus", "stdlib_source_root"]

_TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".csv", ".c", ".h", ".html", ".xml", ".yaml", ".yml"}


def load_text_corpus(
    path: Optional[str] = None, max_bytes: int = 8_000_000, val_fraction: float = 0.05, corpus: CorpusName = "stdlib",
) -> tuple[bytes, bytes]:
    """Return ``(train_bytes, val_bytes)`` from ``path`` (a file or folder) or the named ``corpus``.

    Raises:
        FileNotFoundError: if ``path`` does not exist or holds no text.
        ValueError: if ``max_bytes`` or ``val_fraction`` is out of range, or ``corpus`` is unknown.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    if path is None:
        return load_corpus(corpus, max_bytes, val_fraction)
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"text corpus path {str(root)!r} does not exist; give a text file or a folder of text files")
    if root.is_file():
        data = root.read_bytes()[:max_bytes]
        cut = int(len(data) * (1.0 - val_fraction))
        return data[:cut], data[cut:]
    files = sorted(
        (f for f in root.rglob("*") if f.is_file() and f.suffix in _TEXT_SUFFIXES and "site-packages" not in f.parts),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    documents = (Document(f.relative_to(root).as_posix(), f.read_bytes()) for f in files)  # read as the split reaches them
    train, val = split_by_file(documents, max_bytes, val_fraction)
    if not train or not val:
        raise FileNotFoundError(f"found no text files (suffixes {sorted(_TEXT_SUFFIXES)}) under {str(root)!r}")
    return train, val


class ByteWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes (inputs and shifted targets)."""

    def __init__(self, data: bytes, block_size: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.window = block_size + 1
        if len(self.data) < self.window:
            raise ValueError(f"corpus of {len(self.data)} bytes is shorter than one window of {self.window}")

    def __len__(self) -> int:
        return len(self.data) // self.window

    def __getitem__(self, index: int) -> Tensor:
        start = index * self.window
        return self.data[start : start + self.window].to(torch.long)


class TextDataModule(TrainValDataModule):
    """Byte windows from a named corpus (the stdlib sources by default) or a user's text.

    Args:
        path: a text file or folder of text files; ``None`` uses the named ``corpus``.
        block_size: context length (windows are one byte longer).
        batch_size: windows per batch per worker.
        max_bytes: read at most this many bytes.
        val_fraction: share of files (or of a single file's bytes) held out for validation.
        max_val_batches_bytes: cap the validation split to this many bytes (keeps validation quick).
        num_workers: DataLoader worker processes.
        corpus: the named corpus read when ``path`` is ``None``: ``"stdlib"`` (the standard library's
            ``.py`` sources), ``"prose"`` (English documentation and the Python reference) or ``"cpp"``
            (C/C++/CUDA headers); see :mod:`demo_lightning.data.corpora` for the rules.
    """

    def __init__(
        self,
        path: Optional[str] = None,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.05,
        max_val_bytes: int = 200_000,
        num_workers: int = 0,
        corpus: CorpusName = "stdlib",
    ) -> None:
        super().__init__()
        check_choice("corpus", corpus, CORPORA, "or give path= your own text (a file or a folder)")
        if path is not None and corpus != "stdlib":
            raise ValueError(f"give either path= (your own text) or corpus= (a named corpus), not both: got path={path!r}, corpus={corpus!r}")
        self.path, self.corpus, self.block_size, self.batch_size = path, corpus, block_size, batch_size
        self.max_bytes, self.val_fraction, self.max_val_bytes = max_bytes, val_fraction, max_val_bytes
        self.num_workers = num_workers
        self.train_set: Optional[ByteWindows] = None
        self.val_set: Optional[ByteWindows] = None

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is None:
            train, val = load_text_corpus(self.path, self.max_bytes, self.val_fraction, self.corpus)
            self.train_set = ByteWindows(train, self.block_size)
            self.val_set = ByteWindows(val[: self.max_val_bytes], self.block_size)
