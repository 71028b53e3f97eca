"""Lightning fits on ``--devices`` CPU processes that save, remove and resume sharded checkpoints, for tests/test_checkpoint_shards.py.

Launched as a plain script (Lightning's ``popen`` launcher re-runs it for ranks 1..N-1, as
``tests/resume_run.py``). ``--fits`` lists fits run one after the other by the same processes
(imports cost ~10 s of CPU per process); each builds a fresh small GPT, strategy and Trainer and
reseeds. A fit with ``save`` runs ``epochs`` epochs of ``steps_per_epoch`` optimizer steps under a
``ModelCheckpoint(filename="{step}", save_top_k=top_k)`` that saves at the end of every epoch and
(``top_k`` 1) removes the previous epoch's checkpoint through ``strategy.remove_checkpoint``;
``save_last: "link"`` adds ``last.ckpt``, a symbolic link to the latest checkpoint. With
``plant``, rank 0 drops ``keep.txt`` into the first checkpoint's shard directory before it is
removed (removal must leave that file, and so the directory, alone). ``ckpt_in`` resumes a fit.

Each rank writes ``<out>/<name>/rank<R>.json``:

* ``restored``: at ``on_train_start`` (restored, no new step yet) the global step, the sha256 prefix
  (``tensor_hash``) of every parameter, of every tensor of the optimizer's ``state_dict``, of every
  DeMo momentum the exchange stores, the DES-LOC schedule and ``skipped_steps``;
* ``saves``: the same at every ``on_save_checkpoint`` (what that checkpoint must hold for this rank;
  the parameters are the DES-LOC replica, ``local_replica()``);
* ``steps``: per optimizer step the loss and the parameter hashes;
* ``warnings``: the per-worker-state warnings the fit raised; ``error``: type and message if the
  fit raised (the processes then go on with the next fit: every rank raises it together).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import demo_lightning
from demo_lightning.data import TextDataModule
from demo_lightning.models import GPTLightningModule

from dist_helpers import record_pid, tensor_hash


def _state_hashes(trainer: pl.Trainer, params: list[torch.Tensor] | None = None) -> dict[str, Any]:
    strategy = trainer.strategy
    opt = trainer.optimizers[0]
    if params is None:
        params = [p for g in opt.param_groups for p in g["params"]]
    optimizer = {
        f"{i}/{key}": tensor_hash(v.reshape(-1))
        for i, entry in sorted(opt.state_dict()["state"].items())
        for key, v in sorted(entry.items())
        if isinstance(v, torch.Tensor)
    }
    momenta: dict[str, str] = {}
    for exchange in strategy.exchanges:
        momenta = {str(i): tensor_hash(e["value"].reshape(-1)) for i, e in sorted(exchange.state_dict()["momentum"]["momenta"].items())}
    return {
        "global_step": trainer.global_step,
        "params": [tensor_hash(p) for p in params],
        "optimizer": optimizer,
        "momenta": momenta,
        "desloc": [{k: a.state_dict()[k] for k in ("step_count", "syncs")} for a in strategy.averagers],
        "skipped_steps": strategy.skipped_steps,
    }


class Recorder(pl.Callback):
    def __init__(self, out: Path, plant: bool) -> None:
        self.out, self.plant = out, plant
        self.record: dict[str, Any] = {"restored": None, "saves": [], "steps": []}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record["restored"] = _state_hashes(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plant and trainer.is_global_zero and trainer.current_epoch == 1:
            for shards in (self.out / "ckpt").glob("*.ckpt.shards"):
                (shards / "keep.txt").write_text("a file of the user's")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        params = None
        for averager in trainer.strategy.averagers:
            params = averager.local_replica()[0]
        self.record["saves"].append(_state_hashes(trainer, params))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.record["steps"].append({
            "global_step": trainer.global_step, "loss": repr(float(outputs["loss"])),
            "params": [tensor_hash(p) for p in pl_module.parameters()],
        })


def fit(spec: dict[str, Any], args: argparse.Namespace, data: TextDataModule) -> None:
    out = Path(args.out) / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    model = GPTLightningModule(block_size=32, d_model=64, n_layer=2, n_head=2, optimizer=spec["optimizer"], lr=1e-2, warmup_steps=2, max_steps=100)
    options = spec.get("options", {})
    if spec["strategy"] == "demo":
        strategy: pl.strategies.Strategy = demo_lightning.DeMoStrategy(timeout=args.timeout, **options)
    else:
        strategy = demo_lightning.DesLocStrategy(timeout=args.timeout, **options)
    recorder = Recorder(out, bool(spec.get("plant")))
    callbacks: list[pl.Callback] = [recorder]
    if spec.get("save"):
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", filename="{step}", every_n_epochs=1, save_top_k=spec.get("top_k", 1),
                                         save_last=spec.get("save_last"), save_on_train_epoch_end=True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy, max_epochs=spec["epochs"],
        limit_train_batches=spec["steps_per_epoch"], limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(spec.get("save")),
    )
    rank = trainer.global_rank
    record = recorder.record
    started = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, datamodule=data, ckpt_path=spec.get("ckpt_in"))
        except Exception as error:
            record["error"] = {"type": type(error).__name__, "message": str(error), "seconds": round(time.time() - started, 1)}
    record["warnings"] = [str(w.message) for w in caught if "per-worker state comes from" in str(w.message)]
    record["world_size"] = trainer.world_size
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument(
        "--fits", required=True,
        help="JSON list of fits run one after the other, each {name, strategy: demo|desloc, optimizer, options, epochs, "
        "steps_per_epoch, save, top_k, save_last, plant, ckpt_in}",
    )
    p.add_argument("--timeout", type=float, default=20.0, help="the strategies' collective timeout in seconds")
    args = p.parse_args()
    out = Path(args.out)
    record_pid(out)
    torch.set_num_threads(1)
    data = TextDataModule(block_size=32, batch_size=4, max_bytes=40_000, max_val_bytes=2_000)
    for spec in json.loads(args.fits):
        fit(spec, args, data)


if __name__ == "__main__":
    main()
