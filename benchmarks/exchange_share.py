"""Why the exchange's share of step time is what it is: the same DeMo run at growing batch sizes.

    .venv/bin/python benchmarks/exchange_share.py                     # batch 16, 32, 64 per worker; ~3 min on 2 cores
    .venv/bin/python benchmarks/exchange_share.py --batch-sizes 16,128 --method demo

The exchange's cost is per parameter and per optimizer step (a DCT of every tile, top-k, packing,
an all-gather, two inverse DCTs), whatever the batch; forward and backward cost per token. So the
exchange's share of a step falls as the tokens per worker per step grow. This runs
``benchmarks/compare.py``'s worker for one method at 2 workers, side by side in one invocation, once
per batch size (same seed, model and steps), and prints the exchange's milliseconds per step, the
step time and the share. Writes ``benchmarks/results/exchange_share.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _compare():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("compare_benchmark", ROOT / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="demo-sign1bit")
    p.add_argument("--batch-sizes", default="16,32,64")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    compare = _compare()
    if args.method not in compare.METHODS:
        p.error(f"--method must be one of {', '.join(compare.METHODS)}, got {args.method!r}")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for batch in sizes:
        cargs = compare.parse_args(["--steps", str(args.steps), "--val-every", str(args.steps), "--batch-size", str(batch),
                                    "--world-sizes", str(args.world_size)])
        print(f"batch {batch} per worker:", flush=True)
        record = compare.run_method(args.method, args.world_size, cargs, ROOT / "runs" / "exchange_share" / f"b{batch}")
        exchange_ms = 1000 * record["exchange_share"] * record["step_time_s"]
        rows.append({"batch_size": batch, "tokens_per_worker": batch * cargs.block_size, "step_time_s": record["step_time_s"],
                     "exchange_share": record["exchange_share"], "exchange_ms_per_step": exchange_ms,
                     "n_trainable": record["n_trainable"]})
    meta = {
        "command": "python benchmarks/exchange_share.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})", "method": args.method,
        "world_size": args.world_size, "steps": args.steps,
    }
    lines = [
        f"Command: `{meta['command'].strip()}` — {meta['date']}, {meta['machine']}; `{args.method}`, {args.world_size} workers, "
        f"{args.steps} steps, {rows[0]['n_trainable']:,}-parameter GPT.",
        "",
        "| batch per worker | tokens per worker per step | step time | exchange per step (approx.) | exchange share |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['batch_size']} | {r['tokens_per_worker']:,} | {1000 * r['step_time_s']:.0f} ms | "
                     f"{r['exchange_ms_per_step']:.0f} ms | {100 * r['exchange_share']:.1f} % |")
    lines += ["", "Exchange per step = share (summed over the run) x median step time."]
    table = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exchange_share.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "exchange_share.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
