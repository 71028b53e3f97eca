"""One rank of a 2-process Lightning fit of an awkward model, or of a fit whose rank 1 hangs or dies.

Started by ``tests/test_awkward.py`` once per rank, as a cluster launcher (torchrun, SLURM) would:
the environment carries ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``,
so Lightning starts no processes of its own and the test holds both process ids. The ranks meet at
a file barrier before ``trainer.fit`` so that import time does not eat into short collective
timeouts.

The model (:class:`Awkward`) has, at once: a parameter no rank ever uses, a branch only rank 1 runs,
a frozen layer that still sits in the optimizer, an output head tied to the embedding, and a bf16
submodule next to fp32 ones (``--callbacks`` adds LayerPolicy, AdaptiveKeepRatio and
CommunicationMonitor; ``--freeze-on-rank1 NAME`` makes the ranks' trainable sets differ). Each rank
writes into ``--out``: ``rank{R}.pid`` at start, ``rank{R}.pt`` (per-step hashes of every parameter
and optimizer state, the tensors after the broadcast and at the end) after a successful fit,
``rank{R}.error`` (``Type: message``) when the fit raises, and ``rank1.hung`` just before rank 1
blocks or exits at ``--hang-at``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import demo_lightning
from demo_lightning.algorithms import DEMO_STATE_KEY
from demo_lightning.callbacks import AdaptiveKeepRatio, CommunicationMonitor, LayerPolicy

from dist_helpers import tensor_hash

VOCAB, WIDTH, SEQ = 96, 64, 16


class Awkward(pl.LightningModule):
    """Unused parameter, rank-1-only branch, frozen layer in the optimizer, tied head, bf16 submodule."""

    def __init__(
        self, optimizer: str = "sgd", hang_at: int | None = None, hang_hook: str = "training_step", hang_kind: str = "sleep",
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)
        self.bf16 = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).to(torch.bfloat16)
        self.side = nn.Linear(WIDTH, WIDTH, bias=False)  # rank 1 only
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.unused = nn.Parameter(torch.randn(48, 40))  # no rank ever uses it
        self.optimizer_name = optimizer
        self.hang_at, self.hang_hook, self.hang_kind = hang_at, hang_hook, hang_kind
        self.out_dir: Path | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.frozen(h)
        h = h + self.out(F.gelu(self.body(h)))
        h = h + self.bf16(h.to(torch.bfloat16)).float()
        if self.trainer.global_rank == 1:
            h = h + self.side(h)
        return self.head(self.norm(h))

    def _maybe_hang(self, hook: str) -> None:
        trainer = self.trainer
        if self.hang_at is None or hook != self.hang_hook or trainer.global_rank != 1 or trainer.global_step != self.hang_at:
            return
        assert self.out_dir is not None
        (self.out_dir / "rank1.hung").write_text(f"{os.getpid()} {time.time()}")
        if self.hang_kind == "exit":
            os._exit(17)  # a lost peer: the process is gone, its sockets close
        time.sleep(3600)  # a hung peer: alive, never reaches the next collective

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._maybe_hang("training_step")
        (tokens,) = batch
        logits = self(tokens)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._maybe_hang("before_optimizer_step")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.parameters())  # frozen ones included on purpose
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=1e-3)
        return torch.optim.SGD(params, lr=1e-2)


def _named_state(module: nn.Module, optimizer: torch.optim.Optimizer, exchanges: list[Any]) -> dict[str, dict[str, str]]:
    """Hashes of every optimizer-state tensor and of the DeMo momentum (``demo_momentum``), by parameter name."""
    def hashes(p: torch.Tensor) -> dict[str, str]:
        state = optimizer.state.get(p, {})
        out = {key: tensor_hash(value) for key, value in state.items() if isinstance(value, torch.Tensor) and value.dim() > 0}
        for exchange in exchanges:
            if exchange.has_momentum(p):
                out[DEMO_STATE_KEY] = tensor_hash(exchange.momentum(p))
        return out

    return {name: hashes(p) for name, p in module.named_parameters() if p in optimizer.state or any(e.has_momentum(p) for e in exchanges)}


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.params: list[dict[str, str]] = []
        self.states: list[dict[str, dict[str, str]]] = []
        self.desloc_steps: list[list[int]] = []
        self.after_broadcast: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after_broadcast = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.params.append({n: tensor_hash(p) for n, p in pl_module.named_parameters()})
        self.states.append(_named_state(pl_module, trainer.optimizers[0], getattr(trainer.strategy, "exchanges", [])))
        self.desloc_steps.append([a.step_count for a in getattr(trainer.strategy, "averagers", [])])


def _barrier(out: Path, rank: int, world: int, seconds: float = 180.0) -> None:
    (out / f"ready{rank}").touch()
    deadline = time.monotonic() + seconds
    while not all((out / f"ready{r}").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError("the other rank never reached the start barrier")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["demo", "desloc", "combo"], default="demo")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timeout", type=float, default=60.0, help="the strategy's collective timeout, seconds")
    p.add_argument("--param-sync-every", type=int, default=3)
    p.add_argument("--hang-at", type=int, default=None, help="optimizer step (0-based) at which rank 1 blocks or exits")
    p.add_argument("--hang-hook", choices=["training_step", "before_optimizer_step"], default="training_step")
    p.add_argument("--hang-kind", choices=["sleep", "exit"], default="sleep")
    p.add_argument("--freeze-on-rank1", default=None, help="parameter name that only rank 1 freezes (a model mismatch)")
    p.add_argument("--callbacks", action="store_true", help="add LayerPolicy, AdaptiveKeepRatio and CommunicationMonitor")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    torch.manual_seed(1 + rank)  # every rank builds different weights: the strategy's broadcast must unify them
    optimizer = "adamw" if args.strategy == "desloc" else "sgd"
    model = Awkward(optimizer, args.hang_at, args.hang_hook, args.hang_kind)
    model.out_dir = out
    if args.freeze_on_rank1 and rank == 1:
        dict(model.named_parameters())[args.freeze_on_rank1].requires_grad_(False)
    codec = {"chunk": 32, "topk": 8, "dense_below": 100}
    k = args.param_sync_every
    if args.strategy == "demo":
        strategy: pl.strategies.Strategy = demo_lightning.DeMoStrategy(timeout=args.timeout, **codec)
    elif args.strategy == "desloc":
        periods = {"exp_avg": k, "exp_avg_sq": 2 * k}
        strategy = demo_lightning.DesLocStrategy(param_sync_every=k, state_sync_every=periods, timeout=args.timeout)
    else:
        strategy = demo_lightning.DeMoStrategy(param_sync_every=k, state_sync_every={DEMO_STATE_KEY: 2}, timeout=args.timeout, **codec)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (128, SEQ), generator=g)), batch_size=8)
    recorder = Recorder()
    callbacks: list[pl.Callback] = [recorder]
    if args.callbacks:
        callbacks += [
            LayerPolicy(preset="language", print_settings=False),
            AdaptiveKeepRatio(energy=0.5, update_every=2),
            CommunicationMonitor(divergence_every=2, histogram_every=0),
        ]
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, max_steps=args.steps, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=True,
    )
    _barrier(out, rank, world)
    try:
        trainer.fit(model, data)
    except Exception as error:
        (out / f"rank{rank}.error").write_text(f"{type(error).__name__}: {error}")
        raise
    opt = trainer.optimizers[0]
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "params": recorder.params,
        "states": recorder.states,
        "desloc_steps": recorder.desloc_steps,
        "after_broadcast": recorder.after_broadcast,
        "final": {n: t.detach().clone() for n, t in model.named_parameters()},
        "tied": model.head.weight is model.embed.weight,
        "dtypes": {n: str(t.dtype) for n, t in model.named_parameters()},
        "momentum_dtypes": {
            n: str(e.momentum(t).dtype) for e in getattr(trainer.strategy, "exchanges", []) for n, t in model.named_parameters() if e.has_momentum(t)
        },
        "syncs": [dict(a.stats.syncs) for a in getattr(trainer.strategy, "averagers", [])],
        "exchanged": [e.stats.n_trainable for e in getattr(trainer.strategy, "exchanges", [])],
        "k": {
            n: e.k_of(t) for e in getattr(trainer.strategy, "exchanges", []) for n, t in model.named_parameters() if t.requires_grad
        },
        "monitor": next((dict(c.last_metrics) for c in callbacks if isinstance(c, CommunicationMonitor)), {}),
    }
    torch.save(result, out / f"rank{rank}.pt")
    print(json.dumps({"rank": rank, "global_step": trainer.global_step}), file=sys.stderr)


if __name__ == "__main__":
    main()
