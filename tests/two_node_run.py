"""One node of a two-node Lightning fit on this machine, driven by tests/test_two_nodes.py.

Launched by ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank N`` (one launch per node, both on
127.0.0.1): one ``Trainer(num_nodes=2, devices=2)`` fit of the small GPT per positional argument
``NAME:METHOD[:FLAG...]``, one after another in the same process group (``flat``: DeMo over all
ranks, ``node``: hierarchical DeMo, ``desloc``: DES-LOC; each FLAG one of this script's options, e.g.
``dense-below=0``, ``no-dense-vectors`` or ``compose``). Every rank writes ``NAME/rank{R}.json`` into ``--out``: per-step
parameter hashes, the ledger's figures, and an independent count of the bytes this rank handed to
``torch.distributed`` collectives over groups that span both nodes (counted by wrapping the
``torch.distributed`` functions, not by the ledger), reset before each fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

import demo_lightning
from demo_lightning.data import TextDataModule
from demo_lightning.models import GPTLightningModule

from dist_helpers import record_pid, tensor_hash

HANDED = {"inter": 0, "intra": 0}  # by our collectives (called from demo_lightning.comm)
OTHERS = {"inter": 0, "intra": 0}  # by Lightning's own (its stop decisions, metric syncs)
FROM_OTHER_NODE = [0]  # bytes our collectives brought from ranks on the other node (see _from_other_node)


def _spans_nodes(group: Any) -> bool:
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    return len({r // per_node for r in ranks}) > 1


def _node(rank: int) -> int:
    return rank // int(os.environ["LOCAL_WORLD_SIZE"])


def _from_other_node(fn: Any, args: tuple, kwargs: dict, group: Any) -> int:
    """What this call brings from ranks on another node: an all-gather, the buffers of those ranks; an
    all-reduce over a group spanning nodes, its size (their sum has to come in once); a broadcast, its
    size if the source sits on another node."""
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    me = _node(dist.get_rank())
    if fn is _ORIGINAL["all_gather"]:
        return sum(t.numel() * t.element_size() for j, t in enumerate(args[0]) if _node(ranks[j]) != me)
    tensor = args[0]
    if fn is _ORIGINAL["all_reduce"]:
        return tensor.numel() * tensor.element_size() if any(_node(r) != me for r in ranks) else 0
    return tensor.numel() * tensor.element_size() if _node(kwargs["src"]) != me else 0


_ORIGINAL = {"all_gather": dist.all_gather, "all_reduce": dist.all_reduce, "broadcast": dist.broadcast}


def _counting(fn: Any, tensor_arg: int) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tensor = args[tensor_arg] if len(args) > tensor_arg else kwargs["tensor"]
        group = kwargs.get("group", args[tensor_arg + 1] if fn is dist.all_gather and len(args) > 2 else None)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        ours = caller.startswith("demo_lightning.comm")
        (HANDED if ours else OTHERS)["inter" if _spans_nodes(group) else "intra"] += tensor.numel() * tensor.element_size()
        if ours:
            FROM_OTHER_NODE[0] += _from_other_node(fn, args, kwargs, group)
        return fn(*args, **kwargs)

    return wrapper


dist.all_gather = _counting(dist.all_gather, 1)  # (tensor_list, tensor)
dist.all_reduce = _counting(dist.all_reduce, 0)
dist.broadcast = _counting(dist.broadcast, 0)


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.param_hashes: list[str] = []
        self.hierarchical: list[bool] = []
        self.from_other_node = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.from_other_node = -FROM_OTHER_NODE[0]  # the training steps only, not the setup broadcast

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.from_other_node += FROM_OTHER_NODE[0]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        self.param_hashes.append(tensor_hash(flat))
        self.hierarchical.append(trainer.strategy.node_groups is not None)  # destroyed at teardown


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--method", choices=["flat", "node", "desloc"], default="flat")
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--dense-below", type=int, default=4096)
    p.add_argument("--dense-vectors", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--selection", default="topk")
    p.add_argument("--value-format", default="sign")
    p.add_argument("--topk", type=int, default=64,
                   help="the same k flat and hierarchical (the default would keep 32 over 4 ranks and 64 over 2 nodes), "
                        "so the comparison of their bytes is the hierarchy's alone")
    p.add_argument("--compose", action="store_true", help="DES-LOC averaging of the residuals, AdaptiveKeepRatio, CommunicationMonitor")
    return p


def main() -> None:
    top = argparse.ArgumentParser()
    top.add_argument("--out", required=True)
    top.add_argument("--max-steps", type=int, default=6)
    top.add_argument("runs", nargs="+", help="NAME:METHOD[:FLAG[=VALUE]...], one per fit")
    cli = top.parse_args()
    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    record_pid(out)
    torch.set_num_threads(1)
    for spec in cli.runs:
        name, method, *flags = spec.split(":")
        args = _parser().parse_args(["--method", method, "--max-steps", str(cli.max_steps), *(f"--{f}" for f in flags)])
        _fit(out / name, args)


def _fit(out: Path, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for counter in (HANDED, OTHERS):
        counter.update(inter=0, intra=0)
    FROM_OTHER_NODE[0] = 0
    pl.seed_everything(0, verbose=False)
    torch.manual_seed(1 + int(os.environ["RANK"]))  # different initial weights on every rank: setup broadcasts rank 0's
    model = GPTLightningModule(block_size=32, d_model=64, n_layer=2, n_head=2, optimizer="sgd", lr=1e-2, warmup_steps=2, max_steps=100)
    data = TextDataModule(block_size=32, batch_size=8, max_bytes=40_000, max_val_bytes=2_000)
    if args.method == "desloc":
        strategy: pl.strategies.Strategy = demo_lightning.DesLocStrategy(timeout=60, param_sync_every=2)
    else:
        strategy = demo_lightning.DeMoStrategy(
            timeout=60, hierarchy=args.method, dense_below=args.dense_below, dense_vectors=args.dense_vectors, selection=args.selection, value_format=args.value_format,
            topk=args.topk,
            state_sync_every={"demo_momentum": 2} if args.compose else None,
        )
    recorder = Recorder()
    callbacks: list[pl.Callback] = [recorder]
    monitor = None
    if args.compose:
        from demo_lightning.callbacks import AdaptiveKeepRatio, CommunicationMonitor

        monitor = CommunicationMonitor(histogram_every=0, inter_gbps=10, intra_gbps=400, latency_ms=0)  # bytes only: this tiny model is latency-bound
        callbacks += [AdaptiveKeepRatio(energy=0.5, update_every=2), monitor]
    trainer = pl.Trainer(
        accelerator="cpu", num_nodes=2, devices=2, strategy=strategy, max_steps=args.max_steps, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data)
    ledger = trainer.strategy.ledger
    result = {
        "rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "param_hashes": recorder.param_hashes,
        "hierarchical": all(recorder.hierarchical),
        "groups_after_fit": trainer.strategy.node_groups is not None,
        "topology": [trainer.strategy.topology.num_nodes, trainer.strategy.topology.ranks_per_node],
        "steps": ledger.steps,
        "steps_inter_node_bytes": ledger.steps_inter_node_bytes,
        "steps_sent_bytes": ledger.steps_sent_bytes,
        "steps_ddp_inter_node_bytes": ledger.steps_ddp_inter_node_bytes,
        "payload_by_link": dict(ledger.payload_by_link),
        "handed": dict(HANDED),
        "others": dict(OTHERS),
        "from_other_node": recorder.from_other_node,
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")},
        "monitor": None if monitor is None else {"links": monitor.summary["links"], "metrics": monitor.last_metrics},
        "desloc_syncs": [dict(a.stats.syncs) for a in trainer.strategy.averagers] if hasattr(trainer.strategy, "averagers") else [],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
