"""The loaders every data module here shares: a shuffled training split and a fixed validation split.

Subclasses set ``train_set`` and ``val_set`` in ``setup`` and ``batch_size`` / ``num_workers`` in
``__init__``. Training batches are shuffled and the last partial batch is dropped (every rank runs
the same number of optimizer steps); validation keeps its order and every sample. ``test`` and
``predict`` use the validation split (these corpora have no separate test split).
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

__all__ = ["TrainValDataModule"]


class TrainValDataModule(pl.LightningDataModule):
    """Loaders over ``train_set`` / ``val_set`` (see the module docstring)."""

    batch_size: int
    num_workers: int
    train_set: Optional[Dataset]
    val_set: Optional[Dataset]

    def _loader(self, dataset: Optional[Dataset], split: str, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"the {split} split is not loaded yet: call setup() first (the Trainer does)")
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, drop_last=shuffle, num_workers=self.num_workers)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, "training", shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, "validation", shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        """The validation split."""
        return self.val_dataloader()

    @override
    def predict_dataloader(self) -> DataLoader:
        """The validation split."""
        return self.val_dataloader()
