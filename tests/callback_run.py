"""Contract runs of every callback in ``demo_lightning.callbacks``, driven by tests/test_callbacks.py.

Launched once per world size (Lightning's launcher re-runs it for every local rank). For each
callback class it runs, with strategy="demo" on a tiny GPT (or the class's entry in STRATEGIES:
AdaptiveSyncPeriods needs DES-LOC, with AdamW):

* ``defaults``: the class constructed with no arguments, a fit of STEPS/2 steps;
* ``full``: a configured instance (CONFIGURED below), an uninterrupted fit of STEPS steps;
* ``first_half``: the SAME instance fitted again (fits twice), stopped after STEPS/2 steps, checkpointed;
* ``resumed``: a fresh instance resumed from that checkpoint to STEPS.

Each rank writes ``rank{R}.json``: per fit, per optimizer step, the callback's ``state_dict()``,
the exchange's per-tensor settings, the DES-LOC periods, this rank's parameter hash (``replica``) and,
where every rank must hold the same parameters (DeMo: every step; DES-LOC: right after a parameter
sync), ``params``. The monitor's fit logs to TensorBoard.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

import demo_lightning.callbacks as callbacks
from demo_lightning import DesLocStrategy
from demo_lightning.data import TextDataModule
from demo_lightning.models import GPTLightningModule

from dist_helpers import tensor_hash

STEPS = 8
CONFIGURED: dict[str, dict[str, Any]] = {
    "AdaptiveKeepRatio": {"energy": 0.5, "update_every": 2, "max_bytes_per_step": 20000},
    # the preset under a DeMo exchange is constant over the run: a user rule ramps the embedding's decay, so a
    # schedule position is there to resume to
    "LayerPolicy": {"preset": "language", "rules": [callbacks.LayerRule(pattern="*tok.weight", beta=callbacks.Schedule(kind="linear", start=0.9, end=0.99))]},
    "CommunicationMonitor": {"histogram_every": 4},
    # a tight band, so the periods move within the 8 steps
    "AdaptiveSyncPeriods": {"low": 0.9, "high": 1.1, "max_period": 4},
}
# callbacks that need another strategy than "demo": (strategy factory, the GPT's optimizer)
STRATEGIES: dict[str, tuple[Any, str]] = {
    "AdaptiveSyncPeriods": (lambda: DesLocStrategy(param_sync_every=1), "adamw"),
}


def callback_classes() -> list[type[pl.Callback]]:
    """Every Callback class the package exports (new ones join the contract automatically)."""
    return [
        obj for name in callbacks.__all__
        if inspect.isclass(obj := getattr(callbacks, name)) and issubclass(obj, pl.Callback)
    ]


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


class Recorder(pl.Callback):
    def __init__(self, watched: pl.Callback) -> None:
        self.watched = watched
        self.steps: list[dict[str, Any]] = []
        self._param_syncs = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        averagers = trainer.strategy.averagers  # a resumed fit starts from the restored count
        self._param_syncs = averagers[0].stats.syncs.get("params", 0) if averagers else 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        exchanges, averagers = trainer.strategy.exchanges, trainer.strategy.averagers
        replica = tensor_hash(torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]))
        syncs = averagers[0].stats.syncs.get("params", 0) if averagers else 0
        identical = bool(exchanges) or syncs > self._param_syncs  # DeMo: every step; DES-LOC: just averaged
        self._param_syncs = syncs
        self.steps.append({
            "step": trainer.global_step,
            "state": jsonable(self.watched.state_dict()),
            "settings": {n: repr(exchanges[0].tensor_settings(p)) for n, p in pl_module.named_parameters()} if exchanges else {},
            "periods": averagers[0].periods if averagers else {},
            "replica": replica, "params": replica if identical else None,
            "loss": float(outputs["loss"]),
            "batch": tensor_hash(batch.float()), "epoch": trainer.current_epoch,
        })


class StopAfterFirstEpoch(pl.Callback):
    """Stops a 2-epoch fit after its first epoch: a run interrupted half-way, schedules sized for 2."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.should_stop = True


def fit(callback: pl.Callback, epochs: int, out: Path, name: str, *, ckpt_in: str | None = None, tb: bool = False,
        stop_half_way: bool = False) -> list[dict[str, Any]]:
    pl.seed_everything(0, workers=True)
    recorder = Recorder(callback)
    extra = [StopAfterFirstEpoch()] if stop_half_way else []
    make_strategy, optimizer = STRATEGIES.get(type(callback).__name__, (lambda: "demo", "sgd"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("CONTRACT_DEVICES", "1")), strategy=make_strategy(), max_epochs=epochs,
        callbacks=[callback, recorder, *extra], logger=TensorBoardLogger(out / "tb", name=name) if tb else False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        # epochs of STEPS/2 batches, ended by max_epochs: the half-way checkpoint falls on a clean epoch
        # boundary (plain dataloaders do not resume mid-epoch; a fit stopped by max_steps at an epoch's
        # last batch resumes into a truncated epoch)
        limit_train_batches=STEPS // 2, limit_val_batches=0, num_sanity_val_steps=0, deterministic=True,
    )
    model = GPTLightningModule(block_size=32, d_model=64, n_layer=2, n_head=2, optimizer=optimizer, lr=1e-2, warmup_steps=2, max_steps=STEPS)
    data = TextDataModule(block_size=32, batch_size=4, max_bytes=40_000, max_val_bytes=2_000)
    trainer.fit(model, data, ckpt_path=ckpt_in)
    if stop_half_way:
        trainer.save_checkpoint(out / f"{name}.ckpt")
    return recorder.steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    results: dict[str, Any] = {"classes": [c.__name__ for c in callback_classes()]}
    for cls in callback_classes():
        name = cls.__name__
        kwargs = CONFIGURED.get(name, {})
        record: dict[str, Any] = {"defaults": fit(cls(), 1, out, f"{name}-defaults")}
        instance = cls(**kwargs)
        record["full"] = fit(instance, 2, out, f"{name}-full", tb=True)
        record["first_half"] = fit(instance, 2, out, f"{name}-half", stop_half_way=True)  # the same instance again
        record["resumed"] = fit(cls(**kwargs), 2, out, f"{name}-resumed", ckpt_in=str(out / f"{name}-half.ckpt"))
        if hasattr(instance, "summary"):
            record["summary"] = jsonable(getattr(instance, "summary"))
        results[name] = record
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
