"""benchmarks/parity.py's bookkeeping: best rates from the sweep, seed spreads, ratios and their geometric mean.

Oracle: cells written here by hand in compare.py's result format; the expected ratios and geometric
means are computed in the test from those numbers.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import parity  # noqa: E402


def _cell(out: Path, corpus: str, seed: int, method: str, lr: float, loss: float, ratio: float) -> None:
    folder = out / "cells" / parity.cell_name(corpus, "small", seed, 2, method, lr, 10)
    folder.mkdir(parents=True)
    meta = {"command": f"python benchmarks/compare.py --methods {method}", "corpus": corpus, "seed": seed, "lr": lr,
            "d_model": 128, "n_layer": 2}
    record = {"method": method, "world_size": 2, "final_val_loss": loss, "bytes_sent_per_step": 1000.0 / ratio,
              "ratio_vs_ddp": ratio, "steady_ratio_vs_ddp": None, "ddp_bytes_per_step": 1000.0, "n_trainable": 1}
    (folder / "latest.json").write_text(json.dumps({"meta": meta, "records": [record]}))


def test_render_uses_the_swept_rates_and_reports_spread_ratio_and_geometric_mean(tmp_path: Path) -> None:
    sweep = [{"method": "ddp", "lr": 1e-3, "loss": 2.0}, {"method": "ddp", "lr": 3e-3, "loss": 2.1},
             {"method": "demo-sign1bit", "lr": 1e-3, "loss": 2.3}, {"method": "demo-sign1bit", "lr": 3e-3, "loss": 2.2}]
    (tmp_path / "sweep.json").write_text(json.dumps({"corpus": "stdlib", "size": "small", "seed": 0, "world": 2, "steps": 10, "cells": sweep}))
    assert parity.best_rates(tmp_path) == {"ddp": 1e-3, "demo-sign1bit": 3e-3}
    for seed, (ddp, demo) in enumerate([(2.0, 2.04), (2.2, 2.2)]):
        _cell(tmp_path, "prose", seed, "ddp", 1e-3, ddp, 1.0)
        _cell(tmp_path, "prose", seed, "demo-sign1bit", 3e-3, demo, 120.0)
    _cell(tmp_path, "prose", 0, "demo-sign1bit", 1e-3, 9.9, 120.0)  # not the best rate: left out
    _cell(tmp_path, "cpp", 0, "ddp", 1e-3, 1.0, 1.0)
    _cell(tmp_path, "cpp", 0, "demo-sign1bit", 3e-3, 1.1, 90.0)
    _cell(tmp_path, "stdlib", 0, "ddp", 1e-3, 2.0, 1.0)  # the tuning corpus: in the table, not in the mean
    _cell(tmp_path, "stdlib", 0, "demo-sign1bit", 3e-3, 3.0, 120.0)
    parity.render(type("Args", (), {"out": str(tmp_path)})())
    table = (tmp_path / "latest.md").read_text()
    prose = next(line for line in table.splitlines() if line.startswith("| prose") and "demo-sign1bit" in line)
    assert "| 2 | 2.1200 (2.0400-2.2000) | 1.0100 (1.0000-1.0200)x | 120x | met |" in prose
    cpp = next(line for line in table.splitlines() if line.startswith("| cpp") and "demo-sign1bit" in line)
    assert "1.1000x | 90x | missed |" in cpp  # 10 % worse, and fewer than 100x
    geo = math.exp((math.log(1.02) + math.log(1.0) + math.log(1.1)) / 3)
    assert f"- demo-sign1bit: {geo:.4f}x over 3 runs" in table
    assert "| demo-sign1bit | 0.003 | 2.2000 | yes |" in (tmp_path / "sweep.md").read_text()
    # rates given to `run --lr` replace the sweep's in the report (the cells exist, so nothing runs)
    parity.main(["run", "--corpora", "prose", "--seeds", "0", "--methods", "demo-sign1bit", "--lr", "demo-sign1bit=0.001",
                 "--steps", "10", "--out", str(tmp_path)])
    table = (tmp_path / "latest.md").read_text()
    assert "| prose | small | 2 | demo-sign1bit | 0.001 | 1 | 9.9000 |" in table


def test_run_without_a_sweep_or_rates_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="run `benchmarks/parity.py sweep` first"):
        parity.main(["run", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as info:
        parity.main(["run", "--sizes", "huge", "--out", str(tmp_path)])
    assert info.value.code == 2  # argparse's usage error (--sizes: unknown ['huge']), before any sweep is read
