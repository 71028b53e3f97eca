"""Peak memory per rank of saving a checkpoint, and the files it writes, against the number of workers W.

    .venv/bin/python benchmarks/checkpoint_memory.py                      # W = 2, 4, 8; DeMo and DES-LOC
    .venv/bin/python benchmarks/checkpoint_memory.py --against HEAD       # and REV's demo_lightning side by side
    .venv/bin/python benchmarks/checkpoint_memory.py --quick              # W = 2, a tiny model: a smoke test

For each strategy and W, one launch of W CPU processes (gloo, Lightning's own launcher) fits a small
GPT (``demo_lightning.models.GPTLightningModule``, ``--d-model`` 192, ``--n-layer`` 4, block 64:
1.84 M parameters, the main job's size) on ``demo_lightning.data.TextDataModule`` for ``--steps`` optimizer steps, saves
a throwaway checkpoint (first-time allocations), removes it, and then measures one
``trainer.save_checkpoint(path)`` on every rank:

* peak memory: the resident set's high-water mark during the call (``/proc/self/status`` VmHWM,
  reset just before it through ``/proc/self/clear_refs``) minus the resident set just before it.
  The workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed large blocks go back to the
  system and a warm heap does not hide what a save allocates;
* the files: the main checkpoint (rank 0's, Lightning's) and, in the sharded layout, each rank's
  shard ``<ckpt>.shards/rank<r>.pt``; in the gathered layout (``--against`` a revision before the
  shards) every rank's state is inside the main file.

Strategies: ``demo`` (DeMoStrategy, SGD; the per-rank state is the DeMo momenta) and ``desloc``
(DesLocStrategy, AdamW, ``param_sync_every=16``; per-rank state: the optimizer state, the replica's
parameters and the schedule). The table shows, per layout, the largest peak over ranks for rank 0
and for the other ranks, the per-rank state S (a shard's size), the main file's size, and the
model of the gathered layout: every rank holds all W entries (W x S) and rank 0's file grows by W x S.

``--against REV`` measures REV's ``demo_lightning`` (exported with ``git archive``, nothing checked
out) first on ``PYTHONPATH``; ``HEAD`` is the gathered layout while the shards are uncommitted.
Writes ``<out>/checkpoint_memory.json`` and ``.md`` (``checkpoint_memory_quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MB = 1e6
_LEAKY_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


# ------------------------------------------------------------------------------------ the worker
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set (Linux >= 4.0)


def worker(spec: dict[str, Any]) -> None:
    """One rank of one launch (Lightning's launcher re-runs this command line for the other ranks)."""
    import lightning.pytorch as pl
    import torch

    import demo_lightning
    from demo_lightning.data import TextDataModule
    from demo_lightning.models import GPTLightningModule

    torch.set_num_threads(1)
    out = Path(spec["out"])
    pl.seed_everything(0, verbose=False)
    model = GPTLightningModule(block_size=64, d_model=spec["d_model"], n_layer=spec["n_layer"], n_head=4,
                               optimizer=spec["optimizer"], lr=1e-3, warmup_steps=1, max_steps=100)
    if spec["strategy"] == "demo":
        strategy: Any = demo_lightning.DeMoStrategy(timeout=spec["timeout"])
    else:
        strategy = demo_lightning.DesLocStrategy(param_sync_every=16, timeout=spec["timeout"])
    trainer = pl.Trainer(
        accelerator="cpu", devices=spec["world"], num_nodes=1, strategy=strategy, max_steps=spec["steps"],
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=TextDataModule(block_size=64, batch_size=4, max_bytes=200_000, max_val_bytes=2_000))
    warm = out / "warm.ckpt"
    trainer.save_checkpoint(warm)
    trainer.strategy.remove_checkpoint(warm)
    path = out / "ckpt" / "bench.ckpt"
    gc.collect()
    trainer.strategy.barrier()
    before = _status_kb("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    trainer.save_checkpoint(path)  # ends with a barrier: a rank waiting there allocates nothing
    seconds = time.perf_counter() - start
    peak = _status_kb("VmHWM")
    rank = trainer.global_rank
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "rss_before_kb": before, "hwm_kb": peak, "peak_delta_mb": (peak - before) * 1024 / MB,
        "seconds": seconds, "library": str(Path(demo_lightning.__file__).resolve().parent),
        "n_params": sum(p.numel() for p in model.parameters()),
    }))


# ------------------------------------------------------------------------------------ the launches
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(spec: dict[str, Any], library: Path, timeout: float) -> list[dict[str, Any]]:
    """One launch of ``spec["world"]`` processes with ``library`` first on ``PYTHONPATH``; every rank's record."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY_ENV and not k.startswith(("PL_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MASTER_PORT=str(_free_port()),
               PYTHONPATH=os.pathsep.join([str(library), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise SystemExit(f"launch {spec} still running after {timeout} s: killed")
    if proc.returncode != 0:
        raise SystemExit(f"launch {spec} failed ({proc.returncode}):\n{output[-4000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(spec["world"])]
    if any(Path(r["library"]) != (library / "demo_lightning").resolve() for r in ranks):
        raise SystemExit(f"launch {spec} imported {ranks[0]['library']}, not {library / 'demo_lightning'}")
    return ranks


def _files(out: Path, world: int) -> dict[str, Any]:
    main = out / "ckpt" / "bench.ckpt"
    shards = [out / "ckpt" / "bench.ckpt.shards" / f"rank{r}.pt" for r in range(world)]
    sizes = [p.stat().st_size for p in shards if p.exists()]
    return {"main_bytes": main.stat().st_size, "shard_bytes": sizes, "layout": "shards" if sizes else "gathered"}


def _export(rev: str, target: Path) -> None:
    """REV's ``demo_lightning`` into ``target`` (``git archive``: no worktree, no checkout)."""
    archive = target / "rev.tar"
    made = subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), rev, "demo_lightning"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        raise SystemExit(f"--against {rev!r}: git archive failed: {made.stderr.strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")


