"""Main job: a small byte-level GPT on the Python standard library's sources, with strategy="demo".

    python examples/train_gpt.py                      # DeMo, 2 CPU processes, ~300 steps
    python examples/train_gpt.py --strategy ddp --optimizer adamw --lr 3e-3   # the DDP baseline

Logs to TensorBoard under --log-dir and ends with a summary (validation loss, bytes per step,
ratio vs DDP, the exchange's share of step time); --summary-json also writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

import demo_lightning
from demo_lightning.comm import ddp_bytes_per_step
from demo_lightning.data import TextDataModule
from demo_lightning.models import GPTLightningModule


class StepTimer(pl.Callback):
    """Wall time of each training batch (forward, backward, exchange and update)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=["demo", "ddp", "desloc"], default="demo")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default=None, help="default: sgd for demo, adamw for ddp")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--gradient-clip-val", type=float, default=None,
                   help="clip each worker's gradient norm (Lightning's gradient_clip_val; under demo before the exchange). "
                        "Default: none for ddp and desloc, 1.0 for demo (its own default, clip_grad_norm='auto'); "
                        "1.0 steadies DDP + AdamW and lowers both methods' loss (README, issue 18)")
    p.add_argument("--topk", type=int, default=None)
    p.add_argument("--keep-ratio", type=float, default=None)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--decay", type=float, default=None, help="default: the strategy's (0.99)")
    p.add_argument("--value-format", default=None, help="default: the strategy's (sign)")
    p.add_argument("--selection", default="topk")
    p.add_argument("--position-format", default="auto", choices=["auto", "packed", "elias_fano"],
                   help="top-k positions on the wire: auto (the default: elias_fano where it applies), packed (12 bits "
                        "each) or elias_fano (sorted, Elias-Fano coded: the same training on about a quarter fewer bytes)")
    p.add_argument("--update", default="sign")
    p.add_argument("--param-sync-every", type=int, default=None, help="DES-LOC parameter period (desloc: default 16)")
    p.add_argument("--state-sync-every", default=None, help="DES-LOC state periods, e.g. exp_avg=48,exp_avg_sq=96")
    p.add_argument("--compress-params", action="store_true", help="desloc: parameter syncs through the DeMo codec")
    p.add_argument("--data-path", default=None, help="your own text file or folder (default: the named --corpus)")
    p.add_argument("--corpus", default="stdlib", choices=["stdlib", "prose", "cpp"],
                   help="named corpus that ships with Python and its packages (demo_lightning.data.corpora): the stdlib's "
                        "sources, English documentation prose, or C/C++ headers")
    p.add_argument("--max-bytes", type=int, default=8_000_000)
    p.add_argument("--val-check-interval", type=int, default=100)
    p.add_argument("--log-dir", default="runs")
    p.add_argument("--name", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress-bar", action="store_true", help="plain logs (for scripts and CI)")
    p.add_argument("--summary-json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.devices > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    pl.seed_everything(args.seed, workers=True, verbose=False)
    optimizer = args.optimizer or ("sgd" if args.strategy == "demo" else "adamw")
    lr = args.lr
    model = GPTLightningModule(
        block_size=args.block_size, d_model=args.d_model, n_layer=args.n_layer, optimizer=optimizer,
        lr=lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, max_steps=args.max_steps,
    )
    data = TextDataModule(path=args.data_path, corpus=args.corpus, block_size=args.block_size, batch_size=args.batch_size,
                          max_bytes=args.max_bytes)
    states = None
    if args.state_sync_every:
        states = {k: int(v) for k, v in (item.split("=") for item in args.state_sync_every.split(","))}
    if args.strategy == "demo":
        codec = {k: v for k, v in (("decay", args.decay), ("value_format", args.value_format)) if v is not None}
        strategy: Any = demo_lightning.DeMoStrategy(
            chunk=args.chunk, topk=args.topk, keep_ratio=args.keep_ratio, selection=args.selection,
            position_format=args.position_format, update=args.update, param_sync_every=args.param_sync_every, state_sync_every=states, **codec,
        )
    elif args.strategy == "desloc":
        strategy = demo_lightning.DesLocStrategy(
            param_sync_every=args.param_sync_every or 16, state_sync_every=states, compress_params=args.compress_params,
            chunk=args.chunk, topk=args.topk, keep_ratio=args.keep_ratio, value_format=args.value_format or "sign",
            position_format=args.position_format,
        )
    else:
        strategy = "ddp"
    name = args.name or f"gpt_{args.strategy}"
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
        val_check_interval=args.val_check_interval, check_val_every_n_epoch=None, limit_val_batches=1.0,
        logger=TensorBoardLogger(args.log_dir, name=name), callbacks=[timer],
        enable_checkpointing=False, log_every_n_steps=10, enable_model_summary=False,
        enable_progress_bar=not args.no_progress_bar, gradient_clip_val=args.gradient_clip_val,
    )
    trainer.fit(model, datamodule=data)
    val_loss = float(trainer.validate(model, datamodule=data, verbose=False)[0]["val/loss"])
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    world = trainer.world_size
    ddp_bytes = ddp_bytes_per_step(n_trainable, world)
    steps = timer.seconds[1:] or timer.seconds
    step_time = sum(steps) / max(1, len(steps))
    summary: dict[str, Any] = {
        "strategy": args.strategy, "optimizer": optimizer, "lr": lr, "gradient_clip_val": args.gradient_clip_val,
        "world_size": world, "steps": trainer.global_step,
        "n_trainable": n_trainable, "final_val_loss": val_loss, "step_time_s": step_time,
        "ddp_bytes_per_step": ddp_bytes,
    }
    strat = trainer.strategy
    if isinstance(strat, demo_lightning.strategies.CommunicationStrategy):
        ledger = strat.ledger
        summary.update(
            bytes_sent_per_step=ledger.steps_sent_bytes / max(1, ledger.steps),
            bytes_received_per_step=ledger.steps_received_bytes / max(1, ledger.steps),
            ratio_vs_ddp=ledger.cumulative_ratio_vs_ddp,
            last_step_ratio_vs_ddp=ledger.last_step.ratio_vs_ddp if ledger.last_step is not None else None,
            bytes_by_tag={tag: t.sent_bytes for tag, t in ledger.totals.items()},
        )
        if isinstance(strat, demo_lightning.DeMoStrategy) and strat.last_stats is not None:
            stats = strat.last_stats
            summary.update(
                exchange_share=stats.total_seconds / max(1e-12, sum(timer.seconds)),
                exchange_comm_share=stats.total_comm_seconds / max(1e-12, sum(timer.seconds)),
                config=vars(strat.demo_config),
            )
        if strat.averagers:
            summary["compress_params"] = strat.desloc_config.compress_params
            summary["desloc_syncs"] = dict(strat.averagers[0].stats.syncs)
            summary["desloc_periods"] = {"params": strat.desloc_config.param_sync_every, **strat.averagers[0].state_periods}
    else:
        summary.update(bytes_sent_per_step=ddp_bytes, bytes_received_per_step=ddp_bytes, ratio_vs_ddp=1.0)
    if trainer.is_global_zero:
        print(f"\n== {name}: {world} workers, {trainer.global_step} optimizer steps, {n_trainable:,} parameters ==")
        print(f"validation loss          {val_loss:.4f} nats/byte")
        print(f"bytes sent per step      {summary['bytes_sent_per_step']:,.0f} per worker, mean over steps (DDP: {ddp_bytes:,.0f})")
        last, exchanges = summary.get("last_step_ratio_vs_ddp"), list(getattr(strat, "exchanges", []))
        early = exchanges[0].early_codec if exchanges else None
        late = ""
        if last and early is not None:
            kept = f"{early.topk} a tile" if early.topk is not None else f"a keep ratio of {early.keep_ratio}"
            late = f" over the run; the last step {last:.1f}x (the first {exchanges[0].config.early_steps} exchanges keep {kept})"
        print(f"ratio vs DDP             {summary['ratio_vs_ddp']:.1f}x fewer bytes{late}")
        print(f"step time                {step_time * 1000:.1f} ms")
        if "exchange_share" in summary:
            print(f"exchange share of step   {100 * summary['exchange_share']:.1f} % (collectives {100 * summary['exchange_comm_share']:.1f} %)")
        print(f"TensorBoard              tensorboard --logdir {args.log_dir}")
        if args.summary_json:
            Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary_json).write_text(json.dumps(summary, indent=2, default=str))
    return summary


if __name__ == "__main__":
    main()
