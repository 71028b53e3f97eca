"""The whole DeMo exchange step, side by side: this checkout, a previous revision, the reference, and two floors.

    .venv/bin/python benchmarks/exchange_step.py                          # 12.79 M-parameter GPT, 1 thread
    .venv/bin/python benchmarks/exchange_step.py --against HEAD~3         # A/B with a previous revision
    DEMO_REFERENCE=/tmp/reference_demo/demo.py .venv/bin/python benchmarks/exchange_step.py
    .venv/bin/python benchmarks/exchange_step.py --quick                  # d_model 192, few steps: a smoke test
    python benchmarks/exchange_step.py --device cuda --d-model 2048       # on a GPU (writes exchange_step_cuda.*)

One optimizer step of DeMo on the trainable weight shapes of
``demo_lightning.models.GPT(d_model=512, n_layer=4, n_head=8)`` (vocab 256, block 128: 12.79 M
parameters in 36 tensors; ``--quick``: d_model 192) with random gradients (fixed seed, copied back
into ``p.grad`` before every step, untimed), all parameters in one ``torch.optim.SGD(lr=1e-3)``, at
world size 1, with the reference DeMo's settings: chunk 64, topk 32, fp32 values, decay 0.999,
``sign`` update. Each contestant runs in its own subprocess (``torch.set_num_threads(--threads)``)
and reports the median milliseconds of ``--steps`` steps after ``--warmup`` steps:

* ours: ``DeMoExchange(optimizer, config, Communicator()).step()`` then ``optimizer.step()``, with
  this checkout's ``demo_lightning`` first on ``PYTHONPATH``;
* previous (``--against REV``): the same, with REV's ``demo_lightning`` (checked out into a temporary
  git worktree, removed at the end) first on ``PYTHONPATH``. The config is built by
  :func:`demo_config`, which tries ``DeMoConfig(codec=CodecConfig(...), decay=...)`` and falls back to
  the flat ``DeMoConfig(chunk=..., topk=..., value_format=..., decay=...)``, so one benchmark runs
  against revisions before and after that refactor;
* reference: when ``DEMO_REFERENCE`` names the reference implementation's ``demo.py`` (bloc97/DeMo;
  never vendored here), its ``DeMo`` optimizer's ``step()`` (which also runs the SGD update) under a
  world-of-one gloo process group. It imports ``einops``: put it on the path, or install it next
  to ``demo.py`` (``pip install --target <that folder> einops``), whose folder is put on ``sys.path``;
* floors, timed in this checkout's subprocess right after ours: (1) the tile transform, the 2-D DCT
  of every 64x64 tile of all the parameters (``ceil(N / 4096)`` tiles) as two batched GEMMs
  ``(T, 64, 64) @ (64, 64)`` into preallocated outputs; (2) one square ``torch.matmul`` with the
  same FLOPs (``256`` per element), scaled to exactly those FLOPs, as ``benchmarks/codec.py``'s
  ``matmul_floor``.

The contestants alternate for ``--rounds`` rounds so all see the same machine load; the tables give
each one's median over the rounds and the spread (lowest and highest round). Payload bytes per step:
ours from ``exchange.stats.payload_bytes`` (the ledger: what this worker hands to the collectives,
tensors below ``dense_below`` included as fp32); the reference's from the tensors it all-gathers
(``sparse_idx`` int64 + ``sparse_val`` fp32 per kept coefficient, its ``data_transmit``). Note the
reference also compresses the 1-D LayerNorm tensors, which ours all-reduces densely.

``--device cuda``: parameters, gradients, the exchange's state and both floors live on the current
GPU (the reference's world-of-one gloo group takes CUDA tensors); every timed call is bracketed by
``torch.cuda.synchronize()``, so a step's time includes the kernels it queued; ``--threads`` then
only sets the host's threads.

Writes ``<out>/exchange_step.json`` and ``.md`` (``exchange_step_quick.*`` with ``--quick``; a
``_cuda`` suffix on a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

SETTINGS = {"chunk": 64, "topk": 32, "value_format": "fp32", "decay": 0.999, "update": "sign", "lr": 1e-3}
TARGETS = {"ours / floor (1)": ("<=", 2.5), "previous / ours": (">=", 2.0), "ours / reference": ("<=", 0.5)}


# ------------------------------------------------------------------------------------ the workers
def demo_config(algorithms: Any, chunk: int, topk: int, value_format: str, decay: float, update: str) -> tuple[Any, str]:
    """A ``DeMoConfig`` in the form this ``demo_lightning`` takes: nested (``codec=CodecConfig(...)``), else flat."""
    codec_config = getattr(algorithms, "CodecConfig", None)
    if codec_config is not None:
        try:
            codec = codec_config(chunk=chunk, topk=topk, value_format=value_format)
            return algorithms.DeMoConfig(codec=codec, decay=decay, update=update), "nested"
        except TypeError:  # DeMoConfig without a codec field: the flat form
            pass
    return algorithms.DeMoConfig(chunk=chunk, topk=topk, value_format=value_format, decay=decay, update=update), "flat"


def _parameters(spec: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """Fresh parameters of the spec's shapes and their fixed random gradients."""
    import torch

    gen = torch.Generator().manual_seed(spec["seed"])  # drawn on the CPU: the same values on every device
    device = torch.device(spec.get("device", "cpu"))
    params = [torch.nn.Parameter((0.02 * torch.randn(shape, generator=gen)).to(device)) for shape in spec["shapes"]]
    grads = [torch.randn(shape, generator=gen).to(device) for shape in spec["shapes"]]
    return params, grads


