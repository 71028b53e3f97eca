"""DES-LOC with your own optimizer: name the optimizer-state keys to average and their periods.

    python examples/desloc_own_optimizer.py

``torch.optim.RMSprop`` keeps ``square_avg`` (and ``momentum_buffer`` with momentum); DES-LOC
averages the parameters every ``param_sync_every`` steps and each named state on its own period.
Without Lightning, ``DesLocAverager(optimizer, DesLocConfig(...)).attach()`` does the same.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from demo_lightning import DesLocStrategy
from demo_lightning.data import load_digits_tensors


class DigitsMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(self.parameters(), lr=1e-3, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=96)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    pl.seed_everything(0)
    images, labels = load_digits_tensors(image_size=8, channels=1)
    loader = DataLoader(TensorDataset(images, labels), batch_size=32, shuffle=True, drop_last=True)
    strategy = DesLocStrategy(param_sync_every=8, state_sync_every={"momentum_buffer": 24, "square_avg": 48})
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
        logger=False, enable_checkpointing=False, enable_model_summary=False,
    )
    trainer.fit(DigitsMLP(), loader)
    totals = {tag: t.calls for tag, t in strategy.ledger.totals.items() if tag.startswith("desloc/")}
    print(f"rank {trainer.global_rank}: syncs by tag {totals}, ratio vs DDP {strategy.ledger.cumulative_ratio_vs_ddp:.1f}x", flush=True)


if __name__ == "__main__":
    main()
