"""A profiled 2-process Lightning fit with strategy="demo" (DeMo plus DES-LOC parameter averaging).

Run by ``tests/test_profiling.py`` in a subprocess (Lightning's default launcher re-runs this
script for rank 1). ``--profiler pytorch``: ``PyTorchProfiler`` exports one Chrome trace per rank
into ``--out``; ``--profiler simple``: ``SimpleProfiler`` writes one report per rank there
(``fit-simple-<rank>.txt``), which lists the stage ranges because the strategy registers
``trainer.profiler.profile`` as a stage sink (``demo_lightning.profiling.lightning_sink``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import demo_lightning

from dist_helpers import record_pid


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--profiler", choices=["pytorch", "simple"], required=True)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_pid(out)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 32, generator=gen), torch.randint(0, 4, (64,), generator=gen))
    profiler: pl.profilers.Profiler
    if args.profiler == "pytorch":
        # record every step from the first: the fit is too short for Lightning's default schedule
        profiler = pl.profilers.PyTorchProfiler(
            dirpath=out, filename="trace", export_to_chrome=True, record_module_names=False,
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=args.steps - 1, repeat=1),
        )
    else:
        profiler = pl.profilers.SimpleProfiler(dirpath=out, filename="simple")
    strategy = demo_lightning.DeMoStrategy(
        timeout=30, chunk=32, topk=4, dense_below=100, param_sync_every=2, process_group_backend="gloo",
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, profiler=profiler,
        logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    (out / f"rank{trainer.global_rank}.done").write_text(str(trainer.global_step))


if __name__ == "__main__":
    main()