def _synchronizer(device: str) -> Any:
    """``torch.cuda.synchronize`` on a GPU (a timed call then includes the kernels it queued), else a no-op."""
    import torch

    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def _time_steps(step: Any, params: list[Any], grads: list[Any], warmup: int, steps: int, sync: Any = lambda: None) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` after ``warmup``; gradients restored before each, untimed;
    ``sync()`` before the clock starts and before it stops."""
    times = []
    for i in range(warmup + steps):
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _median_of(fn: Any, reps: int, sync: Any = lambda: None) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def floors(n_params: int, chunk: int, reps: int, device: str = "cpu") -> dict[str, Any]:
    """(1) the 2-D DCT of every tile of ``n_params`` parameters as two batched GEMMs; (2) a square matmul of the same
    FLOPs; both on ``device``."""
    import torch

    sync = _synchronizer(device)
    n_tiles = math.ceil(n_params / (chunk * chunk))
    flops = 2 * n_tiles * chunk * chunk * (2 * chunk)  # two GEMMs of (T, c, c) @ (c, c)
    gen = torch.Generator().manual_seed(1)
    k = torch.arange(chunk, dtype=torch.float64)
    basis = torch.cos(math.pi * (2 * k[None, :] + 1) * k[:, None] / (2 * chunk)) * math.sqrt(2 / chunk)
    basis[0] /= math.sqrt(2)  # orthonormal DCT-II
    basis_t = basis.T.contiguous().float().to(device)
    tiles = torch.randn((n_tiles, chunk, chunk), generator=gen).to(device)
    half, full = torch.empty_like(tiles), torch.empty_like(tiles)
    tile_s = _median_of(lambda: torch.matmul(torch.matmul(tiles, basis_t, out=half), basis_t, out=full), reps, sync)
    del tiles, half, full
    side = max(64, round((flops / 2) ** (1 / 3)))
    a, b = torch.randn((side, side), generator=gen).to(device), torch.randn((side, side), generator=gen).to(device)
    product = torch.empty((side, side), device=device)
    square_s = _median_of(lambda: torch.matmul(a, b, out=product), reps, sync) * flops / (2 * side**3)
    return {"tile_transform_s": tile_s, "square_matmul_s": square_s, "tiles": n_tiles, "flops": flops,
            "square_side": side}


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import demo_lightning
    from demo_lightning import algorithms
    from demo_lightning.comm import Communicator

    params, grads = _parameters(spec)
    optimizer = torch.optim.SGD(params, lr=spec["lr"])
    config, form = demo_config(algorithms, spec["chunk"], spec["topk"], spec["value_format"], spec["decay"], spec["update"])
    exchange = algorithms.DeMoExchange(optimizer, config, Communicator())

    def step() -> None:
        exchange.step()
        optimizer.step()

    times = _time_steps(step, params, grads, spec["warmup"], spec["steps"], _synchronizer(spec.get("device", "cpu")))
    payload = getattr(exchange.stats, "payload_bytes", None)
    if payload is None:  # the ledger of the last step
        payload = sum(r.payload_bytes for r in exchange.comm.ledger.step_records)
    out = {"step_s": statistics.median(times), "times_s": times, "payload_bytes": int(payload), "config_form": form,
           "library": str(Path(demo_lightning.__file__).resolve().parents[1])}
    if spec.get("floors"):
        out["floors"] = floors(sum(math.prod(s) for s in spec["shapes"]), spec["chunk"], max(spec["steps"], 5),
                               spec.get("device", "cpu"))
    return out


def worker_reference(spec: dict[str, Any]) -> dict[str, Any]:
    import importlib.util

    import torch.distributed as dist

    path = Path(spec["reference"]).resolve()
    sys.path.insert(0, str(path.parent))  # an einops installed next to demo.py
    module_spec = importlib.util.spec_from_file_location("reference_demo", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        return {"skipped": f"{path} cannot be imported: {err} (install it, e.g. pip install --target {path.parent} {err.name})"}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            params, grads = _parameters(spec)
            kwargs = {"compression_decay": spec["decay"], "compression_topk": spec["topk"],
                      "compression_chunk": spec["chunk"], "weight_decay": 0.0, "lr": spec["lr"]}
            optimizer = module.DeMo(params, **kwargs)
            times = _time_steps(optimizer.step, params, grads, spec["warmup"], spec["steps"],
                                _synchronizer(spec.get("device", "cpu")))
            payload = int(optimizer.data_transmit)  # sparse_idx.nbytes + sparse_val.nbytes, summed over tensors
        finally:
            dist.destroy_process_group()
    return {"step_s": statistics.median(times), "times_s": times, "payload_bytes": payload,
            "constructor": {"params": "all trainable parameters, one group", **kwargs}, "library": str(path)}


def worker_main(kind: str, spec_path: str, result_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    result = (worker_ours if kind == "ours" else worker_reference)(spec)
    Path(result_path).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------ the parent
def model_shapes(d_model: int) -> tuple[list[list[int]], str]:
    """The trainable weight shapes of this checkout's bundled GPT at width ``d_model``."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from demo_lightning.models import GPT

    model = GPT(d_model=d_model, n_layer=4, n_head=8)
    shapes = [list(p.shape) for p in model.parameters() if p.requires_grad]  # the tied head once
    return shapes, f"demo_lightning.models.GPT(d_model={d_model}, n_layer=4, n_head=8) (vocab 256, block 128)"


def _checkout_label() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "demo_lightning"], cwd=ROOT, capture_output=True, text=True,
                           check=False).stdout.strip()
    return (head or "this checkout") + (" + uncommitted changes" if dirty else "")


def _run_worker(kind: str, spec: dict[str, Any], library: Path, tmp: Path) -> dict[str, Any]:
    """One contestant's subprocess, with ``library`` (a checkout root) first on ``PYTHONPATH``."""
    spec_path, result_path = tmp / "spec.json", tmp / "result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(library), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", kind, str(spec_path), str(result_path)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not result_path.exists():
        raise SystemExit(f"the {kind} worker ({library}) failed with exit code {done.returncode}:\n{done.stderr[-4000:]}")
    result = json.loads(result_path.read_text())
    if kind == "ours" and Path(result["library"]) != library.resolve():
        raise SystemExit(f"the {kind} worker imported demo_lightning from {result['library']}, not {library}")
    return result


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _ms(seconds: float) -> str:
    ms = 1000 * seconds
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def render(result: dict[str, Any]) -> str:
    meta, rows, ratios = result["meta"], result["rows"], result["ratios"]
    s = meta["settings"]
    lines = [
        f"Command: `{meta['command']}` — {meta['date']}, {meta['machine']}, {meta['threads']} thread(s), torch {meta['torch']}. "
        f"Load average (1/5/15 min) at start {meta['loadavg_start']}, at end {meta['loadavg_end']}.",
        "",
        f"{meta['model']}: {meta['n_params']:,} trainable parameters in {meta['n_tensors']} tensors; world size 1; on {meta.get('device', 'cpu')}; "
        f"chunk {s['chunk']}, topk {s['topk']}, {s['value_format']} values, decay {s['decay']}, update {s['update']}, "
        f"SGD lr {s['lr']}. Median of {meta['steps']} steps after {meta['warmup']} warm-up steps per round, "
        f"{meta['rounds']} alternating round(s); spread = lowest and highest round.",
        "",
        "| contestant | library | ms per step (median of rounds) | spread over rounds | payload bytes per step |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["step_s"]
        payload = f"{r['payload_bytes']:,}" if r.get("payload_bytes") is not None else "—"
        lines.append(f"| {r['contestant']} | {r['library']} | {_ms(t['median'])} | {_ms(t['min'])} – {_ms(t['max'])} | {payload} |")
    lines += ["", "| ratio | value | target | verdict |", "|---|---|---|---|"]
    for name, value in ratios.items():
        target = TARGETS.get(name)
        if value is None:
            lines.append(f"| {name} | — | {' '.join(map(str, target)) if target else '—'} | not measured |")
            continue
        verdict = "—"
        if target:
            op, bound = target
            verdict = "PASS" if (value <= bound if op == "<=" else value >= bound) else "MISS"
        lines.append(f"| {name} | {value:.2f} | {f'{target[0]} {target[1]}' if target else '—'} | {verdict} |")
    f = result.get("floors_spec")
    if f:
        lines += ["", f"Floor (1): two batched GEMMs `(T, 64, 64) @ (64, 64)` on T = {f['tiles']:,} tiles into preallocated "
                  f"outputs ({f['flops'] / 1e9:.2f} GFLOP); floor (2): one `{f['square_side']}x{f['square_side']}` square "
                  "`torch.matmul`, scaled to the same FLOPs."]
    for note in meta["notes"]:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="d_model 192 and fewer steps (a smoke test, well under a minute)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each contestant's process (default 1)")
    p.add_argument("--d-model", type=int, default=None, help="GPT width (default 512; 192 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per round (default 10; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; 1 with --quick)")
    p.add_argument("--against", default=None, help="a git revision whose demo_lightning is timed side by side")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds, medians reported (default 3; 2 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where parameters, gradients and state live")
    p.add_argument("--out", default=str(RESULTS), help="folder for exchange_step.json and .md (exchange_step_quick.* with --quick)")
    args = p.parse_args(argv)
    d_model = args.d_model or (192 if args.quick else 512)
    steps = args.steps or (3 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.rounds = args.rounds or (2 if args.quick else 3)
    if args.rounds < 1 or steps < 1 or warmup < 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0")

    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device!r}: not a device; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from codec import machine  # cores, processor model and GPU, as the codec benchmark names them

    shapes, model = model_shapes(d_model)
    spec = {"shapes": shapes, "threads": args.threads, "steps": steps, "warmup": warmup, "seed": args.seed,
            "device": str(device), **SETTINGS}
    notes: list[str] = []
    reference = os.environ.get("DEMO_REFERENCE")
    if not reference:
        notes.append("reference: skipped (the environment variable DEMO_REFERENCE does not name the reference "
                     "implementation's demo.py, bloc97/DeMo).")
    elif not Path(reference).is_file():
        notes.append(f"reference: skipped (DEMO_REFERENCE={reference} is not a file).")
        reference = None
    this = _checkout_label()
    meta: dict[str, Any] = {
        "command": " ".join(["python benchmarks/exchange_step.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(device),
        "device": str(device), "threads": args.threads, "torch": torch.__version__,
        "model": model, "n_params": sum(math.prod(s) for s in shapes), "n_tensors": len(shapes), "settings": SETTINGS,
        "steps": steps, "warmup": warmup, "rounds": args.rounds, "against": args.against, "this": this,
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    runs: dict[str, list[dict[str, Any]]] = {}
    labels: dict[str, str] = {"ours": this}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        contestants: list[tuple[str, str, Path]] = [("ours", "ours", ROOT)]
        if args.against:
            rev_root = tmp / "rev"
            made = subprocess.run(["git", "worktree", "add", "--detach", str(rev_root), args.against], cwd=ROOT,
                                  capture_output=True, text=True, check=False)
            if made.returncode != 0:
                p.error(f"--against {args.against!r}: git worktree add failed: {made.stderr.strip()}")
            contestants.insert(0, ("previous", "ours", rev_root))
            labels["previous"] = args.against
        if reference:
            contestants.append(("reference", "reference", ROOT))
            labels["reference"] = f"bloc97/DeMo demo.py ({reference})"
        try:
            for i in range(args.rounds):
                for name, kind, library in contestants:
                    if name == "reference" and runs.get("reference") and "skipped" in runs["reference"][0]:
                        continue
                    one = {**spec, "floors": name == "ours", "reference": reference}
                    result = _run_worker(kind, one, library, tmp)
                    runs.setdefault(name, []).append(result)
                    shown = result.get("skipped") or f"{_ms(result['step_s'])} ms per step"
                    print(f"round {i + 1}/{args.rounds}, {name} ({labels[name]}): {shown} "
                          f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        finally:
            if args.against:
                subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "rev")], cwd=ROOT, capture_output=True,
                               check=False)
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meta["seconds"] = round(time.perf_counter() - start, 1)
    if runs.get("reference") and "skipped" in runs["reference"][0]:
        notes.append(f"reference: skipped ({runs.pop('reference')[0]['skipped']}).")
    if "reference" in runs:
        meta["reference_constructor"] = runs["reference"][0]["constructor"]
        notes.append("reference constructor: `DeMo(params, " + ", ".join(
            f"{k}={v}" for k, v in runs["reference"][0]["constructor"].items() if k != "params") + ")`.")
    if args.against:
        notes.append(f"previous = {args.against}: DeMoConfig built in the {runs['previous'][0]['config_form']} form; "
                     f"this checkout: the {runs['ours'][0]['config_form']} form.")

    step = {name: _spread([r["step_s"] for r in rs]) for name, rs in runs.items()}
    floor1 = _spread([r["floors"]["tile_transform_s"] for r in runs["ours"]])
    floor2 = _spread([r["floors"]["square_matmul_s"] for r in runs["ours"]])
    fspec = {k: v for k, v in runs["ours"][0]["floors"].items() if not k.endswith("_s")}
    rows = [{"contestant": "ours", "library": this, "step_s": step["ours"], "payload_bytes": runs["ours"][-1]["payload_bytes"]}]
    if "previous" in runs:
        rows.append({"contestant": "previous", "library": args.against, "step_s": step["previous"],
                     "payload_bytes": runs["previous"][-1]["payload_bytes"]})
    if "reference" in runs:
        rows.append({"contestant": "reference", "library": "bloc97/DeMo demo.py", "step_s": step["reference"],
                     "payload_bytes": runs["reference"][-1]["payload_bytes"]})
    rows.append({"contestant": "floor (1): tile transform", "library": "torch.matmul", "step_s": floor1})
    rows.append({"contestant": "floor (2): square matmul, same FLOPs", "library": "torch.matmul", "step_s": floor2})
    ours = step["ours"]["median"]
    ratios: dict[str, float | None] = {
        "ours / floor (1)": ours / floor1["median"],
        "ours / floor (2)": ours / floor2["median"],
        "previous / ours": step["previous"]["median"] / ours if "previous" in step else None,
        "ours / reference": ours / step["reference"]["median"] if "reference" in step else None,
        "payload ours / reference": (runs["ours"][-1]["payload_bytes"] / runs["reference"][-1]["payload_bytes"]
                                     if "reference" in runs else None),
    }
    meta["notes"] = notes
    result = {"meta": meta, "rows": rows, "ratios": ratios, "floors_spec": fspec,
              "targets": {k: list(v) for k, v in TARGETS.items()}, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = ("exchange_step_quick" if args.quick else "exchange_step") + ("_cuda" if device.type == "cuda" else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    table = render(result)
    (out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
