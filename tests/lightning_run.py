"""A real multi-process Lightning fit with strategy="demo", driven by the tests in a subprocess.

Lightning's default launcher re-runs this script for every local rank; each rank writes
``rank{R}.pt`` into ``--out`` with per-step parameter and momentum hashes, per-step losses, the
logged comm metrics and its final tensors. ``--nan-at STEP --nan-rank R`` makes rank R's loss NaN
(``--nan-kind loss``) or one of its gradients inf (``--nan-kind grad``) at optimizer step STEP; a rank
whose fit raises writes the message to ``rank{R}.error`` before re-raising.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist

import demo_lightning
from demo_lightning.data import TextDataModule
from demo_lightning.models import GPTLightningModule

from dist_helpers import tensor_hash


def _position_groups(trainer: pl.Trainer, model: torch.nn.Module) -> dict[str, Any]:
    exchanges = getattr(trainer.strategy, "exchanges", [])
    plan = exchanges[0]._momentum.plan if exchanges else None
    if plan is None:
        return {}
    names = {id(p): n for n, p in model.named_parameters()}
    params = exchanges[0].parameters()
    shared = [(names[id(params[t.position])], names[id(params[t.shares_with.position])]) for t in plan.tensors if t.shares_with is not None]
    return {"shared": shared, "payload": sum(run.nbytes for bucket in plan.buckets for run in bucket)}


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.param_hashes: list[list[str]] = []
        self.momentum_hashes: list[list[str]] = []
        self.state_hashes: list[dict[str, list[str]]] = []
        self.losses: list[float] = []
        self.comm: list[dict[str, float]] = []
        self.skipped: list[bool] = []
        self.desloc_steps: list[list[int]] = []
        self.global_steps: list[int] = []
        self.lrs: list[float] = []
        self.position_groups: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # before the strategy's teardown, which drops the exchange's plan (its state follows the model to the CPU)
        self.position_groups = _position_groups(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        opt = trainer.optimizers[0]
        self.param_hashes.append([tensor_hash(p) for p in pl_module.parameters()])
        self.momentum_hashes.append(
            [tensor_hash(e.momentum(p)) for e in getattr(trainer.strategy, "exchanges", []) for p in pl_module.parameters() if e.has_momentum(p)]
        )
        self.state_hashes.append(
            {key: [tensor_hash(opt.state[p][key]) for p in pl_module.parameters() if key in opt.state[p]] for key in ("exp_avg", "exp_avg_sq")}
        )
        self.losses.append(float(outputs["loss"]))
        self.comm.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("comm/", "guard/"))})
        self.skipped.append(bool(getattr(trainer.strategy, "last_step_skipped", False)))
        self.desloc_steps.append([a.step_count for a in getattr(trainer.strategy, "averagers", [])])
        self.global_steps.append(trainer.global_step)
        self.lrs.append(float(opt.param_groups[0]["lr"]))


class DivergingSettings(pl.Callback):
    """Rank ``rank`` alone gives the first exchanged tensor its own topk at optimizer step ``at``."""

    def __init__(self, at: int, rank: int = 1) -> None:
        self.at, self.rank = at, rank

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at and trainer.global_rank == self.rank:
            from demo_lightning.algorithms import TensorSettings

            exchange = trainer.strategy.exchanges[0]
            exchange.set_tensor_settings(exchange.parameters()[0], TensorSettings(topk=3))


class PoisonedGPT(GPTLightningModule):
    """The GPT whose loss (or one gradient) turns non-finite on one rank at one optimizer step."""

    nan_at: Optional[int] = None
    nan_rank: int = 1
    nan_kind: str = "loss"

    def _poison_now(self) -> bool:
        return self.nan_at is not None and self.trainer.global_step == self.nan_at and self.trainer.global_rank == self.nan_rank

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.nan_kind == "loss" and self._poison_now():
            loss = loss * float("nan")
        return loss

    def on_after_backward(self) -> None:
        if self.nan_kind == "grad" and self._poison_now():
            grad = next(p.grad for p in self.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("inf")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-epochs", type=int, default=1)
    p.add_argument("--max-bytes", type=int, default=60_000)
    p.add_argument("--ckpt-in", default=None)
    p.add_argument("--ckpt-out", default=None)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--strategy", default="demo", choices=["demo", "desloc", "ddp"])
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--strategy-json", default="{}")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--nonfinite", default=None, choices=["skip", "raise"], help="strategy's nonfinite (default: its own)")
    p.add_argument("--nan-at", type=int, default=None, help="optimizer step (0-based) at which to inject a non-finite value")
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--nan-kind", default="loss", choices=["loss", "grad"])
    p.add_argument("--diverge-settings-at", type=int, default=None, help="optimizer step at which rank 1 alone changes a tensor's topk")
    p.add_argument("--rank-seeded-init", action="store_true", help="initialise the model differently on every rank")
    args = p.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    if args.rank_seeded_init:  # Lightning's launcher sets LOCAL_RANK for the processes it starts
        torch.manual_seed(1 + int(os.environ.get("LOCAL_RANK", "0")))
    model = PoisonedGPT(block_size=32, d_model=64, n_layer=2, n_head=2, optimizer=args.optimizer, lr=1e-2, momentum=args.momentum, warmup_steps=2, max_steps=100)
    model.nan_at, model.nan_rank, model.nan_kind = args.nan_at, args.nan_rank, args.nan_kind
    initial = {n: t.detach().clone() for n, t in model.named_parameters()}
    data = TextDataModule(block_size=32, batch_size=8, max_bytes=args.max_bytes, max_val_bytes=2_000)
    options = json.loads(args.strategy_json)
    if args.nonfinite is not None:
        options["nonfinite"] = args.nonfinite
    if args.strategy == "demo":
        strategy: pl.strategies.Strategy = demo_lightning.DeMoStrategy(timeout=60, dense_below=100, **options)
    elif args.strategy == "desloc":
        strategy = demo_lightning.DesLocStrategy(timeout=60, **options)
    else:
        strategy = pl.strategies.DDPStrategy(timeout=datetime.timedelta(seconds=60))
    recorder = Recorder()
    callbacks: list[pl.Callback] = [recorder]
    if args.diverge_settings_at is not None:
        callbacks.append(DivergingSettings(args.diverge_settings_at))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.max_epochs,
        precision=args.precision, accumulate_grad_batches=args.accumulate, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    finished: dict[str, int] = {}

    def report_at_exit() -> None:  # registered before the strategy's exit handlers, so it runs after them
        if "rank" in finished:
            alive = dist.is_available() and dist.is_initialized()
            (out / f"rank{finished['rank']}.exit").write_text(json.dumps({"process_group_alive": alive}))

    atexit.register(report_at_exit)
    try:
        trainer.fit(model, datamodule=data, ckpt_path=args.ckpt_in)
    except Exception as error:
        (out / f"rank{trainer.global_rank}.error").write_text(f"{type(error).__name__}: {error}")
        raise
    if args.ckpt_out:
        trainer.save_checkpoint(args.ckpt_out)
    opt = trainer.optimizers[0]
    stats = getattr(trainer.strategy, "last_stats", None)
    result = {
        "initial_params": initial,
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "exchanges": stats.steps if stats else 0,
        "param_hashes": recorder.param_hashes,
        "momentum_hashes": recorder.momentum_hashes,
        "state_hashes": recorder.state_hashes,
        "losses": recorder.losses,
        "comm": recorder.comm,
        "skipped": recorder.skipped,
        "desloc_steps": recorder.desloc_steps,
        "global_steps": recorder.global_steps,
        "lrs": recorder.lrs,
        "skipped_steps": getattr(trainer.strategy, "skipped_steps", None),
        "params": {n: t.detach().clone() for n, t in model.named_parameters()},
        "momenta": {i: e.momentum(q) for e in getattr(trainer.strategy, "exchanges", []) for i, q in enumerate(model.parameters()) if e.has_momentum(q)},
        "opt_state": {
            (i, key): value.clone()
            for i, q in enumerate(model.parameters())
            for key, value in opt.state[q].items()
            if isinstance(value, torch.Tensor)
        },
        "syncs": [dict(a.stats.syncs) for a in getattr(trainer.strategy, "averagers", [])],
        # position groups: (member, the member whose positions it uses) by parameter name, and the wire bytes per step
        "position_groups": recorder.position_groups,
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")
    finished["rank"] = trainer.global_rank


if __name__ == "__main__":
    main()
