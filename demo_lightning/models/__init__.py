"""Models used by the main job, the configs and the examples."""

from demo_lightning.models.gpt import GPT, GPTLightningModule
from demo_lightning.models.vision import ImageClassifier

__all__ = ["GPT", "GPTLightningModule", "ImageClassifier"]
