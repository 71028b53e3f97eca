"""2-process Lightning fits that checkpoint every epoch and can be stopped mid-run, for tests/test_resume.py.

Launched either as a plain script (Lightning's ``popen`` launcher re-runs it for rank 1) or under
``torchrun`` (Lightning detects ``TorchElasticEnvironment`` and launches nothing). ``--fits`` lists
fits run one after the other by the same two processes (imports cost ~10 s of CPU per process;
every fit builds a fresh model, strategy and Trainer and reseeds). Epochs are
``--steps-per-epoch`` optimizer steps (``limit_train_batches``) and a ``ModelCheckpoint`` writes
``step=<S>.ckpt`` and ``last.ckpt`` at the end of every epoch, so the latest checkpoint is always at
an epoch boundary: Lightning's plain DataLoaders cannot resume inside an epoch.

Faults of a fit, checked in ``on_train_batch_end`` after global step S (S optimizer steps done):

* ``raise_at: S``: every rank raises ``InjectedFailure``; the processes go on with the next fit;
* ``kill_at: S``: rank ``--kill-rank`` sends itself ``SIGKILL`` (its peer then fails in its next
  collective, which ends the launch); with ``--kill-marker PATH`` only while PATH does not exist
  (it is created first), so a run restarted by torchrun does not kill itself again.

Every process writes ``pids/rank<R>-<pid>`` when it starts (the tests kill leftovers from them:
torchrun puts its workers in sessions of their own). Each fit writes into ``<out>/<name>/``:
``rank<R>.fault`` when it injects a fault, ``rank<R>.error`` when the fit raises, per-step records
as they happen (``Recorder``: global step, loss, hashes of every parameter and of every tensor of
the optimizer state, DES-LOC schedule position and sync counts, skipped steps, learning rate), and
``rank<R>.pt`` with the final tensors when the fit completes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import demo_lightning
from demo_lightning.data import TextDataModule

from dist_helpers import record_pid, tensor_hash
from lightning_run import PoisonedGPT


def _state_tensors(opt: torch.optim.Optimizer, params: list[torch.Tensor], strategy: Any) -> dict[tuple[int, str], torch.Tensor]:
    """Every tensor of the optimizer state, and the DeMo residuals as the exchange stores them
    (``demo_momentum``: spectra, bitwise), by (parameter index, key)."""
    out = {
        (i, key): value
        for i, p in enumerate(params)
        for key, value in sorted(opt.state.get(p, {}).items())
        if isinstance(value, torch.Tensor)
    }
    for exchange in getattr(strategy, "exchanges", []):  # what a checkpoint saves (also before the first step after a load)
        index = {p: i for i, p in enumerate(exchange.optimizer.param_groups[0]["params"])}
        stored = exchange.state_dict()["momentum"]["momenta"]
        out.update({(i, "demo_momentum"): stored[index[p]]["value"] for i, p in enumerate(params) if p in index and index[p] in stored})
    return dict(sorted(out.items()))


def _schedule(strategy: Any) -> dict[str, Any]:
    return {
        "desloc": [a.state_dict() for a in getattr(strategy, "averagers", [])],
        "skipped_steps": getattr(strategy, "skipped_steps", None),
    }


class Recorder(pl.Callback):
    """Per optimizer step, on every rank: what a resumed run must reproduce bitwise.

    Each record is appended to ``rank<R>.attempt<A>.jsonl`` as soon as the step ends (A: torchrun's
    restart count, 0 outside torchrun), so a run that is stopped later keeps the steps it did.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.records: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        opt = trainer.optimizers[0]
        params = list(pl_module.parameters())
        record = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "loss": repr(float(outputs["loss"])),  # a string: exact, and NaN (the skipped step) equals NaN
            "params": [tensor_hash(p) for p in params],
            "state": {f"{i}/{key}": tensor_hash(v.reshape(-1)) for (i, key), v in _state_tensors(opt, params, trainer.strategy).items()},
            "lr": float(opt.param_groups[0]["lr"]),
            **_schedule(trainer.strategy),
        }
        self.records.append(record)
        with open(self.out / f"rank{trainer.global_rank}.attempt{self.attempt}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


class InjectedFailure(RuntimeError):
    """Raised by ``Fault`` on every rank at the same step: the process group stays usable afterwards."""


def write_error(out: Path, rank: int, started: float, error: BaseException) -> None:
    """``rank<R>.error``: when and how the fit failed on this rank."""
    (out / f"rank{rank}.error").write_text(f"{time.time()} {time.time() - started:.1f}s {type(error).__name__}: {error}")


class Fault(pl.Callback):
    """Stop the run after a given global step: an exception on every rank, or SIGKILL on one.

    Also records a failure on this rank as soon as Lightning sees it (``on_exception``, the first
    thing it calls): after a peer's SIGKILL, Lightning's launcher SIGKILLs the main process (rank 0)
    at its next poll of the children (every 5 s), so on a loaded machine rank 0 may not live to
    reach the handler around ``fit``."""

    def __init__(self, out: Path, raise_at: int | None, kill_at: int | None, kill_rank: int, marker: Path | None) -> None:
        self.out, self.raise_at, self.kill_at, self.kill_rank, self.marker = out, raise_at, kill_at, kill_rank, marker
        self.started = time.time()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        write_error(self.out, trainer.global_rank, self.started, exception)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, rank = trainer.global_step, trainer.global_rank
        if step == self.raise_at:
            (self.out / f"rank{rank}.fault").write_text(f"raise {step} {time.time()}")
            raise InjectedFailure(f"injected failure after step {step}")
        if step == self.kill_at and rank == self.kill_rank and not (self.marker is not None and self.marker.exists()):
            if self.marker is not None:
                self.marker.write_text(str(os.getpid()))
            (self.out / f"rank{rank}.fault").write_text(f"kill {step} {time.time()}")
            os.kill(os.getpid(), signal.SIGKILL)


def fit(spec: dict[str, Any], args: argparse.Namespace, data: TextDataModule) -> None:
    """One fit of ``spec`` (see ``--fits``); its files go to ``<out>/<name>/``."""
    out = Path(args.out) / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    model = PoisonedGPT(block_size=32, d_model=64, n_layer=2, n_head=2, optimizer=spec["optimizer"], lr=1e-2, warmup_steps=2, max_steps=100)
    model.nan_at, model.nan_rank, model.nan_kind = args.nan_at, args.nan_rank, "loss"
    options = spec.get("options", {})
    if spec["strategy"] == "demo":
        strategy: pl.strategies.Strategy = demo_lightning.DeMoStrategy(timeout=args.timeout, **options)
    else:
        strategy = demo_lightning.DesLocStrategy(timeout=args.timeout, **options)
    recorder = Recorder(out)
    checkpoints = ModelCheckpoint(
        dirpath=out / "ckpt", filename="{step}", every_n_epochs=1, save_top_k=-1, save_last=True, save_on_train_epoch_end=True,
    )
    marker = Path(args.kill_marker) if args.kill_marker else None
    fault = Fault(out, spec.get("raise_at"), spec.get("kill_at"), args.kill_rank, marker)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, max_epochs=args.epochs,
        limit_train_batches=args.steps_per_epoch, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[recorder, checkpoints, fault], logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    started = time.time()
    try:
        trainer.fit(model, datamodule=data, ckpt_path=spec.get("ckpt_in"))
    except BaseException as error:
        write_error(out, trainer.global_rank, started, error)
        raise
    opt = trainer.optimizers[0]
    params = list(model.parameters())
    torch.save(
        {
            "rank": trainer.global_rank,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
            "global_step": trainer.global_step,
            "params": {n: t.detach().clone() for n, t in model.named_parameters()},
            "opt_state": {k: v.detach().clone() for k, v in _state_tensors(opt, params, trainer.strategy).items()},
            **_schedule(trainer.strategy),
        },
        out / f"rank{trainer.global_rank}.pt",
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument(
        "--fits", required=True,
        help="JSON list of fits run one after the other in the same processes, each {name, strategy: demo|desloc, "
        "optimizer, options: strategy kwargs, ckpt_in: path or 'last' (none found: from scratch), raise_at, kill_at}",
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=4)
    p.add_argument("--timeout", type=float, default=20.0, help="the strategies' collective timeout in seconds")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-marker", default=None)
    p.add_argument("--nan-at", type=int, default=None, help="0-based optimizer step at which --nan-rank's loss is NaN (skipped)")
    p.add_argument("--nan-rank", type=int, default=1)
    args = p.parse_args()

    out = Path(args.out)
    record_pid(out)
    torch.set_num_threads(1)
    data = TextDataModule(block_size=32, batch_size=4, max_bytes=40_000, max_val_bytes=2_000)  # read once, shared
    for spec in json.loads(args.fits):
        try:
            fit(spec, args, data)
        except InjectedFailure:
            continue  # every rank stopped at the same step: go on with the next fit


if __name__ == "__main__":
    main()
