"""``demo-lightning``: LightningCLI with our strategies, callbacks, models and data modules.

    demo-lightning fit --config configs/gpt_demo.yaml
    demo-lightning fit --config configs/gpt_demo.yaml --trainer.max_steps 50 --trainer.strategy.init_args.topk 32
    demo-lightning fit --config configs/gpt_demo.yaml --print_config      # the full resolved config
    demo-lightning validate --config configs/gpt_demo.yaml --ckpt_path runs/.../last.ckpt

Subcommands ``fit``, ``validate``, ``test``, ``predict`` (LightningCLI's). Any LightningModule and
LightningDataModule can be chosen by ``class_path`` (ours by short name: ``GPTLightningModule``,
``ImageClassifier``, ``TextDataModule``, ``ImageDataModule``); strategies by registered name
(``strategy: demo``) or by ``class_path`` (``demo_lightning.DeMoStrategy`` with ``init_args``);
callbacks by ``class_path`` (``demo_lightning.callbacks.CommunicationMonitor`` or the short name).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import ArgsType, LightningCLI

import demo_lightning  # noqa: F401  registers strategy="demo" and "desloc"
import demo_lightning.callbacks  # noqa: F401  short class names resolve once imported
import demo_lightning.data  # noqa: F401
import demo_lightning.models  # noqa: F401

__all__ = ["DemoLightningCLI", "build_cli", "main"]


class DemoLightningCLI(LightningCLI):
    """LightningCLI whose model and data are any LightningModule / LightningDataModule subclass."""


def build_cli(args: ArgsType = None, run: bool = True) -> DemoLightningCLI:
    """The CLI over ``args`` (``None``: ``sys.argv``); ``run=False`` only builds the Trainer, model and data."""
    return DemoLightningCLI(
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of the ``demo-lightning`` console script (returns nothing: its exit status is 0 on success)."""
    build_cli(args)


if __name__ == "__main__":
    main()
