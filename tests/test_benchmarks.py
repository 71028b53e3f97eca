"""The benchmark scripts run, and their closed-form figures match formulas recomputed here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from demo_lightning.models import GPT

ROOT = Path(__file__).parent.parent
FORMATS = ("sign", "bf16", "int8", "fp32")
STAGES = {
    "to_tiles", "dct2", "select", "select_lowpass", "scatter", "idct2", "from_tiles", "decode", "dct2_gemms", "matmul_floor",
}


def _topk_payload(shape: tuple[int, ...], value_format: str, chunk: int = 64, k: int = 64) -> int:
    """Bytes of one tensor's top-k segment, from the wire layout (12-bit positions, then values)."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
    tr, tc = min(chunk, rows), min(chunk, cols)
    tiles = math.ceil(rows / tr) * math.ceil(cols / tc)
    k = min(k, tr * tc)
    count = tiles * k
    positions = math.ceil(count * max(1, math.ceil(math.log2(tr * tc))) / 8)
    values = {"fp32": 4 * count, "bf16": 2 * count, "int8": 4 * tiles + count, "sign": 4 * tiles + math.ceil(count / 8)}
    return positions + values[value_format]


def test_codec_benchmark_quick_runs_and_its_byte_table_matches_the_ledger_formulas(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "codec.py"), "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "codec_quick.json").read_text())
    markdown = (tmp_path / "codec_quick.md").read_text()
    assert markdown.strip() in proc.stdout and "exceeds DDP from W" in markdown

    # every stage of every tensor was timed
    assert len(result["timings"]) == 6
    for rec in result["timings"]:
        assert set(rec["stages"]) == STAGES
        assert all(m["median_s"] > 0 for m in rec["stages"].values()), rec["name"]
        assert set(rec["formats"]) == set(FORMATS)
        for fmt in FORMATS:
            assert all(rec["formats"][fmt][key]["median_s"] > 0 for key in ("pack", "unpack", "step")), (rec["name"], fmt)

    # bytes: recomputed from the GPT's tensors, the wire layout and the ring formulas
    params = list(GPT().parameters())
    n = sum(p.numel() for p in params)
    dense = sum(4 * p.numel() for p in params if p.numel() < 4096)
    table = result["bytes"]
    assert table["n_trainable"] == n == 1_846_656
    rows = {row["world_size"]: row for row in table["rows"]}
    for fmt in FORMATS:
        label = f"topk {fmt}"
        payload = sum(_topk_payload(tuple(p.shape), fmt) for p in params if p.numel() >= 4096)
        assert table["methods"][label]["payload_bytes"] == payload and table["methods"][label]["dense_bytes"] == dense

        def topk(w: int, payload: int = payload) -> float:
            return (w - 1) * payload + 2 * (w - 1) / w * dense  # ring all-gather + ring all-reduce of the dense tensors

        def ddp(w: int) -> float:
            return 2 * (w - 1) / w * 4 * n

        for w in (8, 512):
            assert math.isclose(rows[w][label]["sent"], topk(w), rel_tol=1e-12)
            assert math.isclose(rows[w][label]["received"], topk(w), rel_tol=1e-12)
            assert math.isclose(rows[w]["ddp"]["received"], ddp(w), rel_tol=1e-12)
        cross = table["crossover"][label]["world_size"]
        assert topk(cross) > ddp(cross) and topk(cross - 1) <= ddp(cross - 1), (label, cross)
        for w, row in rows.items():
            assert (row[label]["received"] > row["ddp"]["received"]) == (w >= cross), (label, w, cross)
    # the sign default's crossover is the README's "about 2 * 4 * 4096 / 108 ~ 300 workers"
    assert 280 <= table["crossover"]["topk sign"]["world_size"] <= 310
    for fmt in ("bf16", "fp32"):  # low-pass all-reduces: a constant ratio to DDP, never crosses
        assert table["crossover"][f"lowpass {fmt}"]["world_size"] is None
        assert all(row[f"lowpass {fmt}"]["received"] < row["ddp"]["received"] for row in rows.values())
