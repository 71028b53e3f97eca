"""A short Lightning fit whose TensorBoard run tests/test_tensorboard_dashboard.py serves with a real server.

Launched as a plain script (Lightning's ``popen`` launcher re-runs it for ranks 1..N-1): a tiny GPT,
``strategy="demo"`` on ``--devices`` CPU processes, ``--steps`` optimizer steps, every step logged
(``log_every_n_steps=1``), a ``TensorBoardLogger`` into ``<out>/tb`` (name ``demo``) and a
``CommunicationMonitor`` with ``baseline=--baseline``. Each rank writes ``<out>/rank<R>.json``: the
monitor's ``summary`` and ``final_metrics``, its ``run_hyperparameters`` and the logger's run directory.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from demo_lightning import DeMoStrategy
from demo_lightning.callbacks import CommunicationMonitor
from demo_lightning.data import TextDataModule
from demo_lightning.models import GPTLightningModule

from dist_helpers import record_pid


class _Record(pl.Callback):
    """After the monitor's ``on_fit_end`` (it is listed first): what the run ended with."""

    def __init__(self, monitor: CommunicationMonitor) -> None:
        self.monitor = monitor
        self.record: dict[str, Any] = {}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record = {
            "summary": {k: v for k, v in self.monitor.summary.items() if k in ("optimizer_steps", "ratio_vs_ddp", "sent_bytes_per_step")},
            "final_metrics": self.monitor.final_metrics,
            "hparams": self.monitor.run_hyperparameters(trainer, pl_module),
            "log_dir": trainer.logger.log_dir if trainer.logger is not None else None,
            "global_step": trainer.global_step,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--baseline", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    record_pid(out)
    torch.set_num_threads(1)
    pl.seed_everything(0, workers=True)
    monitor = CommunicationMonitor(baseline=args.baseline, histogram_every=0)
    record = _Record(monitor)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=DeMoStrategy(timeout=60), max_steps=args.steps,
        limit_train_batches=args.steps, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
        logger=TensorBoardLogger(out / "tb", name="demo"), callbacks=[monitor, record],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = GPTLightningModule(block_size=32, d_model=64, n_layer=2, n_head=2, optimizer="sgd", lr=1e-2, warmup_steps=2, max_steps=args.steps)
    data = TextDataModule(block_size=32, batch_size=4, max_bytes=40_000, max_val_bytes=2_000)
    trainer.fit(model, data)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(record.record))


if __name__ == "__main__":
    main()
