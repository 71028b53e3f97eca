"""The LayerPolicy presets against the strategy's defaults and DDP, each on its own task (issue 16 item 6).

    .venv/bin/python benchmarks/presets.py                       # both tasks, 2 workers (~30-45 min on 2 shared cores)
    .venv/bin/python benchmarks/presets.py --tasks digits --digits-steps 50   # a quick look
    .venv/bin/python benchmarks/presets.py --render-only         # re-render the table from the JSON

Rows per task, 2 workers, the same seed, data and number of optimizer steps:

* ``gpt``: compare.py's job (a byte-level GPT, d_model 128, 2 layers, 16 x 128 bytes per worker per
  step, 520 steps): ``ddp`` (AdamW), ``demo-sign1bit`` (``strategy="demo"``'s defaults: top-k 64 of
  4096, 1-bit values, decay 0.99, SGD), ``preset-language`` (the same plus
  ``LayerPolicy(preset="language")``, ``small_batch`` detected: the global batch of 32 windows is
  small, so 25 % is kept) and ``preset-language-large`` (``small_batch=False``: the preset's 8 %);
  controls ``demo-keep0.25`` / ``demo-keep0.08``: the defaults with that share kept on every tensor,
  no LayerPolicy (what the bytes alone do).
* ``digits``: a timm ResNet-10t narrowed to channels (32, 64, 128, 256) (1.27 M parameters, random
  init) on scikit-learn's bundled digits at 32x32, 32 images per worker per step: ``vision-ddp``
  (AdamW), ``vision-demo`` (the strategy's defaults, SGD), ``preset-vision`` (``small_batch``
  detected: 64 images is small, 25 % / convolutions 1/3) and ``preset-vision-large`` (15 % /
  convolutions 20 %); controls ``vision-demo-keep0.2`` (20 % on every tensor, decay 0.99) and
  ``vision-demo-decay0.9`` (the default k with the preset's decay). Validation loss and accuracy
  over the whole validation split.

Every figure comes from compare.py's worker and merge (the strategy's byte ledger for bytes per
step, the validation loss after the last step, ``ratio_vs_ddp`` = DDP's ring all-reduce bytes over
ours; the digits are compare.py's ``--corpus digits`` task, accuracy included); this file only adds
the rows (a LayerPolicy on the Trainer) and launches itself as the worker. Writes
``benchmarks/results/issue16/presets/presets.json`` and ``presets.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  benchmarks/compare.py: Method, METHODS, worker, merge

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "issue16" / "presets"
DIGITS_MODEL, DIGITS_KWARGS, DIGITS_SIZE = compare.DIGITS_MODEL, compare.DIGITS_KWARGS, compare.DIGITS_SIZE
VISION_LR = 1e-3

# name -> LayerPolicy arguments (rows without an entry run without one)
POLICIES: dict[str, dict[str, Any]] = {
    "preset-language": {"preset": "language"},
    "preset-language-large": {"preset": "language", "small_batch": False},
    "preset-vision": {"preset": "vision"},
    "preset-vision-large": {"preset": "vision", "small_batch": False},
}
_DEMO = compare.METHODS["demo-sign1bit"]
compare.METHODS["preset-language"] = compare.Method(
    "strategy='demo' defaults + LayerPolicy(preset='language'), small_batch detected (32 windows: small, keep 25 %)",
    "demo", _DEMO.optimizer, _DEMO.lr, dict(_DEMO.options),
)
compare.METHODS["preset-language-large"] = compare.Method(
    "strategy='demo' defaults + LayerPolicy(preset='language', small_batch=False): keep 8 %, Q/K 12 %, FFN 6 %",
    "demo", _DEMO.optimizer, _DEMO.lr, dict(_DEMO.options),
)
# controls: the same kept share on every tensor, no LayerPolicy (does the per-kind split help beyond the bytes?)
for _keep in (0.08, 0.25):
    compare.METHODS[f"demo-keep{_keep:g}"] = compare.Method(
        f"strategy='demo' defaults with keep_ratio={_keep:g} on every tensor, no LayerPolicy", "demo", _DEMO.optimizer, _DEMO.lr,
        {**_DEMO.options, "keep_ratio": _keep},
    )
compare.METHODS["vision-ddp"] = compare.Method("Lightning DDP, AdamW", "ddp", "adamw", VISION_LR)
compare.METHODS["vision-demo"] = compare.Method("strategy='demo' defaults (top-k 64/4096, 1-bit, decay 0.99), SGD", "demo", "sgd", VISION_LR)
compare.METHODS["preset-vision"] = compare.Method(
    "strategy='demo' defaults + LayerPolicy(preset='vision'), small_batch detected (64 images: small, keep 25 %, conv 1/3)",
    "demo", "sgd", VISION_LR,
)
compare.METHODS["preset-vision-large"] = compare.Method(
    "strategy='demo' defaults + LayerPolicy(preset='vision', small_batch=False): keep 15 %, conv 20 %",
    "demo", "sgd", VISION_LR,
)
compare.METHODS["vision-demo-keep0.2"] = compare.Method(
    "strategy='demo' defaults with keep_ratio=0.2 on every tensor (the large preset's convolution share), no LayerPolicy",
    "demo", "sgd", VISION_LR, {"keep_ratio": 0.2},
)
compare.METHODS["vision-demo-decay0.9"] = compare.Method(
    "strategy='demo' defaults with decay=0.9 (the preset's beta) and the default top-k 64, no LayerPolicy", "demo", "sgd", VISION_LR,
    {"decay": 0.9},
)
TASKS = {
    "gpt": ("ddp", "demo-sign1bit", "preset-language", "preset-language-large", "demo-keep0.25", "demo-keep0.08"),
    "digits": ("vision-ddp", "vision-demo", "preset-vision", "preset-vision-large", "vision-demo-keep0.2", "vision-demo-decay0.9"),
}
_POLICY_OF = {id(compare.METHODS[name]): kwargs for name, kwargs in POLICIES.items()}
_compare_callbacks = compare._callbacks


def _install() -> None:
    """In the worker: the LayerPolicy of the row on the Trainer, beside compare.py's callbacks."""
    from demo_lightning.callbacks import LayerPolicy

    def callbacks(method: compare.Method) -> list[Any]:
        extra = [LayerPolicy(**_POLICY_OF[id(method)], print_settings=False)] if id(method) in _POLICY_OF else []
        return [*_compare_callbacks(method), *extra]

    compare._callbacks = callbacks


