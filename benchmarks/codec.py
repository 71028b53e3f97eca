"""Codec throughput per stage, against the DCT's arithmetic floor; bytes per worker against world size.

    .venv/bin/python benchmarks/codec.py                          # CPU, 1 thread, full shapes (about 3 minutes on 2 cores)
    .venv/bin/python benchmarks/codec.py --quick                  # small shapes, short timings (well under a minute)
    .venv/bin/python benchmarks/codec.py --threads 2 --embedding-rows 50257
    .venv/bin/python benchmarks/codec.py --device cuda            # the same on a GPU
    .venv/bin/python benchmarks/codec.py --quick --transforms dct,haar,identity   # the transforms side by side (the default)
    .venv/bin/python benchmarks/codec.py --render-only            # re-render the markdown from the JSON
    .venv/bin/python benchmarks/exchange_step.py                  # the whole exchange step vs these floors, a revision, the reference

Part 1 (timings): for representative weight shapes (embedding, fused qkv, attention output, MLP up
and down, a 3x3 conv) with ``--chunk`` 64 and ``--topk`` 64, every stage of the codec is timed on
its own with ``torch.utils.benchmark.Timer`` (median of ``blocked_autorange``). Two forms of the
transform stand side by side: the tile-major one of ``demo_lightning.codec`` (``to_tiles``, then
``dct2`` on the ``(T, 64, 64)`` tiles; decode: ``scatter_add_`` into zeroed tiles, ``idct2``,
``from_tiles``), and the matrix-layout one the exchange's stages run
(``demo_lightning.codec.transform``: ``accumulate_spectrum`` with decay 0 and ``inverse_spectrum``
on the tensor's own ``Rp x Cp`` matrix, no tile copies, into a preallocated output and scratch as
the stages' workspace provides them). Then ``select`` (top-k and low-pass), ``pack_segment`` and
``unpack_segment`` for each value format, and the whole ``CompressedMean`` call at world size 1
(``Communicator()`` without a process group). Each time is also shown as a multiple of the
arithmetic floor: one ``torch.matmul`` of square matrices with the same FLOPs as ``dct2`` (``2 * T
* r * c * (r + c)``: 256 per element for 64x64 tiles), scaled to exactly those FLOPs. A second
reference, "dct2 GEMMs", runs the same two GEMMs as ``dct2`` bare: ``(T, 64, 64) @ (64, 64)``
twice. Both write into preallocated outputs (arithmetic only); ``to_tiles``/``dct2``/``idct2``/
``from_tiles`` and the other codec functions allocate their results, as the codec does.

The isolated timings reuse hot inputs. To see what a step really spends, the stages are also timed
inside real ``CompressedMean`` calls, from the stage ranges it opens
(``demo_lightning.profiling.measure_stages``, exclusive times): transform
(``codec/encode/transform``: ``transform_into``), select (``codec/encode/select``), pack
(``codec/transport/pack``: ``pack_segments``, or ``saturate`` for an all-reduce, and the payload's
concatenation), unpack (``codec/transport/unpack``: ``unpack_segments`` and the values' dtype),
scatter-add (``codec/decode/scatter_add``: ``index_add_`` into the mean's spectra, less the
unpacking that runs inside it as it draws the contributions), inverse (``codec/decode/inverse``:
``inverse_spectrum`` and the copy of each output). CompressedMean runs one forward and two inverse
transforms per tensor: the mean, and what this worker sent (for the caller's error feedback). The
DeMo exchange itself keeps its momenta as coefficients and runs one of each per step; that step is
timed whole in ``benchmarks/exchange_step.py``. "rest" is the step's time outside those ranges
(the plan lookup, the dense group, allocating and zeroing the spectra, the collectives' launches
and waits, copying the sent values in, the ledger, the ranges' own cost).
"isolated sum" is ``transform + select + pack + unpack + 2 * (scatter + inverse)`` from the
isolated timings (matrix-layout transform); step / isolated sum shows what the step loses to cold
caches and allocation.

Transforms (``--transforms``, default ``dct,haar,identity``: the codec's ``transform`` setting,
:mod:`demo_lightning.codec.bases`): for every tensor and each transform, the matrix-layout forward
transform alone (``accumulate_spectrum`` at decay 0), the exchange's momentum update (the same at
decay 0.99: ``M <- 0.99 M + T(g)``, what the DeMo step runs), the inverse (``inverse_spectrum``) and
the whole ``CompressedMean`` call at W = 1 with the first of ``--formats``, side by side, with the
sum over the tensors. DCT and Haar run the same GEMMs with another matrix (a dense ``tile x tile``
basis: Haar's sparsity is not used), so they cost the same; ``"identity"`` runs no GEMM (a copy, or
one elementwise pass with the decay).

Part 2 (bytes, closed forms): for the bundled GPT (``demo_lightning.models.GPT()``) the payload
one worker hands to the collectives per step (``CodecConfig.payload_bytes`` per trainable
tensor; tensors below ``dense_below`` go to an all-reduce in ``dense_format``, bf16 by default) is put through the ledger's ring
models (``ring_all_gather_bytes`` for top-k, ``ring_all_reduce_bytes`` for low-pass float values
and the dense tensors, ``ddp_bytes_per_step`` for DDP) for W = 2 .. 512. The payloads are checked
against what a real ``CompressedMean`` call records in its ledger. The crossover is the smallest W
at which top-k's received bytes exceed DDP's.

Writes ``<out>/codec.json`` and ``<out>/codec.md`` (``codec_quick.*`` with ``--quick``; ``<out>``
is ``benchmarks/results`` by default) and prints the markdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

FORMATS = ("sign", "bf16", "int8", "fp32")
WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512)


def shapes(quick: bool, embedding_rows: int) -> list[tuple[str, tuple[int, ...]]]:
    """Weight shapes as PyTorch stores them (``nn.Linear``: out x in); GPT-2 small widths, or the bundled GPT's with --quick."""
    if quick:
        d = 192
        return [
            ("embedding", (1024, d)), ("attn qkv", (d, 3 * d)), ("attn out", (d, d)),
            ("mlp up", (d, 4 * d)), ("mlp down", (4 * d, d)), ("conv 3x3", (64, 32, 3, 3)),
        ]
    d = 768
    return [
        ("embedding", (embedding_rows, d)), ("attn qkv", (d, 3 * d)), ("attn out", (d, d)),
        ("mlp up", (d, 4 * d)), ("mlp down", (4 * d, d)), ("conv 3x3", (256, 128, 3, 3)),
    ]


