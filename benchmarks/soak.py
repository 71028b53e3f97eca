"""Soak: thousands of optimizer steps on 4 workers with periodic checkpoints; replicas and memory checked.

    .venv/bin/python benchmarks/soak.py                      # 2,000 steps, 4 workers, DeMo + DES-LOC schedule
    .venv/bin/python benchmarks/soak.py --strategy desloc    # DES-LOC (AdamW)
    .venv/bin/python benchmarks/soak.py --update-readme      # also rewrite the README's soak table

A tiny GPT (the main job's model, scaled down so 4 processes fit 2 CPU cores) trains on the standard
library's sources with ``ModelCheckpoint`` every ``--ckpt-every`` steps (each one gathers every
rank's own state). Every rank records, after every optimizer step, a hash of its parameters and
its resident memory (``/proc/self/statm``). Afterwards the records are compared:

* replicas: under ``demo`` (and ``combo``: DeMo with DES-LOC averaging of the residuals and a
  parameter re-sync) the parameter hashes of all ranks must be equal after EVERY step; under
  ``desloc`` after every parameter sync (and they must differ between, or nothing was tested);
* memory: resident memory per rank, mean over 10 % of the steps right after the first checkpoint
  (whose gather buffers are a one-time allocation) against the last 10 %, must not grow by more
  than ``--max-growth-mb``; the fitted slope (MB per 1,000 steps) is reported too.

Writes ``benchmarks/results/soak_<strategy>.json`` and exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

from readme_section import replace_section

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def strategy_for(name: str, timeout: float) -> Any:
    import demo_lightning

    if name == "demo":
        return demo_lightning.DeMoStrategy(timeout=timeout)
    if name == "combo":
        return demo_lightning.DeMoStrategy(param_sync_every=100, state_sync_every={"demo_momentum": 50}, timeout=timeout)
    if name == "desloc":
        return demo_lightning.DesLocStrategy(param_sync_every=32, timeout=timeout)
    raise ValueError(f"--strategy must be demo, combo or desloc, got {name!r}")


def train(args: argparse.Namespace, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from demo_lightning.data import TextDataModule
    from demo_lightning.models import GPTLightningModule

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[tuple[int, str, float, bool]] = []
            self.param_syncs = 0

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
            flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
            digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
            averagers = trainer.strategy.averagers
            syncs = averagers[0].stats.syncs.get("params", 0) if averagers else 0
            self.rows.append((trainer.global_step, digest, rss_mb(), syncs > self.param_syncs))
            self.param_syncs = syncs

    torch.set_num_threads(1)
    pl.seed_everything(0)
    recorder = Recorder()
    optimizer = "adamw" if args.strategy == "desloc" else "sgd"
    model = GPTLightningModule(block_size=64, d_model=64, n_layer=2, n_head=2, optimizer=optimizer, lr=1e-3, max_steps=args.steps)
    data = TextDataModule(block_size=64, batch_size=8, max_bytes=4_000_000)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.workers, strategy=strategy_for(args.strategy, args.timeout), max_steps=args.steps,
        callbacks=[recorder, ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=args.ckpt_every, save_last=True, save_top_k=1)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(model, data)
    rank = trainer.global_rank
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rows": recorder.rows, "seconds": time.perf_counter() - start,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "checkpoints": sorted(p.name for p in (out / "ckpt").glob("*.ckpt")) if rank == 0 else [],
    }))


def analyse(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    deadline = time.time() + 600
    files = [out / f"rank{r}.json" for r in range(args.workers)]
    while not all(f.exists() for f in files):  # the other ranks finish writing after rank 0's fit returns
        if time.time() > deadline:
            raise TimeoutError(f"rank files missing after 600 s: {[str(f) for f in files if not f.exists()]}")
        time.sleep(1)
    time.sleep(1)
    ranks = [json.loads(f.read_text()) for f in files]
    rows = [r["rows"] for r in ranks]
    steps = len(rows[0])
    assert all(len(r) == steps for r in rows), "ranks recorded different numbers of steps"
    equal_at = [i for i in range(steps) if len({r[i][1] for r in rows}) == 1]
    if args.strategy == "desloc":
        syncs = [i for i in range(steps) if rows[0][i][3]]
        must_equal, between = syncs, [i for i in range(steps) if i not in set(syncs)]
    else:
        must_equal, between = list(range(steps)), []
    replicas_ok = set(must_equal) <= set(equal_at)
    differed_between = sum(1 for i in between if i not in set(equal_at))
    # steady state starts after the first checkpoint (its gather buffers are a one-time allocation)
    warm = min(steps // 2, args.ckpt_every + 50)
    window = max(1, steps // 10)
    growth, slopes = [], []
    for r in rows:
        early = [row[2] for row in r[warm : warm + window]]
        late = [row[2] for row in r[-window:]]
        growth.append(sum(late) / len(late) - sum(early) / len(early))
        xs, ys = list(range(warm, steps)), [row[2] for row in r[warm:]]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
        slopes.append(slope * 1000)
    memory_ok = max(growth) <= args.max_growth_mb
    return {
        "strategy": args.strategy, "workers": args.workers, "optimizer_steps": steps, "checkpoint_every": args.ckpt_every,
        "checkpoints_written": ranks[0]["checkpoints"],
        "replica_checks": len(must_equal), "replica_checks_equal": len(set(must_equal) & set(equal_at)),
        "steps_differing_between_syncs": differed_between, "replicas_ok": replicas_ok,
        "rss_growth_mb_per_rank": [round(g, 2) for g in growth], "rss_slope_mb_per_1000_steps": [round(x, 2) for x in slopes],
        "steady_state_from_step": warm, "rss_start_mb": [round(r[0][2], 1) for r in rows],
        "rss_first_mb": [round(r[warm][2], 1) for r in rows],
        "rss_last_mb": [round(r[-1][2], 1) for r in rows], "memory_ok": memory_ok,
        "max_growth_mb_allowed": args.max_growth_mb, "seconds": round(ranks[0]["seconds"], 1),
        "date": datetime.date.today().isoformat(), "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
        "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
    }


def render(result: dict[str, Any]) -> str:
    r = result
    return (
        f"| {r['strategy']} | {r['workers']} | {r['optimizer_steps']:,} | every {r['checkpoint_every']} steps | "
        f"{r['replica_checks_equal']}/{r['replica_checks']} | "
        f"{'-' if r['strategy'] != 'desloc' else r['steps_differing_between_syncs']} | "
        f"{min(r['rss_growth_mb_per_rank']):+.1f} .. {max(r['rss_growth_mb_per_rank']):+.1f} "
        f"({min(r['rss_slope_mb_per_1000_steps']):+.1f} .. {max(r['rss_slope_mb_per_1000_steps']):+.1f} per 1,000 steps) | "
        f"{r['seconds']:.0f} s |"
    )


def update_readme(rows: list[str]) -> None:
    header = (
        "| strategy | workers | steps | checkpoint | replicas equal where required | steps differing between syncs "
        "| resident memory growth per rank after the first checkpoint (MB; fitted slope) | wall |\n|---|---|---|---|---|---|---|---|"
    )
    replace_section("soak", header + "\n" + "\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="combo", choices=["demo", "combo", "desloc"])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ckpt-every", type=int, default=250)
    parser.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    parser.add_argument("--max-growth-mb", type=float, default=20.0)
    parser.add_argument("--out", default=None, help="working folder (default: benchmarks/results/soak_<strategy>_run)")
    parser.add_argument("--update-readme", action="store_true", help="rewrite the README table from every soak_*.json")
    parser.add_argument("--analyse-only", action="store_true", help="re-analyse the rank files of a finished run")
    args = parser.parse_args()
    out = Path(args.out or RESULTS / f"soak_{args.strategy}_run")
    if os.environ.get("LOCAL_RANK", "0") == "0" and not os.environ.get("DEMO_SOAK_CHILD") and not args.analyse_only:
        out.mkdir(parents=True, exist_ok=True)
        for f in out.glob("rank*.json"):
            f.unlink()
    os.environ["DEMO_SOAK_CHILD"] = "1"  # inherited by the ranks Lightning launches
    if not args.analyse_only:
        train(args, out)
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    result = analyse(args, out)
    previous = RESULTS / f"soak_{args.strategy}.json"
    if args.analyse_only and previous.exists():  # keep the command that produced the rank files
        result["command"] = json.loads(previous.read_text())["command"]
        result["date"] = json.loads(previous.read_text())["date"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"soak_{args.strategy}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if args.update_readme:
        update_readme([render(json.loads(p.read_text())) for p in sorted(RESULTS.glob("soak_*.json"))])
    if not (result["replicas_ok"] and result["memory_ok"]):
        raise SystemExit("soak check failed: see the JSON above")


if __name__ == "__main__":
    main()
