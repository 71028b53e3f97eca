"""Offline data modules: bytes of text (named corpora that ship with Python and its packages, the
standard library's sources by default) and images (scikit-learn's digits by default); both take a
path to the user's own data."""

from demo_lightning.data.corpora import CORPORA, CorpusName, corpus_digest, corpus_documents, load_corpus
from demo_lightning.data.images import ImageDataModule, load_digits_tensors
from demo_lightning.data.splits import TrainValDataModule
from demo_lightning.data.text import ByteWindows, TextDataModule, load_text_corpus, stdlib_source_root

__all__ = [
    "CORPORA", "ByteWindows", "CorpusName", "ImageDataModule", "TextDataModule", "TrainValDataModule", "corpus_digest",
    "corpus_documents", "load_corpus", "load_digits_tensors", "load_text_corpus", "stdlib_source_root",
]
