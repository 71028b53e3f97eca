"""Models used by the main job and the examples."""

from demo_lightning.models.gpt import GPT, GPTLightningModule

__all__ = ["GPT", "GPTLightningModule"]
