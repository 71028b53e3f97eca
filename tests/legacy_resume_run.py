"""Resume the legacy fixtures of revision d65a308 with today's code: 2 processes, CPU, gloo; for tests/test_legacy_checkpoints.py.

Launched as a plain script (Lightning's default ``popen`` launcher re-runs it for rank 1, as for
``tests/resume_run.py`` and ``tests/lightning_run.py``). ``--fixtures`` lists fixture names of
``tests/data/make_legacy_checkpoints.py`` (``FITS``); the two processes resume them one after the
other (imports cost ~10 s of CPU per process). Each resumed fit is built exactly as the fixture's
fit was (``build_module``, the strategy settings of the fixture's JSON, the same Trainer options)
and runs ``trainer.fit(module, ckpt_path=<fixture>.ckpt)`` with ``max_epochs=2``: the checkpoint
was written at the end of epoch 0, so the fit runs epoch 1 (``steps`` more optimizer steps). Then
every rank joins ``trainer.save_checkpoint(<out>/<name>/resumed.ckpt)`` (rank 0 writes).

Every process writes ``pids/rank<R>-<pid>`` when it starts (the test kills leftovers from them).
Each rank writes into ``<out>/<name>/``:

* ``rank<R>.json``: at ``on_train_start`` (restored, no new step yet) the global step, the sha256
  (:func:`sha256_of`) of every parameter, of every momentum the exchange holds
  (``exchange.momentum(p)``, by parameter index) and which parameters ``has_momentum``, the
  strategy's ``skipped_steps`` and the DES-LOC averagers' ``state_dict`` (schedule only); after
  every optimizer step the same, plus the loss (``repr``); after the fit the final global step and
  the sha256 of every value of ``exchange.state_dict()`` (what the new checkpoint must carry);
* ``rank<R>.error`` when the fit raises (then re-raised).

With ``--controls`` every fixture is resumed a second time into ``<out>/<name>-cleared/``, with
the exchange's momenta dropped (``clear_state``) at ``on_train_start``, after the snapshot: a
negative control (the restored momenta must change what the first new step does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
sys.path.insert(0, str(DATA))  # make_legacy_checkpoints: importing it has no side effects

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import demo_lightning  # noqa: E402
from dist_helpers import record_pid  # noqa: E402
from make_legacy_checkpoints import FITS, build_module, sha256_of  # noqa: E402


def _params(trainer: pl.Trainer) -> list[torch.Tensor]:
    """Every parameter in the optimizer order (the checkpoint's parameter indices)."""
    return [p for g in trainer.optimizers[0].param_groups for p in g["params"]]


def _schedule(trainer: pl.Trainer) -> list[dict[str, Any]]:
    out = []
    for averager in trainer.strategy.averagers:
        state = averager.state_dict()
        out.append({k: state[k] for k in ("step_count", "syncs", "params_synced_at") if k in state} | {"stats_syncs": dict(averager.stats.syncs)})
    return out


def _snapshot(trainer: pl.Trainer) -> dict[str, Any]:
    (exchange,) = trainer.strategy.exchanges
    params = _params(trainer)
    return {
        "global_step": trainer.global_step,
        "params": [sha256_of(p) for p in params],
        "has_momentum": [exchange.has_momentum(p) for p in params],
        "momentum": {str(i): sha256_of(exchange.momentum(p)) for i, p in enumerate(params)},
        "momentum_dtype": {str(i): str(exchange.momentum(p).dtype).removeprefix("torch.") for i, p in enumerate(params)},
        "momentum_shape": {str(i): list(exchange.momentum(p).shape) for i, p in enumerate(params)},
        "skipped_steps": trainer.strategy.skipped_steps,
        "desloc": _schedule(trainer),
    }


class Recorder(pl.Callback):
    """``clear``: after taking the restored snapshot, drop every momentum (the negative control:
    the first new step must then come out differently)."""

    def __init__(self, clear: bool = False) -> None:
        self.clear = clear
        self.restored: dict[str, Any] = {}
        self.steps: list[dict[str, Any]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.restored = _snapshot(trainer)
        if self.clear:
            for exchange in trainer.strategy.exchanges:
                exchange.clear_state()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append({**_snapshot(trainer), "loss": repr(float(outputs["loss"]))})


def resume(name: str, out: Path, timeout: float, clear: bool = False) -> None:
    record = json.loads((DATA / f"{name}.json").read_text())
    spec = FITS[name]
    out.mkdir(parents=True, exist_ok=True)
    module = build_module(spec["optimizer"], spec["steps"])
    recorder = Recorder(clear)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=1,
        strategy=demo_lightning.DeMoStrategy(timeout=timeout, process_group_backend="gloo", **record["strategy"]),
        max_epochs=2, limit_train_batches=spec["steps"], limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False, enable_checkpointing=False, callbacks=[recorder], logger=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
    )
    rank = trainer.global_rank
    started = time.time()
    try:
        trainer.fit(module, ckpt_path=str(DATA / record["checkpoint"]))
        trainer.save_checkpoint(out / "resumed.ckpt")  # a collective: every rank joins, rank 0 writes
    except BaseException as error:
        (out / f"rank{trainer.global_rank}.error").write_text(f"{time.time() - started:.1f}s {type(error).__name__}: {error}")
        raise
    (exchange,) = trainer.strategy.exchanges
    saved = exchange.state_dict()["momentum"]
    result = {
        "rank": rank,
        "restored": recorder.restored,
        "steps": recorder.steps,
        "final_global_step": trainer.global_step,
        "final_state": {
            "version": saved["version"],
            "momenta": {str(i): {"sha256": sha256_of(e["value"]), "layout": e["layout"]} for i, e in saved["momenta"].items()},
        },
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fixtures", nargs="+", required=True, choices=sorted(FITS))
    p.add_argument("--controls", action="store_true", help="also resume every fixture with its momenta cleared at train start (into <out>/<name>-cleared/)")
    p.add_argument("--timeout", type=float, default=20.0, help="the strategy's collective timeout in seconds")
    args = p.parse_args()
    out = Path(args.out)
    record_pid(out)
    torch.set_num_threads(1)
    for name in args.fixtures:
        resume(name, out / name, args.timeout)
        if args.controls:
            resume(name, out / f"{name}-cleared", args.timeout, clear=True)


if __name__ == "__main__":
    main()
