"""Elias-Fano positions against fixed-width ones: bits, the bundled GPTs' bytes per step, and the codec's cost.

    .venv/bin/python benchmarks/positions.py            # about a minute on 2 cores
    .venv/bin/python benchmarks/positions.py --quick    # shorter timings

Part 1: bits a position in a 64 x 64 tile at several k, for ``position_format="packed"`` and
``"elias_fano"`` (:mod:`demo_lightning.codec.positions`), against the information-theoretic
minimum ``log2 C(4096, k) / k``.

Part 2: the bundled GPTs (``parity.py``'s sizes: small, d_model 128 x 2 blocks, 0.44 M; medium, the
main job's 192 x 4, 1.8 M) at W = 2, 4 and 8 with the default k of W workers
(:func:`~demo_lightning.algorithms.config.default_topk`) and the early phase's 256 a tile: each
worker's bytes per step by the ledger's ring models (the all-gathered payloads, ``CodecConfig.payload_bytes``
per compressed tensor, plus the bf16 all-reduce of the dense ones), and DDP's over them; then the
bytes of a 520-step run with the default early phase (:func:`~demo_lightning.algorithms.demo.default_early_steps`
exchanges of 256 a tile). The payloads are checked against a real ``CompressedMean`` call's ledger.

Part 3: the cost: ``pack_segments`` + ``unpack_segments`` of the medium GPT's compressed tensors
(one segment per tensor, sign values, k 32), packed and Elias-Fano, timed side by side in one run
(``torch.utils.benchmark``, after a warm-up of both, three interleaved rounds, the best median of
``blocked_autorange`` each, one thread); the ratio is the figure, not the milliseconds (a shared machine).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.utils.benchmark as benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo_lightning.algorithms.compressed_mean import CompressedMean  # noqa: E402
from demo_lightning.algorithms.config import CodecConfig, default_topk  # noqa: E402
from demo_lightning.algorithms.demo import DEFAULT_EARLY_TOPK, default_early_steps  # noqa: E402
from demo_lightning.codec import elias_fano_bits, index_bits, pack_segments, position_bits, unpack_segments  # noqa: E402
from demo_lightning.comm import Communicator, ddp_bytes_per_step, ring_all_gather_bytes, ring_all_reduce_bytes  # noqa: E402
from demo_lightning.models import GPT  # noqa: E402

SIZES = {"small (0.44 M)": (128, 2), "medium (1.8 M)": (192, 4)}
FORMATS = ("packed", "elias_fano")
STEPS = 520


def bits_table() -> list[str]:
    n = 64 * 64
    lines = ["| k of 4,096 | packed | Elias-Fano | minimum, log2 C(n, k) / k |", "|---|---|---|---|"]
    for k in (1, 8, 16, 32, 64, 128, 256):
        ef = elias_fano_bits(k, n) / k
        used = position_bits(k, n, "elias_fano") / k
        note = "" if used == ef else f" (the fixed width is kept: {used:g})"
        lines.append(f"| {k} | {index_bits(n)} | {ef:.2f}{note} | {math.log2(math.comb(n, k)) / k:.2f} |")
    return lines


def _payloads(params: list[torch.Tensor], cfg: CodecConfig) -> tuple[int, int]:
    """(all-gathered payload, dense bytes) per worker, closed form, checked against a real call's ledger."""
    compressed = [p for p in params if cfg.layout(tuple(p.shape))[0] is not None]
    payload = sum(cfg.payload_bytes(tuple(p.shape)) for p in compressed)
    dense = sum(cfg.dense_nbytes(p.numel()) for p in params if cfg.layout(tuple(p.shape))[0] is None)
    mean = CompressedMean(cfg, Communicator())
    mean.comm.ledger.begin_step()
    mean([torch.randn(p.shape) for p in params], "t")
    mean.comm.ledger.end_step(0.0)
    gathered = sum(r.payload_bytes for r in mean.comm.ledger.step_records if r.op == "all_gather")
    if gathered != payload:
        raise SystemExit(f"closed-form payload {payload} differs from the ledger's {gathered}")
    return payload, dense


