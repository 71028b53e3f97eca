"""A 2-process gloo Lightning fit that proves every collective gets tensors on the communicator's
device, driven by tests/test_devices.py (Lightning's launcher re-runs this script for rank 1).

On a CPU-only machine every device is the CPU, so a control path that forgets
``device=communicator.device`` would still work here and only fail on NCCL. To make it fail here
too, the control paths run with PyTorch's *default* device set to ``meta`` (``with
torch.device("meta")``): a tensor built there without an explicit device lands on ``meta``, as it
would land on the CPU on a GPU job, and the Communicator's device check (or gloo) refuses it. Data
tensors derive from the parameters and keep their device. The control paths wrapped:

* ``Communicator.check_same`` (codec fingerprint, DeMo plan, DES-LOC layouts) and
  ``Communicator.all_gather_object`` (the agreement on a checkpoint's shards when resuming; saving
  runs no collective: every rank writes its own shard);
* the non-finite guard (``gather_nonfinite`` as the strategy calls it);
* ``AdaptiveKeepRatio.on_train_batch_end`` (``adaptive/k``) and
  ``CommunicationMonitor.on_train_batch_end`` (``monitor/reduce``, ``monitor/divergence``).

Every tensor handed to ``torch.distributed`` is also recorded with its device. Each rank writes
``rank{R}.json``: the communicator's device, the devices seen per collective and the ledger tags.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist

import demo_lightning.algorithms.guard as guard_module
from demo_lightning import DeMoStrategy
from demo_lightning.callbacks import AdaptiveKeepRatio, CommunicationMonitor, LayerPolicy
from demo_lightning.comm import Communicator
from demo_lightning.data import TextDataModule
from demo_lightning.models import GPTLightningModule

SEEN: dict[str, set[str]] = defaultdict(set)


def _default_device_meta(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.device("meta"):
            return fn(*args, **kwargs)

    return wrapper


def _recording(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for arg in args:
            for t in arg if isinstance(arg, (list, tuple)) else [arg]:
                if isinstance(t, torch.Tensor):
                    SEEN[name].add(str(t.device))
        return fn(*args, **kwargs)

    return wrapper


def install() -> None:
    for cls, method in ((Communicator, "check_same"), (Communicator, "all_gather_object"),
                        (AdaptiveKeepRatio, "on_train_batch_end"), (CommunicationMonitor, "on_train_batch_end")):
        setattr(cls, method, _default_device_meta(getattr(cls, method)))
    guard_module.gather_nonfinite = _default_device_meta(guard_module.gather_nonfinite)
    for name in ("all_gather", "all_reduce", "broadcast"):
        setattr(dist, name, _recording(name, getattr(dist, name)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    install()
    pl.seed_everything(0)
    strategy = DeMoStrategy(chunk=32, param_sync_every=2, state_sync_every={"demo_momentum": 2})
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
        callbacks=[
            LayerPolicy(preset="language", print_settings=False),
            AdaptiveKeepRatio(energy=0.5, update_every=1),
            CommunicationMonitor(divergence_every=1, histogram_every=0),
        ],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    model = GPTLightningModule(block_size=16, d_model=64, n_layer=1, n_head=2, optimizer="sgd", lr=1e-2, max_steps=args.steps)
    trainer.fit(model, TextDataModule(block_size=16, batch_size=2, max_bytes=20_000, max_val_bytes=1_000))
    trainer.save_checkpoint(out / "last.ckpt")  # every rank writes its own shard: no collective
    comm = trainer.strategy.communicator
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps({
        "device": str(comm.device),
        "seen": {name: sorted(devices) for name, devices in SEEN.items()},
        "tags": sorted(comm.ledger.totals),
        "global_step": trainer.global_step,
    }))


if __name__ == "__main__":
    main()
