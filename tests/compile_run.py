"""2-process Lightning fits of a ``torch.compile``-d LightningModule, for tests/test_compile.py.

Lightning's default launcher re-runs this script for rank 1. ``--fits`` lists fits that the same
two processes run one after the other (imports cost several seconds of CPU per process; every fit
builds a fresh model, strategy and Trainer, reseeds and resets dynamo). A fit is
``{"name", "strategy": "demo" | "desloc", "compile": "none" | "torch.compile" | "module.compile" |
"submodule", "backend": a torch.compile backend, default: torch's default (inductor)}``; ``"torch.compile"`` passes
``torch.compile(model, backend=...)`` (an ``OptimizedModule``) to ``Trainer.fit`` as users do,
``"module.compile"`` calls ``model.compile()`` in place on the LightningModule, ``"submodule"``
calls ``model.model.compile()`` on the GPT inside it.

Every rank initialises its model from its own seed (the strategy's broadcast must make the replicas
equal) and trains on its own shard of the data. Per optimizer step each rank records, into
``<out>/<name>/rank<R>.pt``: a digest of its parameters, the loss, the bytes the strategy sent,
whether the loss's autograd graph runs through compiled code (a ``CompiledFunctionBackward`` node:
the forward of this step came out of a graph compiled by AOTAutograd, and its backward runs that
graph's compiled backward) and dynamo's count of compiled graphs so far; at the end its final
parameters, dynamo's graph-break counters and the inductor counters (non-empty only when inductor
generated code) and the warnings the fit raised.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import demo_lightning
from demo_lightning.data import TextDataModule
from demo_lightning.models import GPTLightningModule

from dist_helpers import record_pid, tensor_hash

STEPS = 6
DESLOC_PERIOD = 4


def params_digest(module: torch.nn.Module) -> str:
    return hashlib.sha256("".join(tensor_hash(p) for p in module.parameters()).encode()).hexdigest()[:16]


def runs_compiled_backward(loss: torch.Tensor, depth: int = 8) -> bool:
    """Whether a ``CompiledFunctionBackward`` node is within ``depth`` edges of ``loss.grad_fn``."""
    frontier, seen = [loss.grad_fn], set()
    for _ in range(depth):
        nodes = [n for n in frontier if n is not None and id(n) not in seen]
        if not nodes:
            return False
        if any(type(n).__name__ == "CompiledFunctionBackward" for n in nodes):
            return True
        seen.update(id(n) for n in nodes)
        frontier = [nxt for n in nodes for nxt, _ in n.next_functions]
    return False


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.digests: list[str] = []
        self.losses: list[float] = []
        self.sent: list[float] = []
        self.compiled_backward: list[bool] = []
        self.graphs: list[int] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.compiled_backward.append(runs_compiled_backward(loss))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        from torch._dynamo.utils import counters

        self.digests.append(params_digest(pl_module))
        self.losses.append(float(outputs["loss"]))
        traffic = trainer.strategy.last_traffic
        self.sent.append(float(traffic.sent_bytes) if traffic is not None else -1.0)
        self.graphs.append(int(counters["stats"]["unique_graphs"]))


def run_fit(spec: dict[str, Any], out: Path, timeout: float) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(0, verbose=False)
    torch.manual_seed(1 + int(os.environ.get("LOCAL_RANK", "0")))  # replicas start different: the broadcast must fix it
    model = GPTLightningModule(
        block_size=32, d_model=32, n_layer=1, n_head=2, optimizer=spec.get("optimizer", "sgd"), lr=spec.get("lr", 3e-2),
        warmup_steps=1, max_steps=100,
    )
    initial = params_digest(model)
    how = spec.get("compile", "none")
    options = {"backend": spec["backend"]} if "backend" in spec else {}  # none: torch's default, inductor
    fitted: Any = model
    if how == "torch.compile":
        fitted = torch.compile(model, **options)
    elif how == "module.compile":
        model.compile(**options)
    elif how == "submodule":
        model.model.compile(**options)
    elif how != "none":
        raise ValueError(f"unknown compile mode {how!r}")
    if spec["strategy"] == "demo":
        strategy: pl.strategies.Strategy = demo_lightning.DeMoStrategy(timeout=timeout, dense_below=100)
    else:
        strategy = demo_lightning.DesLocStrategy(timeout=timeout, param_sync_every=DESLOC_PERIOD)
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, callbacks=[recorder],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    data = TextDataModule(block_size=32, batch_size=8, max_bytes=20_000, max_val_bytes=2_000)
    fit_dir = out / spec["name"]
    fit_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(fitted, datamodule=data)
    except Exception as error:
        (fit_dir / f"rank{trainer.global_rank}.error").write_text(f"{type(error).__name__}: {error}")
        raise
    lm = trainer.lightning_module
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "fit_s": time.perf_counter() - started,
        "initial": initial,
        "digests": recorder.digests,
        "losses": recorder.losses,
        "sent": recorder.sent,
        "compiled_backward": recorder.compiled_backward,
        "graphs": recorder.graphs,
        "final": params_digest(lm),
        "params": {n: t.detach().clone() for n, t in lm.named_parameters()},
        "is_lightning_module": isinstance(lm, pl.LightningModule),
        "compiler_ctx": lm._compiler_ctx is not None,
        "graph_breaks": sum(counters["graph_break"].values()),
        "inductor": dict(counters["inductor"]),
        "skipped_steps": trainer.strategy.skipped_steps,
        "warnings": [str(w.message) for w in caught],
    }
    torch.save(result, fit_dir / f"rank{trainer.global_rank}.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fits", required=True, help="JSON list of fit specs (see the module docstring)")
    p.add_argument("--timeout", type=float, default=60, help="the strategies' collective timeout (s)")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    record_pid(out)
    for spec in json.loads(args.fits):
        run_fit(spec, out, args.timeout)


if __name__ == "__main__":
    main()
