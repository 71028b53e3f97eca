"""Images, offline: scikit-learn's bundled handwritten digits, or a folder of the user's own.

Default: the 1,797 8x8 grey digits that ship inside scikit-learn (``sklearn.datasets.load_digits``,
no download), scaled to [0, 1], resized to ``image_size`` (bilinear) and repeated to ``channels``.
With ``path``: a folder with one sub-folder per class (``torchvision.datasets.ImageFolder``),
resized to ``image_size``. Either way images are normalised to mean 0.5, std 0.5 per channel.

Split: a fixed permutation from ``seed`` puts ``val_fraction`` of the images in validation (the
same on every rank); ``test`` and ``predict`` use the validation split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset
from typing_extensions import override

from demo_lightning.data.splits import TrainValDataModule

__all__ = ["ImageDataModule", "load_digits_tensors"]


def load_digits_tensors(image_size: int = 32, channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as ``(images (N, channels, size, size) in [0, 1], labels (N,))``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if image_size != 8:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return images.repeat(1, channels, 1, 1), torch.tensor(digits.target, dtype=torch.int64)


class ImageDataModule(TrainValDataModule):
    """Digits by default, or an image folder (see the module docstring).

    Args:
        path: a folder with one sub-folder of images per class; ``None`` uses scikit-learn's digits.
        image_size: side the images are resized to.
        channels: 1 (grey) or 3.
        batch_size: images per batch per worker.
        val_fraction: share held out for validation, in (0, 1).
        seed: seed of the split's permutation.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        path: Optional[str] = None,
        image_size: int = 32,
        channels: int = 3,
        batch_size: int = 32,
        val_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels!r}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction!r}")
        if path is not None and not Path(path).expanduser().is_dir():
            raise FileNotFoundError(f"image folder path {path!r} does not exist; give a folder with one sub-folder per class")
        self.path, self.image_size, self.channels = path, image_size, channels
        self.batch_size, self.val_fraction, self.seed, self.num_workers = batch_size, val_fraction, seed, num_workers
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None
        self.num_classes = 10 if path is None else len([p for p in Path(path).expanduser().iterdir() if p.is_dir()])

    def _dataset(self) -> Dataset:
        if self.path is None:
            images, labels = load_digits_tensors(self.image_size, self.channels)
            return TensorDataset((images - 0.5) / 0.5, labels)
        from torchvision import datasets, transforms

        steps = [transforms.Resize((self.image_size, self.image_size))]
        if self.channels == 1:
            steps.append(transforms.Grayscale(1))
        else:
            steps.append(transforms.Lambda(lambda im: im.convert("RGB")))
        steps += [transforms.ToTensor(), transforms.Normalize([0.5] * self.channels, [0.5] * self.channels)]
        return datasets.ImageFolder(str(Path(self.path).expanduser()), transform=transforms.Compose(steps))

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is None:
            data = self._dataset()
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(self.seed)).tolist()
            n_val = max(1, round(self.val_fraction * len(data)))
            self.val_set, self.train_set = Subset(data, order[:n_val]), Subset(data, order[n_val:])