# ---------------------------------------------------------------------------------------- timing
def measure(fn: Callable[[], Any], threads: int, min_run_time: float, device: Any) -> dict[str, float]:
    """Median seconds per call of ``fn`` (Timer's blocked_autorange: warm-up, block size, replicates).

    On CPU the clock is ``time.perf_counter``: Timer's default clock asks ``torch.accelerator`` whether
    to synchronise on every reading (several microseconds here), which pushes its block-size estimate
    to blocks as long as the whole measurement, so a measurement would be one replicate.
    """
    from torch.utils.benchmark import Timer

    clock = {"timer": time.perf_counter} if device.type == "cpu" else {}  # on GPUs the default clock synchronises
    m = Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads, **clock).blocked_autorange(min_run_time=min_run_time)
    return {"median_s": m.median, "iqr_s": m.iqr, "replicates": len(m.raw_times), "calls_per_replicate": m.number_per_run}


def time_tensor(name: str, shape: tuple[int, ...], args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import torch

    from demo_lightning.algorithms.compressed_mean import CodecConfig, CompressedMean
    from demo_lightning.codec import (
        dct2,
        dct_basis,
        from_tiles,
        idct2,
        pack_segment,
        plan_tiles,
        select,
        to_tiles,
        unpack_segment,
    )
    from demo_lightning.codec.transform import accumulate_spectrum, inverse_spectrum, tile_view
    from demo_lightning.comm import Communicator

    def t(fn: Callable[[], Any]) -> dict[str, float]:
        return measure(fn, args.threads, args.min_run_time, device)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(device)
    layout = plan_tiles(shape, args.chunk)
    r, c = layout.tile_shape
    if r != c:
        raise SystemExit(f"{name} {shape}: the floor assumes square tiles, got {layout.tile_shape}")
    n, k, numel = layout.n_tiles, min(args.topk, layout.tile_numel), math.prod(shape)
    tiles = to_tiles(x, layout)
    spectrum = dct2(tiles)
    positions, values = select(spectrum, k, "topk")
    flops = 2 * n * r * c * (r + c)

    stages: dict[str, dict[str, float]] = {}
    out = torch.empty_like(tiles)
    stages["to_tiles"] = t(lambda: to_tiles(x, layout, out=out))
    stages["dct2"] = t(lambda: dct2(tiles))
    stages["select"] = t(lambda: select(spectrum, k, "topk"))
    stages["select_lowpass"] = t(lambda: select(spectrum, k, "lowpass"))
    decoded = values.clone()

    def scatter() -> Any:
        buf = torch.zeros((n, layout.tile_numel), dtype=tiles.dtype, device=device)
        return buf.scatter_add_(1, positions, decoded)

    dense = scatter().view(n, r, c)
    stages["scatter"] = t(scatter)
    stages["idct2"] = t(lambda: idct2(dense))
    stages["from_tiles"] = t(lambda: from_tiles(tiles, layout))
    stages["decode"] = t(lambda: from_tiles(idct2(scatter().view(n, r, c)), layout))

    # the matrix-layout transform the stages run: on the tensor's own Rp x Cp matrix, into a
    # preallocated output and scratch (the stages' workspace), the padding buffer zeroed once
    matrix_shape = (layout.padded_rows, layout.padded_cols)
    coefficients, scratch, restored = (torch.empty(matrix_shape, dtype=x.dtype, device=device) for _ in range(3))
    exact = matrix_shape == (layout.rows, layout.cols)
    padded = None if exact else torch.zeros(matrix_shape, dtype=x.dtype, device=device)
    accumulate_spectrum(x, layout, coefficients, 0.0, scratch, padded)
    if not torch.allclose(tile_view(coefficients, layout).reshape(n, r, c), spectrum, rtol=1e-4, atol=1e-4):
        raise SystemExit(f"{name} {shape}: accumulate_spectrum differs from dct2 of the tiles")
    matrix = {
        "transform": t(lambda: accumulate_spectrum(x, layout, coefficients, 0.0, scratch, padded)),
        "inverse": t(lambda: inverse_spectrum(coefficients, layout, restored, scratch)),
    }

    # floors: the dct2's two GEMMs bare, and one square matmul of the same FLOPs (scaled to them)
    # (written into preallocated outputs: arithmetic only, no allocation)
    basis_t = dct_basis(c, tiles.dtype, device).T.contiguous()
    half, full = torch.empty_like(tiles), torch.empty_like(tiles)
    stages["dct2_gemms"] = t(lambda: torch.matmul(torch.matmul(tiles, basis_t, out=half), basis_t, out=full))
    side = max(64, round((flops / 2) ** (1 / 3)))
    a = torch.randn((side, side), generator=gen).to(device)
    b = torch.randn((side, side), generator=gen).to(device)
    product = torch.empty((side, side), device=device)
    single = t(lambda: torch.matmul(a, b, out=product))
    scale = flops / (2 * side**3)
    stages["matmul_floor"] = {**single, "median_s": single["median_s"] * scale, "iqr_s": single["iqr_s"] * scale}

    transforms = time_transforms(x, layout, args, t, device)

    formats: dict[str, dict[str, Any]] = {}
    for fmt in args.formats:
        buf, _ = pack_segment(positions, values, layout.tile_numel, fmt)
        mean = CompressedMean(CodecConfig(chunk=args.chunk, topk=args.topk, value_format=fmt, dense_below=0), Communicator())
        formats[fmt] = {
            "payload_bytes": int(buf.numel()),
            "pack": t(lambda fmt=fmt: pack_segment(positions, values, layout.tile_numel, fmt)),
            "unpack": t(lambda fmt=fmt, buf=buf: unpack_segment(buf, n, k, layout.tile_numel, fmt, True)),
            "step": t(lambda mean=mean: mean([x], "bench")),
        }
        formats[fmt]["in_step"] = step_breakdown(mean, x, formats[fmt]["step"]["median_s"], args.min_run_time, device)
    return {
        "name": name, "shape": list(shape), "numel": numel, "tiles": n, "tile_shape": [r, c], "k": k,
        "dct2_flops": flops, "floor_matmul_side": side, "stages": stages, "matrix_layout": matrix, "formats": formats,
        "transforms": transforms,
    }


def time_transforms(x: Any, layout: Any, args: argparse.Namespace, t: Callable[[Callable[[], Any]], dict[str, float]],
                    device: Any) -> dict[str, dict[str, Any]]:
    """Per transform: forward at decay 0, the momentum update at decay 0.99, the inverse, and the
    whole ``CompressedMean`` call (W = 1, the first of ``--formats``), each checked first against the
    tile-major product of :func:`demo_lightning.codec.tile_transform`."""
    import torch

    from demo_lightning.algorithms.compressed_mean import CodecConfig, CompressedMean
    from demo_lightning.codec import tile_transform, to_tiles
    from demo_lightning.codec.transform import accumulate_spectrum, inverse_spectrum, tile_view
    from demo_lightning.comm import Communicator

    matrix_shape = (layout.padded_rows, layout.padded_cols)
    exact = matrix_shape == (layout.rows, layout.cols)
    fmt = args.formats[0]
    out: dict[str, dict[str, Any]] = {}
    for name in args.transforms:
        coefficients, scratch, restored = (torch.empty(matrix_shape, dtype=x.dtype, device=device) for _ in range(3))
        padded = None if exact else torch.zeros(matrix_shape, dtype=x.dtype, device=device)
        accumulate_spectrum(x, layout, coefficients, 0.0, scratch, padded, transform=name)
        reference = tile_transform(to_tiles(x, layout), name)
        if not torch.allclose(tile_view(coefficients, layout).reshape(reference.shape), reference, rtol=1e-4, atol=1e-4):
            raise SystemExit(f"transform {name!r} {tuple(x.shape)}: accumulate_spectrum differs from the tile-major product")
        momentum = coefficients.clone()
        mean = CompressedMean(CodecConfig(chunk=args.chunk, topk=args.topk, value_format=fmt, dense_below=0, transform=name),
                              Communicator())
        out[name] = {
            "format": fmt,
            "transform": t(lambda: accumulate_spectrum(x, layout, coefficients, 0.0, scratch, padded, transform=name)),
            "momentum": t(lambda: accumulate_spectrum(x, layout, momentum, 0.99, scratch, padded, transform=name)),
            "inverse": t(lambda: inverse_spectrum(coefficients, layout, restored, scratch, transform=name)),
            "step": t(lambda mean=mean: mean([x], "bench")),
        }
    return out


ISOLATED = ("to_tiles", "dct2", "transform", "select", "select_lowpass", "scatter", "idct2", "inverse", "from_tiles", "decode")
MATRIX = ("transform", "inverse")  # rec["matrix_layout"]; the rest are rec["stages"]
IN_STEP = ("transform", "select", "pack", "unpack", "scatter-add", "inverse")


def in_step_ranges() -> dict[str, str]:
    """Column -> the stage range of ``CompressedMean`` it reads (:mod:`demo_lightning.profiling`)."""
    from demo_lightning.profiling import CODEC

    return {"transform": CODEC.transform, "select": CODEC.select, "pack": CODEC.pack, "unpack": CODEC.unpack,
            "scatter-add": CODEC.scatter_add, "inverse": CODEC.inverse}


def step_breakdown(mean: Any, x: Any, step_s: float, min_run_time: float, device: Any) -> dict[str, Any]:
    """Seconds per step spent in each stage inside a real ``CompressedMean`` call.

    Read from the stage ranges ``CompressedMean`` opens (``codec/encode/transform``, ...; see
    :func:`in_step_ranges`) through :func:`demo_lightning.profiling.measure_stages` (on GPUs with a
    device synchronisation at every range's entry and exit), so each stage is timed in context: with
    the caches and allocations a step really has, not with hot, reused inputs as in the isolated
    timings. Times are exclusive: a range opened inside another counts for itself only (the
    contributions are unpacked inside ``codec/decode/scatter_add`` as the sums draw them, so
    scatter-add is the sums less the unpacking). "rest" is the step's time outside these six ranges
    (the plan lookup, the dense group, allocating the spectra, the collectives' launches and waits,
    zeroing the spectra and copying the sent values in, the ledger, the ranges' own cost). Minor page
    faults per step are counted too: freshly allocated temporaries that the allocator had given back
    to the operating system are faulted in again, page by page.
    """
    import torch

    from demo_lightning.profiling import measure_stages

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    ranges = in_step_ranges()
    reps = max(3, math.ceil(min_run_time / max(step_s, 1e-9)))
    with measure_stages(sync) as times:
        mean([x], "bench")  # warm-up
        missing = [name for column, name in ranges.items() if column in ("transform", "select", "inverse") and not times.calls.get(name)]
        if missing:
            raise SystemExit(f"CompressedMean never opened the stage range(s) {missing}: have its ranges been renamed?")
        times.reset()
        if sync is not None:
            sync()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for _ in range(reps):
            mean([x], "bench")
        if sync is not None:
            sync()
        total = (time.perf_counter() - start) / reps
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / reps
    parts = {column: times.seconds(name, exclusive=True) / reps for column, name in ranges.items()}
    parts["rest"] = total - sum(parts.values())
    return {"steps": reps, "step_s": total, "parts_s": parts, "minor_page_faults": faults,
            "ranges": {column: ranges[column] for column in IN_STEP}}


def derive(rec: dict[str, Any]) -> None:
    """Add multiples of the floor, throughputs, the isolated-stage model of a step and its dominant stage."""
    s = {key: v["median_s"] for key, v in (*rec["stages"].items(), *rec["matrix_layout"].items())}
    floor = s["matmul_floor"]
    rec["floor_gflops"] = rec["dct2_flops"] / floor / 1e9
    rec["dct2_gflops"] = rec["dct2_flops"] / s["dct2"] / 1e9
    rec["transform_gflops"] = rec["dct2_flops"] / s["transform"] / 1e9
    rec["x_floor"] = {key: v / floor for key, v in s.items()}
    rec["elements_per_s"] = {key: rec["numel"] / v for key, v in s.items()}
    for f in rec["formats"].values():
        # the step runs every stage once, but decodes twice (what it sent, and the mean)
        isolated = {
            "transform": s["transform"], "select": s["select"], "pack": f["pack"]["median_s"],
            "unpack": f["unpack"]["median_s"], "scatter": 2 * s["scatter"], "inverse": 2 * s["inverse"],
        }
        f["isolated_s"] = isolated
        f["isolated_sum_s"] = sum(isolated.values())
        inside = f["in_step"]["parts_s"]
        f["in_step"]["share"] = {key: v / f["in_step"]["step_s"] for key, v in inside.items()}
        top = max(inside, key=inside.get)
        f["dominant"] = {"stage": top, "seconds": inside[top], "share_of_step": f["in_step"]["share"][top]}
        f["x_floor"] = {key: f[key]["median_s"] / floor for key in ("pack", "unpack", "step")}
        f["in_step"]["x_floor"] = {key: v / floor for key, v in inside.items()}
        f["elements_per_s"] = {key: rec["numel"] / f[key]["median_s"] for key in ("pack", "unpack", "step")}


# ----------------------------------------------------------------------------------------- bytes
def byte_table(args: argparse.Namespace) -> dict[str, Any]:
    """Closed-form bytes per worker per step for the bundled GPT, checked against a real call's ledger."""
    import torch

    from demo_lightning.algorithms.compressed_mean import CodecConfig, CompressedMean
    from demo_lightning.comm import Communicator, ddp_bytes_per_step, ring_all_gather_bytes, ring_all_reduce_bytes
    from demo_lightning.models import GPT

    torch.manual_seed(0)
    model = GPT()
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights once
    n_trainable = sum(p.numel() for p in params)
    defaults = CodecConfig()  # the dense rule and format the codec exchange uses unless told otherwise
    methods: dict[str, dict[str, Any]] = {}
    configs = {f"topk {fmt}": CodecConfig(chunk=args.chunk, topk=args.topk, value_format=fmt) for fmt in FORMATS}
    configs.update({
        f"lowpass {fmt}": CodecConfig(chunk=args.chunk, topk=args.topk, selection="lowpass", value_format=fmt)
        for fmt in ("bf16", "fp32")
    })
    momenta = [torch.randn(p.shape) for p in params]
    for label, cfg in configs.items():
        mean = CompressedMean(cfg, Communicator())
        dense = sum(cfg.dense_nbytes(p.numel()) for p in params if cfg.layout(tuple(p.shape))[0] is None)
        payload = sum(cfg.payload_bytes(tuple(p.shape)) for p in params if cfg.layout(tuple(p.shape))[0] is not None)
        ledger = mean.comm.ledger  # what a real call hands to the collectives (W = 1: recorded, not sent)
        ledger.begin_step()
        mean(momenta, "gpt")
        ledger.end_step(0.0)
        recorded = {"all_gather": 0, "all_reduce_codec": 0, "all_reduce_dense": 0}
        for rec in ledger.step_records:
            if rec.op == "all_gather":
                recorded["all_gather"] += rec.payload_bytes
            else:
                recorded["all_reduce_dense" if rec.tag.endswith("/dense") else "all_reduce_codec"] += rec.payload_bytes
        op = "all_reduce" if cfg.all_reduces else "all_gather"
        expected = {"all_gather": payload if op == "all_gather" else 0,
                    "all_reduce_codec": payload if op == "all_reduce" else 0, "all_reduce_dense": dense}
        if recorded != expected:
            raise SystemExit(f"{label}: closed-form payloads {expected} differ from the ledger's {recorded}")
        methods[label] = {"op": op, "payload_bytes": payload, "dense_bytes": dense, "ledger_payloads": recorded}

    def per_worker(label: str, world: int) -> float:
        m = methods[label]
        codec = (ring_all_gather_bytes if m["op"] == "all_gather" else ring_all_reduce_bytes)(m["payload_bytes"], world)
        return codec + ring_all_reduce_bytes(m["dense_bytes"], world)

    rows = []
    for world in WORLD_SIZES:
        row: dict[str, Any] = {"world_size": world}
        ddp = ddp_bytes_per_step(n_trainable, world)
        row["ddp"] = {"sent": ddp, "received": ddp}
        for label in methods:
            b = per_worker(label, world)  # ring models: every worker sends what it receives
            row[label] = {"sent": b, "received": b, "ratio_vs_ddp": ddp / b}
        rows.append(row)

    crossover: dict[str, Any] = {}
    for label, m in methods.items():
        if m["op"] == "all_reduce":  # both sides scale with 2 (W - 1) / W: a constant ratio, no crossover
            crossover[label] = {"world_size": None, "ratio_vs_ddp": 4 * n_trainable / (m["payload_bytes"] + m["dense_bytes"])}
            continue
        # (W-1) P + 2 (W-1)/W D > 2 (W-1)/W 4 N  <=>  W > 2 (4 N - D) / P   (W > 1)
        bound = 2 * (4 * n_trainable - m["dense_bytes"]) / m["payload_bytes"]
        world = math.floor(bound) + 1
        assert per_worker(label, world) > ddp_bytes_per_step(n_trainable, world)
        assert per_worker(label, world - 1) <= ddp_bytes_per_step(n_trainable, world - 1)
        crossover[label] = {"world_size": world, "closed_form_bound": bound}
    return {
        "model": "demo_lightning.models.GPT() (vocab 256, block 128, d_model 192, 4 layers, 4 heads; head tied to tok)",
        "n_trainable": n_trainable, "n_tensors": len(params),
        "n_dense_tensors": sum(1 for p in params if defaults.sends_densely(tuple(p.shape))),
        "dense_format": defaults.dense_format, "position_format": configs["topk sign"].position_format,
        "chunk": args.chunk, "topk": args.topk, "methods": methods, "rows": rows, "crossover": crossover,
        "note": "per worker per step of the codec exchange (compressed tensors plus the all-reduce, in the codec's "
                "dense_format, of the tensors it sends densely: under dense_below, and the 1-D ones); DeMoStrategy's non-finite guard adds an all-gather of 9 bytes (a flag byte and the plan digest: 9 (W - 1) bytes per worker)",
    }


# ---------------------------------------------------------------------------------------- render
def _ms(seconds: float) -> str:
    ms = 1000 * seconds
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def _cell(rec: dict[str, Any], key: str, fmt: str | None = None) -> str:
    src = rec["formats"][fmt] if fmt else rec["matrix_layout"] if key in MATRIX else rec["stages"]
    ratio = (rec["formats"][fmt]["x_floor"] if fmt else rec["x_floor"])[key]
    return f"{_ms(src[key]['median_s'])} ({ratio:.1f}x)"


def _mps(x: float) -> str:
    return f"{x / 1e6:,.0f}" if x >= 1e7 else f"{x / 1e6:.1f}"


def render(result: dict[str, Any]) -> str:
    meta, recs, nb = result["meta"], result["timings"], result["bytes"]
    fmts = meta["formats"]
    if any("matrix_layout" not in r for r in recs):
        raise SystemExit("these timings predate the staged exchange (no matrix-layout transform, old in-step columns): "
                         "rerun benchmarks/codec.py instead of --render-only")
    lines = [
        f"Command: `{meta['command']}` — {meta['date']}, {meta['machine']}, device {meta['device']}, "
        f"{meta['threads']} thread(s), torch {meta['torch']}. Load average (1/5/15 min) at start "
        f"{meta['loadavg_start']}, at end {meta['loadavg_end']}. chunk {meta['chunk']}, topk {meta['topk']}, "
        f"median of `torch.utils.benchmark.Timer.blocked_autorange(min_run_time={meta['min_run_time']})`.",
        "",
        "### Stage times, ms (multiple of the arithmetic floor)",
        "",
        "Floor: one square `torch.matmul` with the FLOPs of `dct2` (256 per element for 64x64 tiles), scaled to "
        "exactly those FLOPs; \"dct2 GEMMs\": the same two `(T, 64, 64) @ (64, 64)` GEMMs as `dct2`, bare; both into "
        "preallocated outputs (arithmetic only). Tile-major codec functions (`to_tiles`, `dct2`, `idct2`, `from_tiles`) "
        "allocate their results; decode = `scatter_add_` into zeroed tiles + `idct2` + `from_tiles`. "
        "transform / inverse: the matrix-layout DCT the exchange's stages run (`accumulate_spectrum` with decay 0, "
        "`inverse_spectrum`) on the tensor's own padded matrix, no tile copies, into a preallocated output and scratch "
        "as the stages' workspace gives them.",
        "",
        "| tensor | shape | tiles | floor (GFLOP/s) | dct2 GEMMs | to_tiles | dct2 (tile-major) | transform (matrix) "
        "| select top-k | select low-pass | scatter | idct2 | inverse (matrix) | from_tiles | decode |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        lines.append(
            f"| {r['name']} | {'x'.join(map(str, r['shape']))} | {r['tiles']:,} | "
            f"{_ms(r['stages']['matmul_floor']['median_s'])} ({r['floor_gflops']:.1f}) | {_cell(r, 'dct2_gemms')} | "
            + " | ".join(_cell(r, key) for key in ISOLATED)
            + " |"
        )
    lines += [
        "",
        "### Per value format: pack and unpack alone, and the whole `CompressedMean` step at W = 1, "
        "ms (multiple of the floor)",
        "",
        "isolated sum = transform + select + pack + unpack + 2 x (scatter + inverse), each timed alone with hot, reused "
        "inputs (matrix-layout transform; the step decodes twice: the mean and what it sent).",
        "",
        "| tensor | format | bytes / worker | pack | unpack | step | step M elem/s | isolated sum | step / isolated sum |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        for fmt in fmts:
            f = r["formats"][fmt]
            lines.append(
                f"| {r['name']} | {fmt} | {f['payload_bytes']:,} | {_cell(r, 'pack', fmt)} | {_cell(r, 'unpack', fmt)} | "
                f"{_cell(r, 'step', fmt)} | {_mps(f['elements_per_s']['step'])} | {_ms(f['isolated_sum_s'])} | "
                f"{f['step']['median_s'] / f['isolated_sum_s']:.2f} |"
            )
    lines += [
        "",
        "### Inside the step: time per stage in a real `CompressedMean` call, ms (share of the step)",
        "",
        "Exclusive times of the stage ranges `CompressedMean` opens (`demo_lightning.profiling.measure_stages`): "
        "transform = `codec/encode/transform`, select = `codec/encode/select`, pack = `codec/transport/pack` "
        "(`pack_segments` / `saturate`), unpack = `codec/transport/unpack` (`unpack_segments`), scatter-add = "
        "`codec/decode/scatter_add` (`index_add_` into the mean's spectra, less the unpacking inside it), inverse = "
        "`codec/decode/inverse` (`inverse_spectrum` and the outputs' copies); one forward and two inverse transforms "
        "per tensor (the mean, and what this worker sent). rest = the step outside those ranges (dense group, "
        "allocating and zeroing the spectra, collectives, copying the sent values in, ledger, the ranges' own cost); "
        "faults: minor page faults per step (4 KiB pages of temporaries the allocator had returned to the system).",
        "",
        "| tensor | format | step | transform | select | pack | unpack | scatter-add | inverse | rest | dominant | faults |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        for fmt in fmts:
            f = r["formats"][fmt]["in_step"]
            d = r["formats"][fmt]["dominant"]
            lines.append(
                f"| {r['name']} | {fmt} | {_ms(f['step_s'])} | "
                + " | ".join(f"{_ms(f['parts_s'][key])} ({100 * f['share'][key]:.0f} %)" for key in (*IN_STEP, "rest"))
                + f" | {d['stage']} | {f['minor_page_faults']:,.0f} |"
            )
    keys = ("matmul_floor", "dct2_gemms", "to_tiles", "dct2", "transform", "select", "scatter", "idct2", "inverse", "from_tiles")
    lines += [
        "",
        "### Throughput, million elements per second (of the tensor, padding not counted)",
        "",
        "| tensor | floor | dct2 GEMMs | to_tiles | dct2 | transform | select top-k | scatter | idct2 | inverse | from_tiles | "
        + " | ".join(f"pack {f}" for f in fmts) + " | " + " | ".join(f"unpack {f}" for f in fmts) + " | "
        + " | ".join(f"step {f}" for f in fmts) + " |",
        "|---|" + "---|" * (len(keys) + 3 * len(fmts)),
    ]
    for r in recs:
        cells = [_mps(r["elements_per_s"][key]) for key in keys]
        for what in ("pack", "unpack", "step"):
            cells += [_mps(r["formats"][f]["elements_per_s"][what]) for f in fmts]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")

    lines += render_transforms(recs)
    labels = list(nb["methods"])
    lines += [
        "",
        f"### Bytes per worker per step vs world size W: {nb['model']}, {nb['n_trainable']:,} trainable parameters "
        f"in {nb['n_tensors']} tensors ({nb['n_dense_tensors']} sent densely, all-reduced in {nb.get('dense_format', 'fp32')})",
        "",
        "Ring models of `demo_lightning.comm.ledger` (sent = received per worker): top-k all-gathers "
        f"`(W - 1) * payload` (positions {'Elias-Fano coded' if nb.get('position_format') == 'elias_fano' else 'at a fixed width'}), low-pass float values and DDP's fp32 gradients are all-reduced, "
        "`2 (W - 1) / W * bytes`. Payload checked against the ledger of a real `CompressedMean` call. "
        "Cells: bytes (ratio DDP / ours). " + nb["note"][0].upper() + nb["note"][1:] + ".",
        "",
        "| method | payload / worker | " + " | ".join(f"W={row['world_size']}" for row in nb["rows"]) + " | exceeds DDP from W |",
        "|---|---|" + "---|" * (len(nb["rows"]) + 1),
        "| DDP (fp32 all-reduce) | " + f"{4 * nb['n_trainable']:,} | "
        + " | ".join(f"{row['ddp']['received']:,.0f}" for row in nb["rows"]) + " | — |",
    ]
    for label in labels:
        m, cross = nb["methods"][label], nb["crossover"][label]
        when = (f"{cross['world_size']} (W > {cross['closed_form_bound']:.1f})" if cross["world_size"] is not None
                else f"never ({cross['ratio_vs_ddp']:.1f}x at every W)")
        lines.append(
            f"| {label} ({m['op'].replace('_', '-')}) | {m['payload_bytes']:,} + {m['dense_bytes']:,} dense | "
            + " | ".join(f"{row[label]['received']:,.0f} ({row[label]['ratio_vs_ddp']:.1f}x)" for row in nb["rows"])
            + f" | {when} |"
        )
    return "\n".join(lines) + "\n"


TRANSFORM_COLUMNS = ("transform", "momentum", "inverse", "step")


def render_transforms(recs: list[dict[str, Any]]) -> list[str]:
    """The per-transform table: each column's transforms side by side, and the sum over the tensors."""
    if not recs or "transforms" not in recs[0]:
        return []
    names = list(recs[0]["transforms"])
    fmt = recs[0]["transforms"][names[0]]["format"]
    lines = [
        "",
        "### Per transform: forward, momentum update, inverse and the whole `CompressedMean` step, ms",
        "",
        "forward = `accumulate_spectrum` at decay 0; momentum = the same at decay 0.99 (`M <- 0.99 M + T(g)`, the DeMo "
        f"step's update); inverse = `inverse_spectrum`; step = `CompressedMean` at W = 1 with {fmt} values (one forward, "
        "two inverses). DCT and Haar: the same two GEMMs with another dense basis; identity: no GEMM. "
        "Cells: " + " / ".join(names) + " (the last column: " + names[0] + " over each other transform, for the step).",
        "",
        "| tensor | " + " | ".join(("forward", "momentum", "inverse", "step")) + " | step speed-up vs " + names[0] + " |",
        "|---|---|---|---|---|---|",
    ]
    totals = {n: {c: 0.0 for c in TRANSFORM_COLUMNS} for n in names}
    for r in recs:
        cells = []
        for column in TRANSFORM_COLUMNS:
            seconds = [r["transforms"][n][column]["median_s"] for n in names]
            for n, sec in zip(names, seconds):
                totals[n][column] += sec
            cells.append(" / ".join(_ms(sec) for sec in seconds))
        base = r["transforms"][names[0]]["step"]["median_s"]
        speed = " / ".join(f"{base / r['transforms'][n]['step']['median_s']:.2f}x" for n in names[1:])
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {speed} |")
    cells = [" / ".join(_ms(totals[n][c]) for n in names) for c in TRANSFORM_COLUMNS]
    speed = " / ".join(f"{totals[names[0]]['step'] / totals[n]['step']:.2f}x" for n in names[1:])
    lines.append("| **all tensors** | " + " | ".join(f"**{c}**" for c in cells) + f" | **{speed}** |")
    return lines


# ------------------------------------------------------------------------------------------ main
def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine(device: Any) -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{os.cpu_count()} CPU cores ({cpu})"
    if device.type == "cuda":
        text += f", GPU {torch.cuda.get_device_name(device)}"
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (the bundled GPT's widths) and short timings")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one thread per worker)")
    p.add_argument("--embedding-rows", type=int, default=8192, help="rows of the embedding weight (GPT-2: 50257)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated value formats")
    p.add_argument("--transforms", default="dct,haar,identity",
                   help="comma-separated tile transforms timed side by side (the first of --formats for their steps)")
    p.add_argument("--min-run-time", type=float, default=None, help="seconds per measurement (default 1.0; 0.01 with --quick)")
    p.add_argument("--out", default=str(RESULTS), help="folder for codec.json and codec.md (codec_quick.* with --quick)")
    p.add_argument("--render-only", action="store_true", help="re-render the markdown from the JSON in --out")
    args = p.parse_args(argv)
    out = Path(args.out)
    stem = "codec_quick" if args.quick else "codec"
    if args.render_only:
        result = json.loads((out / f"{stem}.json").read_text())
    else:
        import torch

        args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
        args.transforms = [f.strip() for f in args.transforms.split(",") if f.strip()]
        from demo_lightning.codec import TRANSFORMS

        unknown = [name for name in args.transforms if name not in TRANSFORMS]
        if unknown or not args.transforms:
            p.error(f"--transforms: unknown {unknown}; choose from {', '.join(TRANSFORMS)}")
        if args.min_run_time is None:
            args.min_run_time = 0.01 if args.quick else 1.0
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
        torch.set_num_threads(args.threads)
        meta = {
            "command": " ".join(["python benchmarks/codec.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(device), "device": str(device), "threads": args.threads, "torch": torch.__version__,
            "chunk": args.chunk, "topk": args.topk, "formats": args.formats, "transforms": args.transforms,
            "min_run_time": args.min_run_time,
            "quick": args.quick, "loadavg_start": loadavg(),
        }
        start = time.perf_counter()
        timings = []
        for name, shape in shapes(args.quick, args.embedding_rows):
            rec = time_tensor(name, shape, args, device)
            derive(rec)
            timings.append(rec)
            print(f"timed {name} {shape} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        meta["loadavg_end"] = loadavg()
        meta["seconds"] = round(time.perf_counter() - start, 1)
        result = {"meta": meta, "timings": timings, "bytes": byte_table(args)}
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    table = render(result)
    (out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
