"""Image classification with any timm model, built offline (``pretrained=False``)."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from demo_lightning.models.training import OPTIMIZERS, OptimizerName, optimizer_with_schedule

__all__ = ["ImageClassifier"]


class ImageClassifier(pl.LightningModule):
    """A timm model (ResNet, ViT, ConvNeXt, ...) trained with cross-entropy; no weights are downloaded.

    Args:
        model_name: any name ``timm.list_models()`` gives, e.g. ``"resnet18"``, ``"vit_tiny_patch16_224"``.
        num_classes: classes of the data (10 for the bundled digits).
        in_chans: image channels (3 for the bundled digits).
        model_kwargs: passed to ``timm.create_model``, e.g. ``{img_size: 32, patch_size: 4}`` for a ViT
            on 32x32 images.
        optimizer: ``"sgd"`` (pair with DeMo's sign update), ``"adamw"``, ``"decoupled"`` or ``"signum"``.
        lr: peak learning rate.
        weight_decay: decoupled weight decay.
        momentum: SGD's momentum (``None``: 0), Signum's beta (``None``: 0.9) or AdamW's first beta
            (``None``: 0.9); ignored by ``"decoupled"``.
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio`` of ``lr`` at ``max_steps``.
        max_steps: length of the schedule (the Trainer's ``max_steps``).
        min_lr_ratio: the rate at ``max_steps`` over ``lr``, in [0, 1].

    Raises:
        ValueError: an unknown ``model_name`` (with close matches) or ``optimizer``.
    """

    def __init__(
        self,
        model_name: str = "resnet18",
        num_classes: int = 10,
        in_chans: int = 3,
        model_kwargs: Optional[dict[str, Any]] = None,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.01,
        weight_decay: float = 0.0,
        momentum: Optional[float] = None,
        warmup_steps: int = 10,
        max_steps: int = 300,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        import timm

        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if not timm.is_model(model_name):
            close = timm.list_models(f"*{model_name.split('_')[0]}*")[:8]
            raise ValueError(f"model_name {model_name!r} is not a timm model; similar names: {close}")
        self.save_hyperparameters()
        self.model = timm.create_model(model_name, pretrained=False, num_classes=num_classes, in_chans=in_chans, **(model_kwargs or {}))
        self.train_accuracy = MulticlassAccuracy(num_classes=num_classes)
        self.val_accuracy = MulticlassAccuracy(num_classes=num_classes)

    @override
    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self.model(images)
        loss = F.cross_entropy(logits, labels)
        self.train_accuracy(logits, labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=labels.shape[0])
        self.log("train/acc", self.train_accuracy, batch_size=labels.shape[0])
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        images, labels = batch
        logits = self.model(images)
        loss = F.cross_entropy(logits, labels)
        self.val_accuracy(logits, labels)
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=True, batch_size=labels.shape[0])
        self.log(f"{stage}/acc", self.val_accuracy, prog_bar=True, batch_size=labels.shape[0])
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._evaluate(batch, "val")

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._evaluate(batch, "test")

    @override
    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model(batch[0]).argmax(-1)

    @override
    def configure_optimizers(self) -> dict:
        hp = self.hparams
        return optimizer_with_schedule(
            self.parameters(), hp.optimizer, hp.lr, hp.weight_decay, hp.momentum, hp.warmup_steps, hp.max_steps,
            hp.get("min_lr_ratio", 0.1),  # checkpoints saved before it existed
        )
