"""Loss parity beyond one corpus: a learning-rate sweep per method on a tuning corpus, then every
method at its best rate on the other corpora, model sizes, seeds and world sizes.

    .venv/bin/python benchmarks/parity.py sweep                      # tuning corpus (stdlib), small GPT, 2 workers
    .venv/bin/python benchmarks/parity.py sweep --seeds 1,2 --lrs 1e-3,2e-3  # more seeds: each rate's mean decides
    .venv/bin/python benchmarks/parity.py run --corpora prose,cpp    # at each method's best rate from the sweep
    .venv/bin/python benchmarks/parity.py run --corpora prose,cpp --sizes small,medium --seeds 0,1,2 --world-sizes 2,4
    .venv/bin/python benchmarks/parity.py sweep --warmup-steps 80 --out benchmarks/results/parity/warmup80  # another warm-up
    .venv/bin/python benchmarks/parity.py sweep --gradient-clip-val 1 --out benchmarks/results/parity/clip  # clipped, every method
    .venv/bin/python benchmarks/parity.py render                     # tables from what has run so far
    .venv/bin/python benchmarks/parity.py render --rates ddp=0.002,demo-default=0.002 --table at-2e-3.md  # at other rates
    .venv/bin/python benchmarks/parity.py corpora                    # the corpora's sizes and digests here
    .venv/bin/python benchmarks/parity.py curves benchmarks/results/parity/cells/prose_medium_*   # training-loss windows

Every cell is one ``benchmarks/compare.py`` invocation (one method, one world size), written to
``<out>/cells/<corpus>_<size>_s<seed>_w<W>_<method>_lr<lr>/latest.json``; a cell that exists is not
run again, so a long matrix can be run in pieces (and resumed) and every figure traces back to the
``compare.py`` command stored beside it. Methods (compare.py's rows): ``ddp`` (DDP + AdamW),
``demo-default`` (``Trainer(strategy="demo")``'s defaults at this revision, SGD), ``desloc`` (DES-LOC,
AdamW, K_x 256, moments 768 / 1536: about 260x fewer bytes than DDP over 520 steps, 171x in the long run).
``demo-sign1bit`` is the default before issue 18 (no early phase, norms in fp32): its cells stay as
what the default was measured at then.

Sizes (the bundled GPT, byte-level, 128-byte windows, 16 per worker per step):
``small`` d_model 128, 2 layers (443,648 parameters); ``medium`` d_model 192, 4 layers (1.8 M);
``large`` d_model 256, 8 layers (6.4 M). The corpus ``digits`` is the vision task instead
(compare.py ``--corpus digits``: a timm ResNet-10t narrowed to channels 32-256, 1.27 M parameters,
on scikit-learn's digits at 32x32, 32 images per worker per step); its one size is ``resnet10t``,
whatever ``--sizes`` says.

The sweep: every method at each of ``--lrs`` (the same grid for all, warm-up 20 steps as in
compare.py unless ``--warmup-steps`` says otherwise: one warm-up per ``--out`` folder, checked
against each stored cell's) on the tuning corpus, at each of ``--seeds``; the best rate of a method is the one with
the lowest final validation loss there, the mean over the seeds (a rate run at fewer of the method's
seeds than the others is listed but not chosen). A sweep adds its cells to those of an earlier one in
the same folder (same corpus, size, world size, length and clipping), so seeds and rates can be added later.
``--gradient-clip-val`` clips every method's gradients (compare.py's flag; under DeMo each worker's own
gradient before its momentum): its cells end in ``_clip<value>``, and a folder holds one clipping.
``render`` writes ``<out>/sweep.md`` (the sweep, every rate) and ``<out>/latest.md``: per corpus,
size and world size, each method's validation loss over the seeds (mean and min-max), its ratio to
DDP's at the same seed (mean and min-max), its bytes ratio to DDP, and the geometric mean of the loss ratio over every cell, with the issue's targets
(``demo-default`` <= 1.05x at >= 100x fewer bytes, ``desloc`` <= 1.05x at >= 170x): "met" when
every seed's ratio is within the limit, "met on the mean" when only the mean is, else "missed". A
ratio whose min-max spans 1.0 is no difference from DDP. Cells at other rates than a method's
chosen one (the sweep's other rates, ablations) are listed below the table.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "parity"
SIZES = {"small": (128, 2), "medium": (192, 4), "large": (256, 8)}
DIGITS, DIGITS_SIZE, DIGITS_BATCH = "digits", "resnet10t", 32  # the vision task: its model, images per worker per step
DEFAULT = "demo-default"  # compare.py's row for strategy="demo" with its defaults at this revision
METHODS = ("ddp", DEFAULT, "desloc")
TARGETS = {DEFAULT: (1.05, 100.0), "desloc": (1.05, 170.0)}
DEFAULT_WARMUP = 20  # compare.py's --warmup-steps


def cell_name(corpus: str, size: str, seed: int, world: int, method: str, lr: float, steps: int = 520,
              options: tuple[str, ...] = (), clip: float | None = None) -> str:
    """The cell's folder name; ``options`` (compare.py ``--option KEY=VALUE``) add ``+KEY-VALUE`` to the method,
    gradient clipping (compare.py ``--gradient-clip-val``) ``_clip<value>`` at the end."""
    safe = corpus.replace("/", "_").replace(".", "_") if corpus not in ("stdlib", "prose", "cpp") else corpus
    tag = "".join(f"+{o.replace('=', '-')}" for o in options)
    clipped = f"_clip{clip:g}" if clip is not None else ""
    return f"{safe}_{size}_s{seed}_w{world}_{method}{tag}_lr{lr:g}_t{steps}{clipped}"


def label_of(method: str, options: tuple[str, ...] | list[str] = ()) -> str:
    """A row's name: the method, with its ``--option`` settings in brackets (``demo-default[decay=0.999]``)."""
    return f"{method}[{','.join(options)}]" if options else method


