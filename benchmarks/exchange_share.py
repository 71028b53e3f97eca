"""Why the exchange's share of step time is what it is: the same DeMo run at growing batch sizes.

    .venv/bin/python benchmarks/exchange_share.py                     # batch 16, 32, 64 per worker; ~3 min on 2 cores
    .venv/bin/python benchmarks/exchange_share.py --batch-sizes 16,128 --method demo
    .venv/bin/python benchmarks/exchange_share.py --batch-sizes 16 --against 2d48cb0 --rounds 2   # A/B, ~3 min

The exchange's cost is per parameter and per optimizer step (a DCT of every tile, top-k, packing,
an all-gather, two inverse DCTs), whatever the batch; forward and backward cost per token. So the
exchange's share of a step falls as the tokens per worker per step grow. This runs
``benchmarks/compare.py``'s worker for one method at 2 workers, side by side in one invocation, once
per batch size (same seed, model and steps), and prints the exchange's milliseconds per step, the
step time and the share. Writes ``benchmarks/results/exchange_share.json`` and ``.md``.

``--against REV`` measures a git revision's ``demo_lightning`` side by side with this checkout's:
REV is checked out into a temporary worktree and the same workers run with it first on
``PYTHONPATH``, alternating with this checkout for ``--rounds`` rounds, so both see the same
machine load; the table gives each one's median over the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _compare():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("compare_benchmark", ROOT / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _checkout_label() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "demo_lightning"], cwd=ROOT, capture_output=True, text=True,
                           check=False).stdout.strip()
    return (head or "this checkout") + (" + uncommitted changes" if dirty else "")


def _measure(compare: Any, args: argparse.Namespace, batch: int, library: Path | None, workdir: Path) -> dict[str, Any]:
    """One run of ``args.method`` at ``batch`` per worker, with ``library`` (a checkout root) first on the path."""
    saved = os.environ.get("PYTHONPATH")
    if library is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(library), saved or ""])
    try:
        cargs = compare.parse_args(["--steps", str(args.steps), "--val-every", str(args.steps), "--batch-size", str(batch),
                                    "--world-sizes", str(args.world_size)])
        record = compare.run_method(args.method, args.world_size, cargs, workdir)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return {"batch_size": batch, "tokens_per_worker": batch * cargs.block_size, "step_time_s": record["step_time_s"],
            "exchange_share": record["exchange_share"], "exchange_ms_per_step": 1000 * record["exchange_share"] * record["step_time_s"],
            "n_trainable": record["n_trainable"], "library_path": record["library"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="demo-sign1bit")
    p.add_argument("--batch-sizes", default="16,32,64")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--against", default=None, help="a git revision whose demo_lightning is measured side by side")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds with --against (medians are reported)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    compare = _compare()
    if args.method not in compare.METHODS:
        p.error(f"--method must be one of {', '.join(compare.METHODS)}, got {args.method!r}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    this = _checkout_label()
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        libraries: list[tuple[str, Path | None]] = [(this, None)]
        if args.against:
            rev_root = Path(tmp) / "rev"
            made = subprocess.run(["git", "worktree", "add", "--detach", str(rev_root), args.against], cwd=ROOT,
                                  capture_output=True, text=True, check=False)
            if made.returncode != 0:
                p.error(f"--against {args.against!r}: git worktree add failed: {made.stderr.strip()}")
            libraries.insert(0, (args.against, rev_root))
        try:
            for _ in range(args.rounds if args.against else 1):
                for label, library in libraries:
                    for batch in sizes:
                        print(f"{label}, batch {batch} per worker:", flush=True)
                        row = _measure(compare, args, batch, library, ROOT / "runs" / "exchange_share" / f"b{batch}")
                        runs.setdefault(label, {}).setdefault(batch, []).append(row)
        finally:
            if args.against:
                subprocess.run(["git", "worktree", "remove", "--force", str(Path(tmp) / "rev")], cwd=ROOT, capture_output=True,
                               check=False)
    rows = []
    for label, by_batch in runs.items():
        for batch, measured in by_batch.items():
            row = {key: statistics.median(m[key] for m in measured) for key in ("step_time_s", "exchange_share", "exchange_ms_per_step")}
            rows.append({"library": label, "batch_size": batch, "tokens_per_worker": measured[0]["tokens_per_worker"],
                         "n_trainable": measured[0]["n_trainable"], "rounds": len(measured),
                         "library_paths": sorted({m["library_path"] for m in measured}), **row})
    meta = {
        "command": "python benchmarks/exchange_share.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})", "method": args.method,
        "world_size": args.world_size, "steps": args.steps, "against": args.against, "rounds": args.rounds if args.against else 1,
    }
    lines = [
        f"Command: `{meta['command'].strip()}` — {meta['date']}, {meta['machine']}; `{args.method}`, {args.world_size} workers, "
        f"{args.steps} steps, {rows[0]['n_trainable']:,}-parameter GPT"
        + (f"; {meta['rounds']} alternating rounds, medians." if args.against else "."),
        "",
        "| library | batch per worker | tokens per worker per step | step time | exchange per step (approx.) | exchange share |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['library']} | {r['batch_size']} | {r['tokens_per_worker']:,} | {1000 * r['step_time_s']:.0f} ms | "
                     f"{r['exchange_ms_per_step']:.0f} ms | {100 * r['exchange_share']:.1f} % |")
    lines += ["", "Exchange per step = share (summed over the run) x median step time."]
    table = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "exchange_share_ab" if args.against else "exchange_share"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))
    (out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