def bytes_table() -> list[str]:
    lines = ["| GPT | W | k | DDP / packed, steady | DDP / Elias-Fano, steady | over 520 steps: packed | Elias-Fano | early phase |",
             "|---|---|---|---|---|---|---|---|"]
    for label, (d_model, n_layer) in SIZES.items():
        torch.manual_seed(0)
        params = [p for p in GPT(d_model=d_model, n_layer=n_layer).parameters() if p.requires_grad]
        n = sum(p.numel() for p in params)
        for world in (2, 4, 8):
            k, early = default_topk(world), default_early_steps(world)
            ddp = ddp_bytes_per_step(n, world)
            cells = []
            for fmt in FORMATS:
                per_step = {}
                for kk in (k, DEFAULT_EARLY_TOPK):
                    payload, dense = _payloads(params, CodecConfig(topk=kk, position_format=fmt))  # type: ignore[arg-type]
                    per_step[kk] = ring_all_gather_bytes(payload, world) + ring_all_reduce_bytes(dense, world)
                run = early * per_step[DEFAULT_EARLY_TOPK] + (STEPS - early) * per_step[k]
                cells.append((ddp / per_step[k], STEPS * ddp / run))
            lines.append(f"| {label} | {world} | {k} | {cells[0][0]:.1f}x | {cells[1][0]:.1f}x | {cells[0][1]:.1f}x | "
                         f"{cells[1][1]:.1f}x | {early} x 256 |")
    return lines


def timing_table(min_run_time: float) -> list[str]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = [p for p in GPT().parameters() if p.requires_grad]
    cfg = CodecConfig(topk=32)
    tiles = [cfg.layout(tuple(p.shape))[0] for p in params]
    counts = tuple(t.n_tiles for t in tiles if t is not None and t.tile_numel == 4096)  # the 64 x 64 tiles' tensors
    rows = sum(counts)
    gen = torch.Generator().manual_seed(0)
    positions = torch.stack([torch.randperm(4096, generator=gen)[:32] for _ in range(rows)])  # the selection's order: the packer sorts
    values = torch.randn(rows, 32, generator=gen)
    out: dict[str, dict[str, float]] = {fmt: {} for fmt in FORMATS}
    timers = {}
    for fmt in FORMATS:
        buf, _ = pack_segments(positions, values, counts, 4096, "sign", position_format=fmt)
        out[fmt]["bytes"] = buf.numel()
        timers[fmt] = {
            "pack": benchmark.Timer("pack_segments(p, v, c, 4096, 'sign', position_format=f)",
                                    globals={"pack_segments": pack_segments, "p": positions, "v": values, "c": counts, "f": fmt}),
            "unpack": benchmark.Timer("unpack_segments(b, c, 32, 4096, 'sign', True, position_format=f)",
                                      globals={"unpack_segments": unpack_segments, "b": buf, "c": counts, "f": fmt}),
        }
        for t in timers[fmt].values():
            t.timeit(20)  # warm-up: caches and allocator, for both formats before any measurement
    for _ in range(3):  # interleaved rounds, the best median of each: the machine's load falls on both alike
        for fmt in FORMATS:
            for name, t in timers[fmt].items():
                median = t.blocked_autorange(min_run_time=min_run_time).median
                out[fmt][name] = min(out[fmt].get(name, math.inf), median)
    lines = [f"{rows} tiles of 64 x 64 in {len(counts)} segments (the medium GPT's tensors), k 32, sign values, 1 thread:", "",
             "| | packed | Elias-Fano | Elias-Fano / packed |", "|---|---|---|---|"]
    for name in ("pack", "unpack"):
        a, b = out["packed"][name], out["elias_fano"][name]
        lines.append(f"| {name} | {a * 1e3:.3f} ms | {b * 1e3:.3f} ms | {b / a:.2f}x |")
    lines.append(f"| bytes | {out['packed']['bytes']:,} | {out['elias_fano']['bytes']:,} | {out['elias_fano']['bytes'] / out['packed']['bytes']:.3f}x |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter timings")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "positions.md"))
    args = p.parse_args(argv)
    text = ["# Elias-Fano positions against fixed-width ones", "", "`python benchmarks/positions.py`", "",
            "## Bits a position, 64 x 64 tile", "", *bits_table(), "",
            "## The bundled GPTs: DDP's bytes per step over each worker's (ring models, default k of W workers)", "",
            *bytes_table(), "", "## Cost: pack and unpack, side by side", "", *timing_table(0.05 if args.quick else 0.5), ""]
    Path(args.out).write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