def default_settings(options: tuple[str, ...] | list[str]) -> bool:
    """Whether every ``KEY=VALUE`` equals DeMoConfig's / CodecConfig's default for it, so a row run with
    them runs what ``strategy="demo"`` runs (an explicit ``decay=0.999`` once 0.999 is the default)."""
    from dataclasses import MISSING, fields

    from demo_lightning.algorithms import CodecConfig, DeMoConfig

    defaults = {f.name: f.default for cls in (DeMoConfig, CodecConfig) for f in fields(cls) if f.default is not MISSING}
    from compare import parse_options  # the sibling that runs the cells: one reading of KEY=VALUE

    return all(key in defaults and defaults[key] == value for key, value in parse_options(options).items())


def _in_repo(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (commands in stored records stay portable)."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)


def stored_warmup(meta: dict[str, Any]) -> int:
    """The warm-up a stored cell ran with: its record's, or for a cell written before compare.py recorded
    it, the ``--warmup-steps`` of its command (compare.py's default, 20, when the command names none)."""
    if meta.get("warmup_steps") is not None:
        return int(meta["warmup_steps"])
    found = re.search(r"--warmup-steps[ =](\d+)", meta.get("command", ""))
    return int(found.group(1)) if found else DEFAULT_WARMUP


def run_cell(out: Path, corpus: str, size: str, seed: int, world: int, method: str, lr: float, steps: int,
             options: tuple[str, ...] = (), warmup: int = DEFAULT_WARMUP, clip: float | None = None) -> dict[str, Any]:
    """One compare.py run (or its stored result); ``options`` are compare.py's ``--option`` settings
    (DDP takes none: its cell is the same with or without them); ``warmup`` the learning-rate warm-up's
    steps, passed on only when it is not compare.py's default, so the stored commands of earlier cells
    stay what they were. A folder holds one warm-up: a stored cell made with another is an error, not a
    result (the cell's name does not carry it; give such runs their own ``--out``). ``clip``: every
    method's gradient clipping (compare.py ``--gradient-clip-val``, passed on only when given; the
    cell's name ends in ``_clip<value>``; :func:`check_clipping` keeps a folder to one clipping)."""
    options = () if method == "ddp" else tuple(options)
    folder = out / "cells" / cell_name(corpus, size, seed, world, method, lr, steps, options, clip)
    done = folder / "latest.json"
    if done.exists():
        meta = json.loads(done.read_text())["meta"]
        ran = stored_warmup(meta)
        if ran != warmup:
            raise SystemExit(f"{folder} ran with --warmup-steps {ran}, not {warmup}: give runs at another warm-up "
                             f"their own --out folder")
        if method == "demo-default" and clip is None and meta.get("demo_clip_grad_norm_default") is None:
            raise SystemExit(f"{folder} ran strategy=\"demo\"'s defaults from before they clipped each worker's gradient "
                             f"(clip_grad_norm); today's default is another run: give it its own --out folder, or "
                             f"--gradient-clip-val, under which both revisions run the same exchange")
    else:
        model = ["--batch-size", str(DIGITS_BATCH)] if corpus == DIGITS else ["--d-model", str(SIZES[size][0]), "--n-layer", str(SIZES[size][1])]
        # paths relative to the repository (the command runs there): the cell's record names a command anyone can rerun
        cmd = [sys.executable, "benchmarks/compare.py", "--methods", method, "--world-sizes", str(world),
               "--corpus", corpus, "--seed", str(seed), *model, "--lr", f"{lr:g}",
               "--steps", str(steps), "--val-every", str(steps), "--out", _in_repo(folder), "--workdir", "runs/parity",
               "--no-plots", *(x for o in options for x in ("--option", o)),
               *(("--warmup-steps", str(warmup)) if warmup != DEFAULT_WARMUP else ()),
               *(("--gradient-clip-val", f"{clip:g}") if clip is not None else ())]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    record = json.loads(done.read_text())["records"][0]
    return {"corpus": corpus, "size": size, "seed": seed, "world": world, "method": method, "lr": lr,
            "loss": record["final_val_loss"], "bytes": record["bytes_sent_per_step"], "ddp_bytes": record["ddp_bytes_per_step"],
            "steady_ratio": record.get("steady_ratio_vs_ddp") or record["ratio_vs_ddp"], "n_trainable": record["n_trainable"]}


def _sweep_losses(sweep: dict[str, Any]) -> dict[str, dict[float, dict[int, float]]]:
    """The sweep's final validation losses as method -> rate -> seed -> loss (a sweep.json written before
    sweeps took several seeds names its one seed at the top, not in its cells)."""
    losses: dict[str, dict[float, dict[int, float]]] = {}
    for r in sweep["cells"]:
        seed = int(r.get("seed", sweep.get("seed", 0)))
        losses.setdefault(r["method"], {}).setdefault(float(r["lr"]), {})[seed] = float(r["loss"])
    return losses


def _eligible(by_rate: dict[float, dict[int, float]]) -> dict[float, float]:
    """Each rate's mean loss over the method's seeds, for the rates that ran at every one of them (a rate
    tried at fewer seeds is listed in sweep.md but cannot be chosen: its mean is not comparable)."""
    seeds = set().union(*(set(by_seed) for by_seed in by_rate.values()))
    return {lr: statistics.fmean(by_seed.values()) for lr, by_seed in by_rate.items() if set(by_seed) == seeds}


def best_rates(out: Path) -> dict[str, float]:
    """Each method's rate with the lowest mean sweep loss over the sweep's seeds (``<out>/sweep.json``)."""
    path = out / "sweep.json"
    if not path.exists():
        raise SystemExit(f"no sweep results at {path}: run `benchmarks/parity.py sweep` first, or give --lr METHOD=RATE,...")
    best: dict[str, float] = {}
    for method, by_rate in _sweep_losses(json.loads(path.read_text())).items():
        means = _eligible(by_rate)
        if not means:
            raise SystemExit(f"sweep: no rate of {method} ran at all of its seeds; run `parity.py sweep --methods {method} "
                             f"--seeds ...` with every seed at the same rates")
        best[method] = min(means, key=lambda lr: means[lr])
    return best


def check_clipping(out: Path, clip: float | None) -> None:
    """Refuse, before anything trains, to add cells of one gradient clipping to a folder that holds another's:
    a folder's tables compare runs that trained alike (as with its one warm-up)."""
    if not (out / "cells").is_dir():
        return
    found = {c["clip"] for c in _cells(out)} - {clip}
    if found:
        raise SystemExit(f"{out} holds cells run with --gradient-clip-val {sorted(map(str, found))}, not {clip}: "
                         f"give each clipping its own --out folder")


def sweep(args: argparse.Namespace) -> None:
    """Every method at every rate and seed; the cells join those of an earlier sweep in the same folder on the
    same corpus, size, world size, length and clipping (a later sweep can add seeds or rates without re-running)."""
    out = Path(args.out)
    seeds = [int(x) for x in args.seeds.split(",")]
    clip = args.gradient_clip_val
    check_clipping(out, clip)
    cells = [run_cell(out, args.corpus, args.size, seed, args.world, m, lr, args.steps, warmup=args.warmup_steps, clip=clip)
             for m in args.methods.split(",") for lr in (float(x) for x in args.lrs.split(",")) for seed in seeds]
    setting = {"corpus": args.corpus, "size": args.size, "world": args.world, "steps": args.steps}
    path = out / "sweep.json"
    if path.exists():
        earlier = json.loads(path.read_text())
        # a clipped sweep.json names its clipping, an unclipped one has no such key: neither joins the other
        if all(earlier.get(k) == v for k, v in setting.items()) and earlier.get("gradient_clip_val") == clip:
            new = {(c["method"], c["lr"], c["seed"]) for c in cells}
            kept = [{**c, "seed": int(c.get("seed", earlier.get("seed", 0)))} for c in earlier["cells"]]
            cells = [c for c in kept if (c["method"], c["lr"], c["seed"]) not in new] + cells
    every_seed = sorted({c["seed"] for c in cells})
    clipping = {"gradient_clip_val": clip} if clip is not None else {}
    path.write_text(json.dumps({**setting, **clipping, "seeds": every_seed, "cells": cells}, indent=1))
    render(args)


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    given = dict((k, float(v)) for k, v in (x.split("=") for x in args.lr.split(","))) if args.lr else {}
    kept = json.loads((out / "rates.json").read_text()) if (out / "rates.json").exists() else {}
    # the sweep's best, then rates given to earlier runs (rates.json, enough without a sweep), then these: given rates win
    swept = best_rates(out) if (out / "sweep.json").exists() or not (given or kept) else {}
    rates = {**swept, **kept, **given}
    methods = args.methods.split(",")
    check_clipping(out, args.gradient_clip_val)
    missing = [m for m in methods if m not in rates]
    if missing:
        raise SystemExit(f"no learning rate for {missing}: sweep them, or give --lr {missing[0]}=RATE")
    if not args.ablation:  # an ablation's rates run, but the chosen ones (what render reports) stay
        # what render reports: the rates chosen before (the sweep's best where none were), and those of the methods
        # this run trains; a method merely swept does not join a chosen set by another method's run
        chosen = {**(kept or swept), **{m: rates[m] for m in methods}}
        out.mkdir(parents=True, exist_ok=True)
        (out / "rates.json").write_text(json.dumps(chosen))
    for corpus in args.corpora.split(","):
        for size in ([DIGITS_SIZE] if corpus == DIGITS else args.sizes.split(",")):
            for world in (int(w) for w in args.world_sizes.split(",")):
                for seed in (int(s) for s in args.seeds.split(",")):
                    for m in methods:
                        run_cell(out, corpus, size, seed, world, m, rates[m], args.steps, tuple(args.option or ()),
                                 args.warmup_steps, args.gradient_clip_val)
    render(args)


def _cells(out: Path) -> list[dict[str, Any]]:
    found = []
    for done in sorted((out / "cells").glob("*/latest.json")):
        saved = json.loads(done.read_text())
        meta, record = saved["meta"], saved["records"][0]
        options = tuple(record.get("options") or ())
        found.append({"corpus": meta.get("corpus", "stdlib"), "size": _size_of(meta), "seed": meta["seed"],
                      "world": record["world_size"], "method": label_of(record["method"], options), "base": record["method"],
                      "options": options, "lr": meta.get("lr"), "steps": meta["steps"],
                      "loss": record["final_val_loss"], "bytes": record["bytes_sent_per_step"],
                      "ratio": record.get("steady_ratio_vs_ddp") or record["ratio_vs_ddp"], "command": meta["command"],
                      "clip": meta.get("gradient_clip_val"),
                      # cells from before compare.py recorded the coding name it in their options when they set it
                      "elias_fano": record.get("position_format") == "elias_fano" or "position_format=elias_fano" in options})
    return found


def clipping(folders: list[Path], method: str) -> list[dict[str, Any]]:
    """Every ``method`` cell run both without gradient clipping and with it, at the same corpus, size,
    seed, workers, rate, steps and warm-up, across the result ``folders``: the two final validation
    losses (the first folder, in the order given, that holds a setting supplies it). Printed one per
    line with the count of cells clipping lowered, so the README's "at the same rate clipping lowered
    DeMo's loss in N of M cells" is one command."""
    runs: dict[tuple[Any, ...], dict[str, float]] = {}
    for folder in folders:
        for done in sorted((folder / "cells").glob("*/latest.json")):
            saved = json.loads(done.read_text())
            meta, record = saved["meta"], saved["records"][0]
            if record["method"] != method or record.get("options"):
                continue
            key = (meta.get("corpus", "stdlib"), _size_of(meta), int(meta["seed"]), int(record["world_size"]),
                   float(meta["lr"]), int(meta["steps"]), stored_warmup(meta))
            clip = meta.get("gradient_clip_val")
            runs.setdefault(key, {}).setdefault("none" if clip is None else f"{clip:g}", float(record["final_val_loss"]))
    pairs = []
    for key, losses in sorted(runs.items()):
        for clip in sorted(k for k in losses if k != "none"):
            if "none" in losses:
                corpus, size, seed, world, lr, steps, warmup = key
                pairs.append({"corpus": corpus, "size": size, "seed": seed, "world": world, "lr": lr, "steps": steps,
                              "warmup": warmup, "clip": clip, "unclipped": losses["none"], "clipped": losses[clip]})
    return pairs


def _size_of(meta: dict[str, Any]) -> str:
    if meta.get("corpus") == DIGITS:
        return DIGITS_SIZE
    for name, (d, n) in SIZES.items():
        if (meta["d_model"], meta["n_layer"]) == (d, n):
            return name
    return f"d{meta['d_model']}L{meta['n_layer']}"


def _times(ratio: float) -> str:
    """A byte ratio to DDP: whole numbers from 10x up, two significant digits below (a method that moves
    more bytes than DDP, 0.33x, must not read 0x)."""
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x"


def _positions_mark(cells: list[dict[str, Any]]) -> str:
    """The mark after a byte ratio whose cells coded their positions with Elias-Fano (each cell records the
    coding it ran, ``position_format``; cells from before issue 18 made it the default lack the key and sent
    fixed-width positions or none): `` EF`` where every cell did, `` EF at n of m`` where some did."""
    coded = sum(c["elias_fano"] for c in cells)
    return "" if coded == 0 else " EF" if coded == len(cells) else f" EF at {coded} of {len(cells)}"


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ({min(values):.4f}-{max(values):.4f})"


def render(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if not (out / "cells").is_dir() and not (out / "sweep.json").exists():
        raise SystemExit(f"render: {out} holds no cells/ and no sweep.json; run `parity.py sweep` or `parity.py run` with --out {out}")
    lines: list[str] = []
    if (out / "sweep.json").exists():
        sw = json.loads((out / "sweep.json").read_text())
        best, losses = best_rates(out), _sweep_losses(sw)
        seeds = sorted({seed for by_rate in losses.values() for by_seed in by_rate.values() for seed in by_seed})
        several = len(seeds) > 1
        lines = [f"# Learning-rate sweep: corpus {sw['corpus']}, size {sw['size']}, "
                 f"seed{'s' if several else ''} {', '.join(map(str, seeds))}, {sw['world']} workers, {sw['steps']} steps"
                 + (f", gradients clipped at {sw['gradient_clip_val']:g}" if sw.get("gradient_clip_val") is not None else ""), ""]
        if several:
            lines += ["Best: the lowest mean over the method's seeds, among the rates run at all of them.", ""]
        head = ["method", "lr", *(f"seed {x}" for x in seeds)] if several else ["method", "lr", "val loss"]
        head += ["mean", "best"] if several else ["best"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for method in sorted(losses):
            means = _eligible(losses[method])
            for lr in sorted(losses[method]):
                by_seed = losses[method][lr]
                row = [method, f"{lr:g}", *(f"{by_seed[x]:.4f}" if x in by_seed else "" for x in seeds)]
                if several:
                    row.append(f"{means[lr]:.4f}" if lr in means else "(not every seed)")
                row.append("yes" if best[method] == lr else "")
                lines.append("| " + " | ".join(row) + " |")
        (out / "sweep.md").write_text("\n".join(lines) + "\n")
    cells = _cells(out)
    clips = {c["clip"] for c in cells}
    if len(clips) > 1:  # a row's seeds must have trained alike: one clipping per folder, as one warm-up
        raise SystemExit(f"render: {out} mixes cells run with gradient clipping {sorted(map(str, clips))}; "
                         f"give each clipping its own --out folder")
    clip = next(iter(clips), None)
    given = getattr(args, "rates", "")  # render --rates: a table at other rates than the chosen ones
    if given:
        try:
            rates = dict((k, float(v)) for k, v in (x.split("=") for x in given.split(",")))
        except ValueError:
            raise SystemExit(f"render --rates: expected METHOD=RATE,... (e.g. ddp=0.002,demo-default=0.002), got {given!r}") from None
    elif (out / "rates.json").exists():  # the rates the last `run` used (given with --lr, or the sweep's best)
        rates = {k: float(v) for k, v in json.loads((out / "rates.json").read_text()).items()}
    else:
        rates = best_rates(out) if (out / "sweep.json").exists() else {}
    tuning = json.loads((out / "sweep.json").read_text())["corpus"] if (out / "sweep.json").exists() else None
    is_chosen = [not rates or (c["lr"] is not None and c["base"] in rates and math.isclose(rates[c["base"]], c["lr"], rel_tol=1e-6))
                 for c in cells]
    chosen = [c for c, keep in zip(cells, is_chosen) if keep]
    others = [c for c, keep in zip(cells, is_chosen) if not keep]
    # a run of another length is another comparison: cells group by step count too (a 1,040-step cell of a seed
    # must not stand in for its 520-step one), and the size column names the steps when the folder holds several
    groups: dict[tuple[str, str, int, int], dict[str, dict[int, dict[str, Any]]]] = {}
    for c in chosen:
        groups.setdefault((c["corpus"], c["size"], c["world"], c["steps"]), {}).setdefault(c["method"], {})[c["seed"]] = c
    lengths = sorted({c["steps"] for c in cells})

    def size_of(size: str, steps: int) -> str:
        return size if len(lengths) == 1 else f"{size} ({steps} steps)"

    title = f"the rates given to `render --rates {given}`" if given else "each method's rate (the sweep's best, or given to `run --lr`)"
    table = [f"# Loss parity at {title}", "",
             f"Validation loss (nats per byte) after {' or '.join(map(str, lengths))} steps, mean over seeds (min-max); "
             "ratio = loss / DDP's at the same seed."
             + (f" Every method clipped its gradients' norm at {clip:g} (`--gradient-clip-val`)." if clip is not None else ""), "",
             "| corpus | size | W | method | lr | seeds | val loss | vs DDP | bytes vs DDP | target |", "|---|---|---|---|---|---|---|---|---|---|"]
    log_ratios: dict[str, dict[int, list[float]]] = {}  # target -> world size -> the held-out runs' log ratios
    variants: dict[str, dict[tuple, float]] = {}  # rows with no target: their log ratios by (corpus, size, W, steps, seed)
    defaults: dict[tuple, float] = {}  # the default's (DEFAULT's target) log ratios, by the same keys
    for (corpus, size, world, steps), by_method in sorted(groups.items()):
        ddp = by_method.get("ddp", {})
        for method in [m for m in METHODS if m in by_method] + sorted(set(by_method) - set(METHODS)):
            seeds = by_method[method]
            losses = [seeds[s]["loss"] for s in sorted(seeds)]
            ratios = [seeds[s]["loss"] / ddp[s]["loss"] for s in sorted(seeds) if s in ddp]
            byte_ratio = statistics.fmean(seeds[s]["ratio"] for s in seeds)
            first = next(iter(seeds.values()))
            target, label = _target_of(method, first["base"], first["options"], world, by_method)
            logs = {(corpus, size, world, steps, s): math.log(seeds[s]["loss"] / ddp[s]["loss"]) for s in seeds if s in ddp}
            verdict = ""
            if target in TARGETS and ratios:
                limit, fewer = TARGETS[target]
                if byte_ratio < fewer or statistics.fmean(ratios) > limit:
                    verdict = "missed"
                else:  # the mean within the limit: met by every seed, or only on the mean
                    verdict = "met" if max(ratios) <= limit else "met on the mean (not every seed)"
                if corpus != tuning:  # the tuning corpus is not out of sample
                    log_ratios.setdefault(target, {}).setdefault(world, []).extend(math.log(r) for r in ratios)
                    if target == DEFAULT:
                        defaults.update(logs)
            elif method != "ddp" and ratios and corpus != tuning:
                variants.setdefault(label, {}).update(logs)
            table.append(f"| {corpus} | {size_of(size, steps)} | {world} | {label} | {first['lr']:g} | {len(seeds)} | "
                         f"{_spread(losses)} | {_spread(ratios) + 'x' if ratios else '-'} | {_times(byte_ratio)}{_positions_mark(list(seeds.values()))} | "
                         f"{verdict} |")
    if others:
        table += ["", "Other rates (ablations; the ratio is to DDP at its chosen rate, same corpus, size, W, steps and seed):", "",
                  "| corpus | size | W | method | lr | seed | val loss | vs DDP | bytes vs DDP |", "|---|---|---|---|---|---|---|---|---|"]
        for c in sorted(others, key=lambda c: (c["corpus"], c["size"], c["world"], c["method"], c["lr"] or 0.0, c["seed"])):
            ref = groups.get((c["corpus"], c["size"], c["world"], c["steps"]), {}).get("ddp", {}).get(c["seed"])
            vs = f"{c['loss'] / ref['loss']:.4f}x" if ref else "-"
            table.append(f"| {c['corpus']} | {size_of(c['size'], c['steps'])} | {c['world']} | {c['method']} | {c['lr']:g} | {c['seed']} | {c['loss']:.4f} | "
                         f"{vs} | {_times(c['ratio'])}{_positions_mark([c])} |")
    left_out = f", the tuning corpus ({tuning}) left out" if tuning else ""  # no sweep.json here: every corpus counts
    table += ["", f"Geometric mean of the loss ratio to DDP over every cell and seed above{left_out}:", ""]
    if not log_ratios:
        table.append(f"- none: no cell here is off the tuning corpus ({tuning})" if tuning else "- none: no method with a target beside DDP")
    for target, worlds in sorted(log_ratios.items()):  # pooled over the world sizes, and each one's share where several
        pooled = [r for runs in worlds.values() for r in runs]
        shares = ", ".join(f"W {w}: {math.exp(statistics.fmean(v)):.4f}x over {len(v)}" for w, v in sorted(worlds.items()))
        table.append(f"- {target}: {math.exp(statistics.fmean(pooled)):.4f}x over {len(pooled)} runs"
                     + (f" ({shares})" if len(worlds) > 1 else ""))
    if variants:
        table += ["", "Rows without a target (settings other than a default), beside the default on the same runs:", ""]
        for name, runs in sorted(variants.items()):
            same = [defaults[k] for k in runs if k in defaults]
            beside = (f"; the default {math.exp(statistics.fmean(same)):.4f}x over {len(same)} of them" if same else "")
            table.append(f"- {name}: {math.exp(statistics.fmean(runs.values())):.4f}x over {len(runs)} runs{beside}")
    if any(c["elias_fano"] for c in cells):
        table += ["", "Bytes marked EF: top-k positions coded with Elias-Fano (the default since issue 18; the same training "
                  "bit for bit); the others sent fixed-width positions, or none."]
    table += ["", "Commands: each cell's `compare.py` command is in `cells/<cell>/latest.json` (`meta.command`)."]
    (out / getattr(args, "table", "latest.md")).write_text("\n".join(table) + "\n")
    print("\n".join(lines + [""] + table))


def _target_of(method: str, base: str, options: tuple[str, ...], world: int, by_method: dict[str, Any]) -> tuple[str, str]:
    """``(target, label)``: the issue's target a row answers to. A :data:`DEFAULT` row with ``--option``
    settings that are all the defaults' own (:func:`default_settings`) runs what ``strategy="demo"``
    runs, and answers for the default when its world size has no plain :data:`DEFAULT` row. Other
    DeMo rows (``demo-sign1bit``, the default before issue 18, ``demo-sign1bit-k<K>``, ...) have no target."""
    if DEFAULT in by_method or method == DEFAULT or not default_settings(options):
        return method, method
    if base == DEFAULT:
        return DEFAULT, f"{method} (the default's settings)"
    return method, method


def byte_entropies(data: bytes) -> tuple[float, float]:
    """``(unigram, bigram)`` entropy of ``data`` in nats per byte: the loss of the best model that sees no
    context, and of the best that sees the previous byte only (conditional entropy), on the same bytes. A
    training curve that stalls at the first has learnt the bytes' frequencies and nothing of their order."""
    if len(data) < 2:
        raise ValueError(f"byte_entropies needs at least 2 bytes, got {len(data)}")
    n = len(data)
    ones = Counter(data)
    unigram = -sum(c / n * math.log(c / n) for c in ones.values())
    firsts = Counter(data[:-1])
    pairs = Counter(zip(data, data[1:]))
    bigram = -sum(c / (n - 1) * math.log(c / firsts[a]) for (a, _), c in pairs.items())
    return unigram, bigram


def corpora(max_bytes: int) -> None:
    """Print every named corpus's size and split on this machine (what the README's corpus table says),
    and its training split's unigram and bigram entropies (:func:`byte_entropies`)."""
    from demo_lightning.data import CORPORA, corpus_digest, corpus_documents, load_corpus

    for name in CORPORA:
        docs = corpus_documents(name)  # type: ignore[arg-type]
        train, val = load_corpus(name, max_bytes)  # type: ignore[arg-type]
        unigram, bigram = byte_entropies(bytes(train))
        print(f"{name}: {len(docs):,} documents, {sum(len(d.data) for d in docs):,} bytes in all; at max_bytes {max_bytes:,}: "
              f"train {len(train):,}, validation {len(val):,} bytes, digest {corpus_digest(train, val)}; "
              f"train entropy {unigram:.3f} nats/byte by unigram, {bigram:.3f} by bigram")


def window_means(losses: list[float], window: int) -> list[float]:
    """Means of consecutive ``window``-step slices of a training-loss curve (the last slice may be shorter)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return [statistics.fmean(losses[i : i + window]) for i in range(0, len(losses), window)]


def curves(folders: list[str], window: int) -> None:
    """Print each compare.py result folder's training loss as ``window``-step means (rank 0's batches), and its
    final validation loss: where in a run two methods part."""
    for folder in folders:
        path = Path(folder) / "latest.json"
        if not path.exists():
            raise SystemExit(f"curves: {folder} holds no latest.json (a compare.py --out folder or a parity cell)")
        for record in json.loads(path.read_text())["records"]:
            means = " ".join(f"{m:.2f}" for m in window_means(record["train_loss"], window))
            extra = f" [{', '.join(record['options'])}]" if record.get("options") else ""
            print(f"{Path(folder).name}: {record['method']}{extra} W={record['world_size']} val {record['final_val_loss']:.4f}"
                  f" | train loss per {window} steps: {means}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    s = sub.add_parser("sweep", help="every method at each rate on the tuning corpus")
    s.add_argument("--corpus", default="stdlib")
    s.add_argument("--size", default="small", choices=sorted(SIZES))
    s.add_argument("--seeds", "--seed", dest="seeds", default="0",
                   help="seeds, e.g. 0,1,2: a rate's loss is its mean over them (added to an earlier sweep's cells)")
    s.add_argument("--world", type=int, default=2)
    s.add_argument("--lrs", default="3e-4,1e-3,3e-3")
    s.add_argument("--methods", default=",".join(METHODS))
    r = sub.add_parser("run", help="every method at its best rate on the given corpora, sizes, seeds and world sizes")
    r.add_argument("--corpora", default="prose,cpp", help="names (stdlib, prose, cpp), paths to your own text, or digits (the vision task)")
    r.add_argument("--sizes", default="small")
    r.add_argument("--seeds", default="0")
    r.add_argument("--world-sizes", default="2")
    r.add_argument("--methods", default=",".join(METHODS))
    r.add_argument("--lr", default="", help="METHOD=RATE,... instead of the sweep's best rates")
    r.add_argument("--ablation", action="store_true",
                   help="--lr's rates are an ablation: run them, but keep each method's chosen rate in rates.json "
                        "(render lists these cells under the other rates)")
    r.add_argument("--option", action="append", default=None, metavar="KEY=VALUE",
                   help="compare.py's --option for every method but ddp (repeatable); the cells are named with it")
    k = sub.add_parser("clipping", help="every cell run with and without gradient clipping at the same settings: both losses")
    k.add_argument("folders", nargs="*", help="result folders (default: every folder under benchmarks/results/parity "
                                               "but archive-*, whose cells ran a default since replaced)")
    k.add_argument("--method", default="demo-default")
    c = sub.add_parser("corpora", help="every named corpus's documents, bytes and digest on this machine")
    c.add_argument("--max-bytes", type=int, default=4_000_000)
    d = sub.add_parser("render", help="tables from the cells run so far")
    d.add_argument("--rates", default="", metavar="METHOD=RATE,...",
                   help="the table at these rates instead of the chosen ones (rates.json), e.g. a finer sweep's best")
    d.add_argument("--table", default="latest.md", help="the file under --out the table goes to")
    v = sub.add_parser("curves", help="training loss in windows of steps, per result folder")
    v.add_argument("folders", nargs="+", help="compare.py --out folders or parity cells")
    v.add_argument("--window", type=int, default=40)
    for q in (s, r):
        q.add_argument("--steps", type=int, default=520)
        q.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP,
                       help="every run's learning-rate warm-up (compare.py's --warmup-steps); one per --out folder")
        q.add_argument("--gradient-clip-val", type=float, default=None,
                       help="every method's gradient clipping (compare.py's --gradient-clip-val); cells named _clip<value>")
    for q in (s, r, d):
        q.add_argument("--out", default=str(OUT), help="results folder")
    args = p.parse_args(argv)
    clip = getattr(args, "gradient_clip_val", None)
    if clip is not None and not clip > 0:
        p.error(f"--gradient-clip-val must be > 0 (leave it out for no clipping), got {clip}")
    if args.stage == "sweep":
        sweep(args)
    elif args.stage == "corpora":
        corpora(args.max_bytes)
    elif args.stage == "clipping":
        # archive-*: cells of a default since replaced, kept for the README's history
        folders = [Path(f) for f in args.folders] or sorted(d for d in OUT.iterdir() if (d / "cells").is_dir()
                                                             and not d.name.startswith("archive"))
        pairs = clipping(folders, args.method)
        for r in pairs:
            print(f"{r['corpus']:7} {r['size']:6} W{r['world']} s{r['seed']} lr {r['lr']:g} t{r['steps']} warm-up {r['warmup']}: "
                  f"unclipped {r['unclipped']:.4f}, clipped at {r['clip']} {r['clipped']:.4f} ({r['clipped'] - r['unclipped']:+.4f})")
        lower = sum(r["clipped"] < r["unclipped"] for r in pairs)
        print(f"{args.method}: clipping lowered the validation loss in {lower} of {len(pairs)} cells")
    elif args.stage == "curves":
        if args.window < 1:
            p.error(f"--window must be >= 1, got {args.window}")
        curves(args.folders, args.window)
    elif args.stage == "run":
        unknown = [x for x in args.sizes.split(",") if x not in SIZES]
        if unknown:
            p.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
        run(args)
    else:
        render(args)


if __name__ == "__main__":
    main()
