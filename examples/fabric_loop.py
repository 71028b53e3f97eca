"""Your own training loop with Lightning Fabric and DeMo: the only change from DDP is ``strategy="demo"``.

    python examples/fabric_loop.py                          # 2 CPU processes, Fabric launches them
    python examples/fabric_loop.py --strategy desloc        # DES-LOC: local AdamW steps, periodic averages
    torchrun --standalone --nproc-per-node 2 examples/fabric_loop.py --checkpoint /tmp/fabric.ckpt

A small classifier on scikit-learn's bundled digits (no download), with gradient accumulation
(``fabric.no_backward_sync``), gradient clipping, traffic logged to TensorBoard with ``fabric.log_dict``
(``--log-dir``) and a
checkpoint through ``fabric.save`` / ``fabric.load`` (each rank's own momenta go to
``<checkpoint>.shards/``; run the command twice and the second run resumes). At the end every rank
prints a hash of its parameters: the replicas agree.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import demo_lightning  # noqa: F401  registers Fabric(strategy="demo") and "desloc"
from demo_lightning.data import load_digits_tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=("demo", "desloc"), default="demo")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--checkpoint", default="", help="save here at the end; resume from it if it exists")
    parser.add_argument("--log-dir", default="", help="TensorBoard logs of the loss and the traffic (default: none)")
    args = parser.parse_args()

    loggers = [TensorBoardLogger(args.log_dir, name="fabric_loop")] if args.log_dir else []
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy, loggers=loggers)
    fabric.launch()
    fabric.seed_everything(0)

    images, labels = load_digits_tensors(image_size=8, channels=1)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(images, labels), batch_size=32, shuffle=True, drop_last=True))
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    # DeMo's sign update brings the momentum: plain SGD; DES-LOC steps each worker's own AdamW
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if args.strategy == "demo" else torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)

    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.checkpoint and os.path.exists(args.checkpoint):
        fabric.load(args.checkpoint, state)
        fabric.print(f"resumed from {args.checkpoint} at step {state['step']}")

    batches = iter(())
    while state["step"] < args.max_steps:
        for micro in range(args.accumulate):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            # backward never all-reduces under these strategies: the exchange runs in optimizer.step()
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = F.cross_entropy(model(x), y)
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # this worker's own gradient, before the exchange
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        fabric.log_dict({"train/loss": loss.item(), **fabric.strategy.metrics()}, step=state["step"])

    fabric.strategy.final_sync()  # DES-LOC: end on the averaged replica (a no-op under DeMo)
    if args.checkpoint:
        fabric.save(args.checkpoint, state)
    for logger in fabric.loggers:
        logger.finalize("success")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
    ledger = fabric.strategy.ledger
    print(  # one write per line: the ranks share the terminal
        f"rank {fabric.global_rank}: params {hashlib.sha256(flat).hexdigest()[:16]}, loss {loss.item():.3f}, "
        f"{ledger.cumulative_ratio_vs_ddp:.1f}x fewer bytes than DDP over this run's {ledger.steps} steps\n",
        end="", flush=True,
    )


if __name__ == "__main__":
    main()
