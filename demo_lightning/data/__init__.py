"""Offline data modules."""

from demo_lightning.data.text import ByteWindows, TextDataModule, load_text_corpus, stdlib_source_root

__all__ = ["ByteWindows", "TextDataModule", "load_text_corpus", "stdlib_source_root"]