def _label() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "demo_lightning"], cwd=ROOT, capture_output=True, text=True,
                           check=False).stdout.strip()
    return (head or "this checkout") + (" + uncommitted changes" if dirty else "")


# ------------------------------------------------------------------------------------ the table
def render(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"Saving one checkpoint: {meta['model']} ({meta['n_params'] / 1e6:.2f} M parameters), {meta['steps']} steps first; "
        f"{meta['machine']}, torch {meta['torch']}, {meta['date']}.",
        "",
        "| library | layout | strategy | W | per-rank state S (MB) | peak during save, rank 0 (MB) | peak, other ranks (max, MB) "
        "| main file (MB) | shards (MB) | gathered model: W x S (MB) | save (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        shards = row["shard_bytes"]
        state = row["state_bytes"]
        lines.append(
            f"| {row['library']} | {row['layout']} | {row['strategy']} | {row['world']} | {state / MB:.1f} | "
            f"{row['peak_rank0_mb']:.1f} | {row['peak_others_mb']:.1f} | {row['main_bytes'] / MB:.1f} | "
            f"{(f'{len(shards)} x {max(shards) / MB:.1f}' if shards else '-')} | {row['world'] * state / MB:.1f} | {row['seconds']:.2f} |"
        )
    lines += [
        "",
        "Peak: the resident set's high-water mark during `trainer.save_checkpoint` minus the resident set just before it "
        "(workers under `MALLOC_MMAP_THRESHOLD_=65536`). S: one rank's own state (its shard's size; in the gathered layout "
        "(main file - weights-only part) / W). Gathered model: what every rank holds (all W entries) and rank 0's file adds.",
    ]
    for note in meta.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="numbers of workers (default 2 4 8; 2 with --quick)")
    p.add_argument("--strategies", nargs="+", choices=["demo", "desloc"], default=["demo", "desloc"])
    p.add_argument("--d-model", type=int, default=None, help="GPT width (default 192; 64 with --quick)")
    p.add_argument("--n-layer", type=int, default=None, help="GPT blocks (default 4; 2 with --quick)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps before the saves")
    p.add_argument("--against", default=None, help="a git revision whose demo_lightning is measured side by side")
    p.add_argument("--quick", action="store_true", help="W = 2, a tiny model (a smoke test)")
    p.add_argument("--timeout", type=float, default=600.0, help="hard limit of one launch in seconds")
    p.add_argument("--out", default=str(RESULTS), help="folder for checkpoint_memory.json and .md")
    args = p.parse_args(argv)
    worlds = args.worlds or ([2] if args.quick else [2, 4, 8])
    d_model = args.d_model or (64 if args.quick else 192)
    n_layer = args.n_layer or (2 if args.quick else 4)

    import torch

    this = _label()
    meta: dict[str, Any] = {
        "command": " ".join(["python benchmarks/checkpoint_memory.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), gloo",
        "torch": torch.__version__, "model": f"GPT d_model {d_model}, {n_layer} layers, block 64", "steps": args.steps,
        "this": this, "against": args.against, "notes": [],
    }
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        libraries: list[tuple[str, Path]] = [(this, ROOT)]
        if args.against:
            (tmp / "rev").mkdir()
            _export(args.against, tmp / "rev")
            libraries.append((args.against, tmp / "rev"))
        for strategy in args.strategies:
            for world in worlds:
                for label, library in libraries:
                    out = tmp / f"{len(rows)}"
                    spec = {"out": str(out), "world": world, "strategy": strategy, "optimizer": "sgd" if strategy == "demo" else "adamw",
                            "d_model": d_model, "n_layer": n_layer, "steps": args.steps, "timeout": 120.0}
                    ranks = _launch(spec, library, args.timeout)
                    files = _files(out, world)
                    meta["n_params"] = ranks[0]["n_params"]
                    rows.append({"library": label, "strategy": strategy, "world": world, **files,
                                 "peak_rank0_mb": ranks[0]["peak_delta_mb"],
                                 "peak_others_mb": max(r["peak_delta_mb"] for r in ranks[1:]) if world > 1 else 0.0,
                                 "peak_mb": [r["peak_delta_mb"] for r in ranks], "seconds": max(r["seconds"] for r in ranks)})
                    print(f"{strategy} W={world} {label}: rank 0 +{ranks[0]['peak_delta_mb']:.1f} MB, main "
                          f"{files['main_bytes'] / MB:.1f} MB ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    # per-rank state S: a shard's size; in the gathered layout what the main file holds beyond the sharded one's
    sharded = {(r["strategy"], r["world"]): r for r in rows if r["layout"] == "shards"}
    for row in rows:
        if row["layout"] == "shards":
            row["state_bytes"] = max(row["shard_bytes"])
        else:
            twin = sharded.get((row["strategy"], row["world"]))
            row["state_bytes"] = (row["main_bytes"] - twin["main_bytes"]) / row["world"] if twin else float("nan")
    meta["seconds"] = round(time.perf_counter() - start, 1)
    result = {"meta": meta, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "checkpoint_memory_quick" if args.quick else "checkpoint_memory"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    table = render(result)
    (out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