def _run(name: str, compare_args: list[str], workdir: Path) -> dict[str, Any]:
    """compare.run_method with this file as the worker (its rows) and the row's LayerPolicy arguments."""
    args = compare.parse_args(compare_args)
    record = compare.run_method(name, 2, args, workdir, script=Path(__file__))
    record["policy"] = POLICIES.get(name)
    record.setdefault("val_acc_curve", None)  # the GPT has no accuracy
    record.setdefault("final_val_acc", None)
    print(f"  val {record['final_val_loss']:.4f}  {compare._bytes(record['bytes_sent_per_step'])}/step  "
          f"ratio {record['ratio_vs_ddp']:.1f}x  ({record['wall_s']:.0f} s)", flush=True)
    return record


def render(meta: dict[str, Any], records: list[dict[str, Any]]) -> str:
    commands = ", then ".join(f"`{c}`" for c in meta.get("commands", [meta["command"]]))
    lines = [f"Commands: {commands} — {meta['date']}, {meta['machine']}; 2 workers, seed 0.", ""]
    for task, names in TASKS.items():
        group = [r for r in records if r["method"] in names]
        if not group:
            continue
        ddp = group[0]
        settings = meta["tasks"][task]
        early = ddp["val_curve"][1][0] if len(ddp["val_curve"]) > 1 else ddp["val_curve"][0][0]  # the second validation
        lines += [
            f"**{task}** ({settings}; DDP's final validation loss {ddp['final_val_loss']:.4f})", "",
            f"| row | LayerPolicy | val loss at step {early} | val loss | vs DDP | vs defaults | val acc | sent / step | ratio vs DDP "
            "| step time |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        default = group[1] if len(group) > 1 else None
        for r in group:
            policy = ", ".join(f"{k}={v!r}" for k, v in (r.get("policy") or {}).items()) or "—"
            rel_default = f"{r['final_val_loss'] / default['final_val_loss']:.3f}x" if default and r is not ddp else "—"
            acc = "—" if r.get("final_val_acc") is None else f"{100 * r['final_val_acc']:.1f} %"
            at = dict((int(step), loss) for step, loss in r["val_curve"]).get(early)
            lines.append(
                f"| `{r['method']}` | {policy} | {'—' if at is None else f'{at:.4f}'} | {r['final_val_loss']:.4f} | "
                f"{r['final_val_loss'] / ddp['final_val_loss']:.3f}x | "
                f"{rel_default} | {acc} | {compare._bytes(r['bytes_sent_per_step'])} | {r['ratio_vs_ddp']:,.1f}x | "
                f"{1000 * r['step_time_s']:.0f} ms |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        args = compare.parse_args(argv)
        _install()
        compare.worker(args)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="gpt,digits")
    p.add_argument("--gpt-steps", type=int, default=520)
    p.add_argument("--digits-steps", type=int, default=300)
    p.add_argument("--digits-batch-size", type=int, default=32)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--workdir", default=str(ROOT / "runs" / "presets"))
    p.add_argument("--rows", default="", help="comma-separated rows to run (default: every row of the tasks); the others are kept")
    p.add_argument("--render-only", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        saved = json.loads((out / "presets.json").read_text())
        meta, records = saved["meta"], saved["records"]
    else:
        tasks = [t for t in args.tasks.split(",") if t]
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            p.error(f"--tasks: unknown {unknown}; choose from {', '.join(TASKS)}")
        task_args = {  # compare.py's defaults for the GPT; the digits: its steps, validation every 50, warm-up 10
            "gpt": ["--steps", str(args.gpt_steps)],
            "digits": ["--corpus", compare.DIGITS, "--steps", str(args.digits_steps), "--val-every", "50", "--warmup-steps", "10",
                       "--batch-size", str(args.digits_batch_size)],
        }
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        rows = [r for r in args.rows.split(",") if r]
        records = [_run(name, task_args[task], workdir) for task in tasks for name in TASKS[task] if not rows or name in rows]
        meta = {
            "command": "python benchmarks/presets.py " + " ".join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}, shared), torch gloo on loopback",
            "tasks": {
                "gpt": f"compare.py's GPT, d_model 128, 2 layers, 16 x 128 bytes per worker, {args.gpt_steps} steps",
                "digits": f"timm {DIGITS_MODEL} channels {DIGITS_KWARGS['channels']} on digits {DIGITS_SIZE}x{DIGITS_SIZE}, "
                          f"{args.digits_batch_size} images per worker, {args.digits_steps} steps, lr {VISION_LR:g}",
            },
            "wall_s": time.perf_counter() - start,
        }
        previous = out / "presets.json"
        meta["commands"] = [meta["command"]]
        if previous.exists():  # keep the rows this invocation did not run (and the commands that ran them)
            saved = json.loads(previous.read_text())
            meta["commands"] = saved["meta"].get("commands", [saved["meta"]["command"]]) + meta["commands"]
            kept = [r for r in saved["records"] if r["method"] not in {r["method"] for r in records}]
            records = [r for task in TASKS for name in TASKS[task] for r in kept + records if r["method"] == name]
        (out / "presets.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    table = render(meta, records)
    (out / "presets.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
