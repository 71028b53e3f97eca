"""Byte-level text corpora that need no download.

By default the corpus is the Python standard library's own ``.py`` source files (real text that
ships with every Python), read as bytes. A user's own text file, or a folder of text files, can
be given instead with ``path``.

Split: deterministic by file. Files are sorted by their path relative to the corpus root; a file
goes to validation when a CRC32 of that relative path falls in the validation fraction, so the
split does not depend on the machine's file order. A single file is split by position instead
(the last ``val_fraction`` of its bytes). At most ``max_bytes`` are read, ``val_fraction`` of them
for validation; files are taken in sorted order until both splits are full. Each split is cut into non-overlapping windows of
``block_size + 1`` bytes.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset
from typing_extensions import override

from demo_lightning.data.splits import TrainValDataModule

__all__ = ["ByteWindows", "TextDataModule", "load_text_corpus", "stdlib_source_root"]

_TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".csv", ".c", ".h", ".html", ".xml", ".yaml", ".yml"}


def stdlib_source_root() -> Path:
    """Folder of the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_val(relative: str, val_fraction: float) -> bool:
    return (zlib.crc32(relative.encode()) % 10_000) < val_fraction * 10_000


def load_text_corpus(path: Optional[str] = None, max_bytes: int = 8_000_000, val_fraction: float = 0.05) -> tuple[bytes, bytes]:
    """Return ``(train_bytes, val_bytes)`` from ``path`` (a file or folder) or the stdlib sources.

    Raises:
        FileNotFoundError: if ``path`` does not exist or holds no text.
        ValueError: if ``max_bytes`` or ``val_fraction`` is out of range.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    root = Path(path).expanduser() if path is not None else stdlib_source_root()
    if not root.exists():
        raise FileNotFoundError(f"text corpus path {str(root)!r} does not exist; give a text file or a folder of text files")
    if root.is_file():
        data = root.read_bytes()[:max_bytes]
        cut = int(len(data) * (1.0 - val_fraction))
        return data[:cut], data[cut:]
    suffixes = {".py"} if path is None else _TEXT_SUFFIXES
    files = sorted(
        (f for f in root.rglob("*") if f.is_file() and f.suffix in suffixes and "site-packages" not in f.parts),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    train, val = bytearray(), bytearray()
    train_cap, val_cap = max_bytes - int(max_bytes * val_fraction), max(1, int(max_bytes * val_fraction))
    for f in files:
        if len(train) >= train_cap and len(val) >= val_cap:
            break
        is_val = _is_val(f.relative_to(root).as_posix(), val_fraction)
        target, cap = (val, val_cap) if is_val else (train, train_cap)
        if len(target) < cap:
            target.extend(f.read_bytes()[: cap - len(target)])
    if not train or not val:
        raise FileNotFoundError(f"found no text files (suffixes {sorted(suffixes)}) under {str(root)!r}")
    return bytes(train), bytes(val)


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
    """Byte windows from the stdlib sources (default) or a user's text.

    Args:
        path: a text file or folder of text files; ``None`` uses the Python standard library sources.
        block_size: context length (windows are one byte longer).
        batch_size: windows per batch per worker.
        max_bytes: read at most this many bytes.
        val_fraction: share of files (or of a single file's bytes) held out for validation.
        max_val_batches_bytes: cap the validation split to this many bytes (keeps validation quick).
        num_workers: DataLoader worker processes.
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
    ) -> None:
        super().__init__()
        self.path, self.block_size, self.batch_size = path, block_size, batch_size
        self.max_bytes, self.val_fraction, self.max_val_bytes = max_bytes, val_fraction, max_val_bytes
        self.num_workers = num_workers
        self.train_set: Optional[ByteWindows] = None
        self.val_set: Optional[ByteWindows] = None

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is None:
            train, val = load_text_corpus(self.path, self.max_bytes, self.val_fraction)
            self.train_set = ByteWindows(train, self.block_size)
            self.val_set = ByteWindows(val[: self.max_val_bytes], self.block_size)
