"""Your own LightningModule with DeMo: the only change from DDP is ``strategy="demo"``.

    python examples/own_module.py                      # 2 CPU processes, Lightning launches them
    torchrun --standalone --nproc-per-node 2 examples/own_module.py   # the launcher multi-node uses
    python examples/own_module.py --compile            # trainer.fit(torch.compile(model)); ~30 s to compile on CPU

A small classifier on scikit-learn's bundled digits (no download). At the end every rank prints
a hash of its parameters: DeMo keeps the replicas identical, so the hashes agree.
"""

from __future__ import annotations

import argparse
import hashlib

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import demo_lightning  # noqa: F401  registers strategy="demo" and "desloc"
from demo_lightning.data import load_digits_tensors


class DigitsMLP(pl.LightningModule):
    """Any LightningModule works; nothing DeMo-specific in here."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)  # plain SGD: DeMo's sign update brings the momentum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="fit torch.compile(model, backend=BACKEND) (default backend: inductor)")
    args = parser.parse_args()
    pl.seed_everything(0)
    images, labels = load_digits_tensors(image_size=8, channels=1)
    loader = DataLoader(TensorDataset(images, labels), batch_size=32, shuffle=True, drop_last=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy="demo", max_steps=args.max_steps,
        logger=False, enable_checkpointing=False, enable_model_summary=False,
    )
    model = DigitsMLP()
    # a compiled module: Lightning unwraps it and compiles training_step; the exchange runs eagerly around it
    trainer.fit(torch.compile(model, backend=args.compile) if args.compile else model, loader)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
    traffic = trainer.strategy.ledger
    print(
        f"rank {trainer.global_rank}: params {hashlib.sha256(flat).hexdigest()[:16]}, "
        f"loss {float(trainer.callback_metrics['train/loss']):.4f}, "
        f"ratio vs DDP {traffic.cumulative_ratio_vs_ddp:.1f}x",
        flush=True,
    )


if __name__ == "__main__":
    main()
