"""Fabric loops under ``strategy="demo"`` and ``"desloc"``, for tests/test_fabric.py (run under torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/fabric_run.py --out DIR

Every phase runs the same deterministic loop: micro-batch ``m`` of step ``s`` on rank ``r`` is a fixed
slice of scikit-learn's digits, ``--accumulate`` micro-batches per optimizer step, the first ones
inside ``fabric.no_backward_sync``; at step ``--closure-at`` the last micro-batch runs in the closure
of ``optimizer.step(closure)``. Phases, each on a fresh ``Fabric`` in the same processes (the
process group is made by the first and kept):

* ``demo``: DeMo with SGD, ``--steps`` steps, ``fabric.save`` after step ``--save-at``;
* ``demo-resumed``: a model with other weights, ``fabric.load`` of that checkpoint, then the steps after it;
* ``desloc`` / ``desloc-resumed``: the same with DES-LOC (AdamW, parameters every 2 steps, ``exp_avg``
  every 3), ending with ``fabric.strategy.final_sync()``.

Per step each rank records a hash of its parameters, the ledger's bytes, the exchanges run, and (DeMo)
a hash of its momenta; ``<out>/rank<R>.json`` holds them, with the strategy class and the exit state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from dist_helpers import record_pid, tensor_hash  # noqa: E402

import demo_lightning  # noqa: E402,F401  registers the strategies
from demo_lightning.data import load_digits_tensors  # noqa: E402

BATCH = 16


def model_for(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 96), nn.LayerNorm(96), nn.ReLU(), nn.Linear(96, 10))


def params_hash(model: nn.Module) -> str:
    return tensor_hash(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def run_phase(name: str, args: argparse.Namespace, data: tuple[torch.Tensor, torch.Tensor], resume_from: str = "") -> dict[str, Any]:
    desloc = name.startswith("desloc")
    strategy: Any = (
        demo_lightning.DesLocFabricStrategy(param_sync_every=2, state_sync_every={"exp_avg": 3, "exp_avg_sq": 6}, timeout=args.timeout)
        if desloc else demo_lightning.DeMoFabricStrategy(topk=8, chunk=16, dense_below=100, timeout=args.timeout)
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    model = model_for(seed=1 if resume_from else 0)  # a resumed run starts from other weights: the checkpoint must win
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2) if desloc else torch.optim.SGD(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    first = 0
    if resume_from:
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
        remainder = fabric.load(resume_from, state)
        first = int(state["step"])
        assert remainder == {}, remainder
    images, labels = data
    steps: list[dict[str, Any]] = []
    exchanges = fabric.strategy.exchanges
    for step in range(first, args.steps):
        def micro_batch(micro: int) -> torch.Tensor:
            start = ((step * args.accumulate + micro) * world + rank) * BATCH % (len(images) - BATCH)
            x, y = images[start:start + BATCH], labels[start:start + BATCH]
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = F.cross_entropy(model(x), y)
                fabric.backward(loss / args.accumulate)
            return loss

        with_closure = step + 1 == args.closure_at  # optimizer.step(closure): the last micro-batch runs inside it
        for micro in range(args.accumulate - (1 if with_closure else 0)):
            loss = micro_batch(micro)
        if with_closure:
            returned = optimizer.step(lambda: micro_batch(args.accumulate - 1))
            loss = returned
        else:
            returned = optimizer.step()
        optimizer.zero_grad()
        traffic = fabric.strategy.last_traffic
        record: dict[str, Any] = {
            "step": step + 1, "loss": float(loss.detach()), "params": params_hash(model),
            "sent": traffic.sent_bytes, "ddp": traffic.ddp_bytes, "tags": sorted({r.tag for r in fabric.strategy.ledger.step_records}),
            "exchange_steps": sum(e.stats.steps for e in exchanges),
            "metrics": fabric.strategy.metrics(),
            "closure": with_closure, "returned": None if returned is None else float(returned.detach()),
        }
        if exchanges:
            record["momenta"] = tensor_hash(torch.cat([exchanges[0].momentum(p).reshape(-1) for p in model.parameters()]))
        steps.append(record)
        if not resume_from and step + 1 == args.save_at:
            fabric.save(os.path.join(args.out, f"{name}.ckpt"), {"model": model, "optimizer": optimizer, "step": step + 1})
    if desloc:
        fabric.strategy.final_sync()
    layout = [(p.numel(), exchanges[0].payload_bytes(p), exchanges[0].tile_numel(p)) for p in model.parameters()] if exchanges else []
    return {"strategy": type(fabric.strategy).__name__, "steps": steps, "final": params_hash(model), "rank": rank, "layout": layout}


def load_without_a_shard(args: argparse.Namespace) -> dict[str, Any]:
    """``fabric.load`` of a copy of the DeMo checkpoint whose rank 1 shard is missing: every rank must raise."""
    import shutil

    from demo_lightning.strategies.shards import CheckpointShardError

    fabric = Fabric(accelerator="cpu", devices=2, strategy=demo_lightning.DeMoFabricStrategy(topk=8, chunk=16, dense_below=100, timeout=args.timeout))
    fabric.launch()
    source, broken = os.path.join(args.out, "demo.ckpt"), os.path.join(args.out, "broken.ckpt")
    if fabric.global_rank == 0:
        shutil.copy(source, broken)
        os.makedirs(broken + ".shards", exist_ok=True)
        shutil.copy(os.path.join(source + ".shards", "rank0.pt"), os.path.join(broken + ".shards", "rank0.pt"))
    fabric.barrier()
    model = model_for(seed=0)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    try:
        fabric.load(broken, {"model": model, "optimizer": optimizer, "step": 0})
    except CheckpointShardError as error:
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--closure-at", type=int, default=5, help="this step runs optimizer.step(closure)")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    out = Path(args.out)
    record_pid(out)
    torch.set_num_threads(1)
    data = load_digits_tensors(image_size=8, channels=1)
    result: dict[str, Any] = {}
    for name in ("demo", "desloc"):
        result[name] = run_phase(name, args, data)
        result[f"{name}-resumed"] = run_phase(f"{name}-resumed", args, data, resume_from=os.path.join(args.out, f"{name}.ckpt"))
    result["broken"] = load_without_a_shard(args)
    rank = result["demo"]["rank"]
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
