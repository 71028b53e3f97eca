"""Write the legacy checkpoint fixtures of revision d65a308 (DeMo momenta in ``optimizer.state``).

Up to revision d65a308 each rank's DeMo momentum lived in ``optimizer.state[p]["demo_momentum"]``
(the parameter's shape, float32), and a checkpoint carried every rank's momenta under
``checkpoint["optimizer_states"][0]["demo_lightning"]["per_rank"][rank]["demo_momentum"]``, a dict
``{parameter index (optimizer order): tensor}``. This script must therefore run with THAT revision's
``demo_lightning`` first on ``PYTHONPATH`` (it checks: the imported package must sit in a git checkout
whose HEAD is d65a308 with ``demo_lightning/`` unmodified; ``--force`` skips the check)::

    git -C /work/main worktree add /tmp/legacy_d65a308 d65a308
    cd /work/main && PYTHONPATH=/tmp/legacy_d65a308 nice .venv/bin/python tests/data/make_legacy_checkpoints.py
    git -C /work/main worktree remove /tmp/legacy_d65a308

One launch of 2 processes on CPU (gloo; Lightning's default ``popen`` launcher re-runs this script
for rank 1, as in ``tests/lightning_run.py`` and ``tests/resume_run.py``) runs two fits one after
the other; each writes into ``--out`` (default: this folder):

* ``legacy_demo_d65a308.ckpt``: ``DeMoStrategy(chunk=32, topk=4, dense_below=100)``,
  ``torch.optim.SGD(lr=0.01)``, 6 optimizer steps;
* ``legacy_demo_desloc_d65a308.ckpt``: the same strategy with ``update="raw", param_sync_every=4,
  state_sync_every={"demo_momentum": 3}`` and ``torch.optim.AdamW(lr=1e-3)``, 7 optimizer steps
  (parameters synced after step 4, momenta averaged after steps 3 and 6: after the 7th step the
  ranks' momenta differ again; at step 6 they would be equal);

and next to each ``<name>.json``: the fit's settings, ``global_step``, the parameters (index in the
optimizer order, name, shape) and, per rank, for each parameter index the shape, dtype, sum and sum
of squares (float64 sums of the float32 values; exact ``repr`` in JSON) and sha256 of that rank's
saved DeMo momentum, plus the sha256 of each of that rank's parameters after the last step and of
all of them together (their bytes concatenated in the optimizer order). A sha256 is taken over
``t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()`` (see :func:`sha256_of`).

The model (:class:`LegacyNet` in :class:`LegacyModule`, 4475 parameters, plain ``torch.nn``) and
the data (:func:`rank_data`: different on every rank) are deterministic; importing this module has
no side effects and does not import ``demo_lightning``, so a test can rebuild the model with
``build_module(FITS[name]["optimizer"])`` and resume from a fixture with today's code. The
checkpoint is written at the end of the only epoch (like ``ModelCheckpoint(save_on_train_epoch_end=True)``),
so a resumed fit starts the next epoch; ``max_epochs=1`` ends the original fit there.

Parameters in the optimizer order (``chunk=32``, ``dense_below=100``):

=====  =================  ========  =====  ======================================================
index  name               shape     numel  exchange
=====  =================  ========  =====  ======================================================
0      net.encode.weight  (3, 40)   120    compressed; 40 columns pad to 64: does not tile by 32
1      net.encode.bias    (3,)      3      dense (residual zero after every step)
2      net.expand.weight  (64, 3)   192    compressed; tiles of 32 x 3, exactly
3      net.expand.bias    (64,)     64     dense (residual zero after every step)
4      net.mix.weight     (64, 64)  4096   compressed; 2 x 2 tiles of 32 x 32
=====  =================  ========  =====  ======================================================
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

REVISION = "d65a308"
HERE = Path(__file__).resolve().parent
SEED = 0
BATCH_SIZE = 8
IN_FEATURES, BOTTLENECK, WIDTH = 40, 3, 64
STRATEGY = {"chunk": 32, "topk": 4, "dense_below": 100}
FITS: dict[str, dict[str, Any]] = {
    "legacy_demo_d65a308": {
        "strategy": dict(STRATEGY),
        "optimizer": {"name": "SGD", "lr": 0.01},
        "steps": 6,
    },
    "legacy_demo_desloc_d65a308": {
        "strategy": {**STRATEGY, "update": "raw", "param_sync_every": 4, "state_sync_every": {"demo_momentum": 3}},
        "optimizer": {"name": "AdamW", "lr": 1e-3},
        "steps": 7,
    },
}


class LegacyNet(nn.Module):
    """``x (40) -> encode (3) -> tanh -> expand (64) -> tanh -> mix (64)``."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(IN_FEATURES, BOTTLENECK)
        self.expand = nn.Linear(BOTTLENECK, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(torch.tanh(self.expand(torch.tanh(self.encode(x)))))


def rank_data(rank: int, steps: int) -> TensorDataset:
    """``steps * BATCH_SIZE`` regression samples of ``rank``'s own (seed ``1000 + rank``)."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(steps * BATCH_SIZE, IN_FEATURES, generator=g)
    y = torch.randn(steps * BATCH_SIZE, WIDTH, generator=g)
    return TensorDataset(x, y)


class LegacyModule(pl.LightningModule):
    """:class:`LegacyNet` with an MSE loss; each rank reads :func:`rank_data` of its own rank (in order)."""

    def __init__(self, optimizer: dict[str, Any], steps: int = 6) -> None:
        super().__init__()
        self.optimizer_spec = dict(optimizer)
        self.steps = steps
        self.net = LegacyNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(rank_data(self.global_rank, self.steps), batch_size=BATCH_SIZE, shuffle=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        spec = dict(self.optimizer_spec)
        return getattr(torch.optim, spec.pop("name"))(self.parameters(), **spec)


def build_module(optimizer: dict[str, Any], steps: int = 6) -> LegacyModule:
    """The module exactly as the fits built it (seeded with ``SEED``)."""
    pl.seed_everything(SEED, verbose=False)
    return LegacyModule(optimizer, steps)


def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def sha256_all(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    d = t.detach().cpu().to(torch.float64)
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "sum": float(d.sum()),
        "sum_sq": float((d * d).sum()),
        "sha256": sha256_of(t),
    }


class WriteFixture(pl.Callback):
    """At the end of the (only) epoch: every rank joins ``save_checkpoint`` (rank 0 writes) and
    gathers what it holds live, for :func:`describe` to check the written file against."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.live: list[dict[str, Any]] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opt = trainer.optimizers[0]
        trainer.save_checkpoint(self.path)
        (exchange,) = trainer.strategy.exchanges
        params = [p for g in opt.param_groups for p in g["params"]]
        mine = {
            "rank": trainer.global_rank,
            "global_step": trainer.global_step,
            "momentum": {i: sha256_of(t) for i, t in exchange.local_state().items()},
            "params": [sha256_of(p) for p in params],
            "params_all": sha256_all(params),
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        self.live = gathered


def describe(name: str, path: Path, live: list[dict[str, Any]], module: LegacyModule) -> dict[str, Any]:
    """Load the written checkpoint (tensors and primitives only), check it against the live values
    every rank reported, and return the fixture's JSON record."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    (state,) = ckpt["optimizer_states"]
    extra = state["demo_lightning"]
    names = [n for n, _ in module.named_parameters()]
    shapes = [list(p.shape) for p in module.parameters()]
    assert extra["world_size"] == len(live) == 2, extra["world_size"]
    assert ckpt["global_step"] == FITS[name]["steps"] == live[0]["global_step"], ckpt["global_step"]
    assert all("demo_momentum" not in s for s in state["state"].values()), "momenta left in the shared optimizer state"
    ranks = []
    for rank, entry in enumerate(extra["per_rank"]):
        momenta = entry["demo_momentum"]
        assert sorted(momenta) == list(range(len(names))), sorted(momenta)
        for i, t in momenta.items():
            assert list(t.shape) == shapes[i] and t.dtype == torch.float32, (rank, i, t.shape, t.dtype)
            assert sha256_of(t) == live[rank]["momentum"][i], (rank, i)
        record: dict[str, Any] = {
            "rank": rank,
            "demo_momentum": {str(i): tensor_stats(momenta[i]) for i in sorted(momenta)},
            "param_sha256": live[rank]["params"],
            "params_sha256": live[rank]["params_all"],
            "per_rank_keys": sorted(entry),
        }
        if "params" in entry:  # DES-LOC: each rank's own replica, also in the checkpoint
            assert [sha256_of(p) for p in entry["params"]] == live[rank]["params"], rank
            record["desloc"] = entry["desloc"]
        ranks.append(record)
    # rank 0's weights are the checkpoint's state_dict
    assert [sha256_of(ckpt["state_dict"][n]) for n in names] == live[0]["params"]
    # compressed tensors: the momenta differ between the ranks (different data), else the fixture
    # tests nothing; dense ones (fewer than dense_below elements): all of it was sent, residual zero
    dense = [i for i, s in enumerate(shapes) if torch.Size(s).numel() < FITS[name]["strategy"]["dense_below"]]
    differ = [i for i in range(len(names)) if ranks[0]["demo_momentum"][str(i)]["sha256"] != ranks[1]["demo_momentum"][str(i)]["sha256"]]
    assert differ == [i for i in range(len(names)) if i not in dense], (differ, dense)
    assert all(r["demo_momentum"][str(i)]["sum_sq"] == 0.0 for r in ranks for i in dense), "dense residuals not zero"
    return {
        "revision": REVISION,
        "checkpoint": path.name,
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "world_size": extra["world_size"],
        "global_step": ckpt["global_step"],
        "skipped_steps": extra["skipped_steps"],
        "strategy": FITS[name]["strategy"],
        "optimizer": FITS[name]["optimizer"],
        "steps": FITS[name]["steps"],
        "seed": SEED,
        "parameters": [{"index": i, "name": n, "shape": s, "dense": i in dense} for i, (n, s) in enumerate(zip(names, shapes))],
        "per_rank": ranks,
    }


def check_revision(force: bool) -> None:
    import demo_lightning

    package = Path(demo_lightning.__file__).resolve().parent
    print(f"demo_lightning from {package}", flush=True)
    if force:
        return
    git = ["git", "-C", str(package)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "."], capture_output=True, text=True).stdout.strip()
    if not head.startswith(REVISION) or dirty:
        sys.exit(
            f"demo_lightning comes from {package} at revision {head or '?'}{' (modified)' if dirty else ''}, not {REVISION}: "
            f"put a checkout of {REVISION} first on PYTHONPATH (see this script's docstring), or pass --force"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE), help="folder the fixtures are written to (default: this script's)")
    p.add_argument("--only", choices=sorted(FITS), action="append", help="write only this fixture (repeatable)")
    p.add_argument("--force", action="store_true", help="skip the check that demo_lightning is revision d65a308")
    args = p.parse_args()
    check_revision(args.force)
    import demo_lightning

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or FITS:
        spec = FITS[name]
        module = build_module(spec["optimizer"], spec["steps"])
        writer = WriteFixture(out / f"{name}.ckpt")
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, num_nodes=1, strategy=demo_lightning.DeMoStrategy(timeout=60.0, **spec["strategy"]),
            max_epochs=1, limit_train_batches=spec["steps"], limit_val_batches=0, num_sanity_val_steps=0,
            use_distributed_sampler=False, enable_checkpointing=False, callbacks=[writer], logger=False,
            enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        )
        trainer.fit(module)
        if trainer.global_rank == 0:
            record = describe(name, writer.path, writer.live, module)
            (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {writer.path} ({writer.path.stat().st_size} bytes) and {name}.json", flush=True)


if __name__ == "__main__":
    main()
