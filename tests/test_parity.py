"""benchmarks/parity.py's bookkeeping: best rates from the sweep, seed spreads, ratios and their geometric mean.

Oracle: cells written here by hand in compare.py's result format; the expected ratios and geometric
means are computed in the test from those numbers.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import parity  # noqa: E402


def _write_cell(out: Path, corpus: str, seed: int, world: int, method: str, lr: float, loss: float, ratio: float,
                options: tuple[str, ...] = (), steps: int = 10, position_format: str | None = None) -> None:
    folder = out / "cells" / parity.cell_name(corpus, "small", seed, world, method, lr, steps, options)
    folder.mkdir(parents=True)
    meta = {"command": f"python benchmarks/compare.py --methods {method}", "corpus": corpus, "seed": seed, "lr": lr,
            "d_model": 128, "n_layer": 2, "steps": steps, "demo_clip_grad_norm_default": 1.0}  # as compare.py records today
    record = {"method": method, "world_size": world, "final_val_loss": loss, "bytes_sent_per_step": 1000.0 / ratio,
              "ratio_vs_ddp": ratio, "steady_ratio_vs_ddp": None, "ddp_bytes_per_step": 1000.0, "n_trainable": 1,
              **({"options": list(options)} if options else {}),
              **({"position_format": position_format} if position_format else {})}
    (folder / "latest.json").write_text(json.dumps({"meta": meta, "records": [record]}))


def _cell(out: Path, corpus: str, seed: int, method: str, lr: float, loss: float, ratio: float) -> None:
    _write_cell(out, corpus, seed, 2, method, lr, loss, ratio)


def test_render_uses_the_swept_rates_and_reports_spread_ratio_and_geometric_mean(tmp_path: Path) -> None:
    sweep = [{"method": "ddp", "lr": 1e-3, "loss": 2.0}, {"method": "ddp", "lr": 3e-3, "loss": 2.1},
             {"method": "demo-default", "lr": 1e-3, "loss": 2.3}, {"method": "demo-default", "lr": 3e-3, "loss": 2.2}]
    (tmp_path / "sweep.json").write_text(json.dumps({"corpus": "stdlib", "size": "small", "seed": 0, "world": 2, "steps": 10, "cells": sweep}))
    assert parity.best_rates(tmp_path) == {"ddp": 1e-3, "demo-default": 3e-3}
    for seed, (ddp, demo) in enumerate([(2.0, 2.04), (2.2, 2.2)]):
        _cell(tmp_path, "prose", seed, "ddp", 1e-3, ddp, 1.0)
        _cell(tmp_path, "prose", seed, "demo-default", 3e-3, demo, 120.0)
    _cell(tmp_path, "prose", 0, "demo-default", 1e-3, 9.9, 120.0)  # not the best rate: left out
    _cell(tmp_path, "cpp", 0, "ddp", 1e-3, 1.0, 1.0)
    _cell(tmp_path, "cpp", 0, "demo-default", 3e-3, 1.1, 90.0)
    _cell(tmp_path, "stdlib", 0, "ddp", 1e-3, 2.0, 1.0)  # the tuning corpus: in the table, not in the mean
    _cell(tmp_path, "stdlib", 0, "demo-default", 3e-3, 3.0, 120.0)
    parity.render(type("Args", (), {"out": str(tmp_path)})())
    table = (tmp_path / "latest.md").read_text()
    prose = next(line for line in table.splitlines() if line.startswith("| prose") and "demo-default" in line)
    assert "| 2 | 2.1200 (2.0400-2.2000) | 1.0100 (1.0000-1.0200)x | 120x | met |" in prose
    cpp = next(line for line in table.splitlines() if line.startswith("| cpp") and "demo-default" in line)
    assert "1.1000x | 90x | missed |" in cpp  # 10 % worse, and fewer than 100x
    geo = math.exp((math.log(1.02) + math.log(1.0) + math.log(1.1)) / 3)
    assert f"- demo-default: {geo:.4f}x over 3 runs" in table
    assert "| demo-default | 0.003 | 2.2000 | yes |" in (tmp_path / "sweep.md").read_text()
    # rates given to `run --lr` replace the sweep's in the report (the cells exist, so nothing runs)
    parity.main(["run", "--corpora", "prose", "--seeds", "0", "--methods", "demo-default", "--lr", "demo-default=0.001",
                 "--steps", "10", "--out", str(tmp_path)])
    table = (tmp_path / "latest.md").read_text()
    assert "| prose | small | 2 | demo-default | 0.001 | 1 | 9.9000 |" in table


def test_a_sweep_over_seeds_chooses_by_the_mean_and_adds_to_the_earlier_sweep(tmp_path: Path) -> None:
    # seed 0 alone prefers 2e-3 for ddp; over seeds 0-2 the mean prefers 1e-3 (2.1 against 2.2)
    losses = {("ddp", 1e-3): [2.2, 2.0, 2.1], ("ddp", 2e-3): [2.0, 2.3, 2.3], ("demo-default", 1e-3): [2.5, 2.4, 2.6],
              ("demo-default", 2e-3): [2.4, 2.4, 2.4]}
    for (method, lr), by_seed in losses.items():
        for seed, loss in enumerate(by_seed):
            _cell(tmp_path, "stdlib", seed, method, lr, loss, 1.0)
    _cell(tmp_path, "stdlib", 0, "ddp", 3e-3, 1.5, 1.0)  # the lowest loss, but at one seed only: listed, not chosen
    _cell(tmp_path, "stdlib", 0, "demo-default", 3e-3, 2.45, 1.0)
    sweep = ["sweep", "--methods", "ddp,demo-default", "--steps", "10", "--out", str(tmp_path)]
    parity.main([*sweep, "--lrs", "1e-3,2e-3,3e-3", "--seed", "0"])  # the cells exist: nothing runs
    assert parity.best_rates(tmp_path) == {"ddp": 3e-3, "demo-default": 2e-3}
    parity.main([*sweep, "--lrs", "1e-3,2e-3", "--seeds", "1,2"])  # adds seeds 1 and 2 to seed 0's sweep
    stored = json.loads((tmp_path / "sweep.json").read_text())
    assert stored["seeds"] == [0, 1, 2] and len(stored["cells"]) == 6 + 8
    assert parity.best_rates(tmp_path) == {"ddp": 1e-3, "demo-default": 2e-3}
    table = (tmp_path / "sweep.md").read_text()
    assert "seeds 0, 1, 2" in table
    assert "| ddp | 0.001 | 2.2000 | 2.0000 | 2.1000 | 2.1000 | yes |" in table
    assert "| ddp | 0.003 | 1.5000 |  |  | (not every seed) |  |" in table
    # a sweep on another corpus replaces the earlier one instead of mixing with it
    _cell(tmp_path, "prose", 0, "ddp", 1e-3, 3.0, 1.0)
    parity.main(["sweep", "--corpus", "prose", "--methods", "ddp", "--lrs", "1e-3", "--steps", "10", "--out", str(tmp_path)])
    assert len(json.loads((tmp_path / "sweep.json").read_text())["cells"]) == 1


def test_a_run_keeps_the_chosen_rates_and_adds_only_the_methods_it_trains(tmp_path: Path) -> None:
    """rates.json is the chosen set render reports: the first run takes the sweep's best for every swept method;
    a later run adds the methods it trains and nothing else (a swept method nobody chose stays out)."""
    sweep = [{"method": m, "lr": lr, "seed": 0, "loss": loss} for m, lr, loss in
             [("ddp", 1e-3, 2.0), ("demo-default", 2e-3, 2.2), ("ddp-signum-b0.9", 1e-3, 2.3)]]
    (tmp_path / "sweep.json").write_text(json.dumps({"corpus": "stdlib", "size": "small", "world": 2, "steps": 10,
                                                     "seeds": [0], "cells": sweep}))
    for method, lr, loss in [("ddp", 1e-3, 2.0), ("demo-default", 3e-3, 2.1), ("demo-default", 2e-3, 2.15)]:
        _cell(tmp_path, "prose", 0, method, lr, loss, 1.0)
    (tmp_path / "rates.json").write_text(json.dumps({"ddp": 1e-3}))
    parity.main(["run", "--corpora", "prose", "--methods", "demo-default", "--lr", "demo-default=0.003", "--steps", "10",
                 "--out", str(tmp_path)])  # the cells exist: nothing trains
    assert json.loads((tmp_path / "rates.json").read_text()) == {"ddp": 1e-3, "demo-default": 3e-3}
    # a run without a rate takes the sweep's best for the method it trains, and still only that method joins
    (tmp_path / "rates.json").write_text(json.dumps({"ddp": 1e-3}))
    parity.main(["run", "--corpora", "prose", "--methods", "demo-default", "--steps", "10", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "rates.json").read_text()) == {"ddp": 1e-3, "demo-default": 2e-3}
    # with no chosen set yet, the sweep's best for every swept method is it
    (tmp_path / "rates.json").unlink()
    parity.main(["run", "--corpora", "prose", "--methods", "ddp", "--steps", "10", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "rates.json").read_text()) == {"ddp": 1e-3, "demo-default": 2e-3, "ddp-signum-b0.9": 1e-3}
    # a run that cannot start (no rate for a method) leaves the chosen set as it was
    with pytest.raises(SystemExit, match="no learning rate for"):
        parity.main(["run", "--corpora", "prose", "--methods", "demo-signum-b0.9", "--steps", "10", "--out", str(tmp_path)])
    assert len(json.loads((tmp_path / "rates.json").read_text())) == 3


def test_a_method_whose_rates_share_no_seed_cannot_be_chosen(tmp_path: Path) -> None:
    cells = [{"method": "ddp", "lr": 1e-3, "seed": 0, "loss": 2.0}, {"method": "ddp", "lr": 2e-3, "seed": 1, "loss": 2.1}]
    (tmp_path / "sweep.json").write_text(json.dumps({"corpus": "stdlib", "size": "small", "world": 2, "steps": 10,
                                                     "seeds": [0, 1], "cells": cells}))
    with pytest.raises(SystemExit, match="no rate of ddp ran at all of its seeds"):
        parity.best_rates(tmp_path)


def test_run_without_a_sweep_or_rates_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="run `benchmarks/parity.py sweep` first"):
        parity.main(["run", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as info:
        parity.main(["run", "--sizes", "huge", "--out", str(tmp_path)])
    assert info.value.code == 2  # argparse's usage error (--sizes: unknown ['huge']), before any sweep is read


def test_run_digits_launches_the_vision_task_once_per_seed_whatever_the_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--corpora digits`` runs compare.py's ``--corpus digits`` (its own model, 32 images per worker), one
    cell per seed and method, named and rendered with the size ``resnet10t``."""
    launched: list[list[str]] = []

    def fake_run(cmd: list[str], **_: object) -> None:  # stands in for compare.py: the cell it would write
        launched.append(cmd)
        folder = Path(cmd[cmd.index("--out") + 1])
        folder.mkdir(parents=True)
        method, seed = cmd[cmd.index("--methods") + 1], int(cmd[cmd.index("--seed") + 1])
        meta = {"command": " ".join(cmd[1:]), "corpus": "digits", "seed": seed, "lr": 1e-3, "d_model": 128, "n_layer": 2,
                "steps": int(cmd[cmd.index("--steps") + 1])}
        record = {"method": method, "world_size": 2, "final_val_loss": 0.05 if method == "ddp" else 0.06, "bytes_sent_per_step": 10.0,
                  "ratio_vs_ddp": 70.0, "steady_ratio_vs_ddp": None, "ddp_bytes_per_step": 700.0, "n_trainable": 1}
        (folder / "latest.json").write_text(json.dumps({"meta": meta, "records": [record]}))

    monkeypatch.setattr(parity.subprocess, "run", fake_run)
    parity.main(["run", "--corpora", "digits", "--sizes", "small,medium", "--seeds", "0,1", "--methods", "ddp,demo-default",
                 "--lr", "ddp=0.001,demo-default=0.001", "--out", str(tmp_path)])
    assert len(launched) == 4  # 2 seeds x 2 methods, not x 2 sizes
    for cmd in launched:
        assert cmd[cmd.index("--corpus") + 1] == "digits" and cmd[cmd.index("--batch-size") + 1] == "32"
        assert "--d-model" not in cmd and "--n-layer" not in cmd
        assert Path(cmd[cmd.index("--out") + 1]).name.startswith("digits_resnet10t_s")
    table = (tmp_path / "latest.md").read_text()
    assert "| digits | resnet10t | 2 | demo-default | 0.001 | 2 | 0.0600 (0.0600-0.0600) | 1.2000 (1.2000-1.2000)x | 70x | missed |" in table


def _cell_w(out: Path, corpus: str, world: int, method: str, lr: float, loss: float, ratio: float) -> None:
    _write_cell(out, corpus, 0, world, method, lr, loss, ratio)


def test_an_explicit_k_has_no_target_and_other_rates_are_listed(tmp_path: Path) -> None:
    (tmp_path / "rates.json").write_text(json.dumps({"ddp": 1e-3, "demo-sign1bit-k32": 1e-3, "demo-sign1bit-k64": 1e-3}))
    _cell_w(tmp_path, "prose", 4, "ddp", 1e-3, 2.0, 1.0)
    _cell_w(tmp_path, "prose", 4, "demo-sign1bit-k32", 1e-3, 2.08, 103.0)  # the default's k at 4, without its early phase
    _cell_w(tmp_path, "prose", 4, "demo-sign1bit-k64", 1e-3, 2.04, 62.0)  # not the default there
    _cell_w(tmp_path, "prose", 4, "demo-sign1bit-k32", 2e-3, 2.5, 103.0)  # another rate: an ablation row
    parity.render(type("Args", (), {"out": str(tmp_path)})())
    table = (tmp_path / "latest.md").read_text()
    assert "| demo-sign1bit-k32 | 0.001 | 1 | 2.0800 | 1.0400x | 103x |  |" in table  # no target: not what strategy="demo" runs
    assert "| demo-sign1bit-k64 | 0.001 | 1 | 2.0400 | 1.0200x | 62x |  |" in table
    assert "- demo-default:" not in table
    assert "| prose | small | 4 | demo-sign1bit-k32 | 0.002 | 0 | 2.5000 | 1.2500x | 103x |" in table.split("Other rates", 1)[1]
    # a later run with a rate for one method keeps the rates given before
    parity.main(["run", "--corpora", "prose", "--world-sizes", "4", "--methods", "ddp", "--lr", "ddp=0.001", "--steps", "10",
                 "--out", str(tmp_path)])
    assert json.loads((tmp_path / "rates.json").read_text())["demo-sign1bit-k32"] == 1e-3
    # an ablation at another rate (its cell exists, so nothing trains) leaves the chosen rate as it was
    parity.main(["run", "--corpora", "prose", "--world-sizes", "4", "--methods", "demo-sign1bit-k32", "--lr",
                 "demo-sign1bit-k32=0.002", "--ablation", "--steps", "10", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "rates.json").read_text())["demo-sign1bit-k32"] == 1e-3
    table = (tmp_path / "latest.md").read_text()
    assert "| demo-sign1bit-k32 | 0.001 | 1 | 2.0800 | 1.0400x | 103x |  |" in table
    assert "| prose | small | 4 | demo-sign1bit-k32 | 0.002 | 0 | 2.5000 | 1.2500x | 103x |" in table.split("Other rates", 1)[1]
    # no sweep in this folder and no --lr: the rates given to earlier runs are enough
    parity.main(["run", "--corpora", "prose", "--world-sizes", "4", "--methods", "ddp,demo-sign1bit-k32", "--steps", "10",
                 "--out", str(tmp_path)])
    assert "| demo-sign1bit-k32 | 0.001 | 1 | 2.0800 | 1.0400x | 103x |  |" in (tmp_path / "latest.md").read_text()


def test_render_at_given_rates_writes_its_own_table_and_keeps_the_chosen_one(tmp_path: Path) -> None:
    (tmp_path / "rates.json").write_text(json.dumps({"ddp": 1e-3, "demo-default": 1e-3}))
    for lr, ddp, demo in ((1e-3, 2.0, 2.06), (2e-3, 1.8, 1.98)):
        _cell_w(tmp_path, "prose", 4, "ddp", lr, ddp, 1.0)
        _cell_w(tmp_path, "prose", 4, "demo-default", lr, demo, 103.0)
    parity.main(["render", "--rates", "ddp=0.002,demo-default=0.002", "--table", "at-2e-3.md", "--out", str(tmp_path)])
    table = (tmp_path / "at-2e-3.md").read_text()
    assert table.startswith("# Loss parity at the rates given to `render --rates ddp=0.002,demo-default=0.002`")
    assert "| prose | small | 4 | demo-default | 0.002 | 1 | 1.9800 | 1.1000x | 103x | missed |" in table  # vs DDP at 2e-3
    assert "| prose | small | 4 | demo-default | 0.001 | 0 | 2.0600 | 1.1444x | 103x |" in table.split("Other rates", 1)[1]
    assert not (tmp_path / "latest.md").exists()  # the chosen rates' table is not overwritten
    assert json.loads((tmp_path / "rates.json").read_text()) == {"ddp": 1e-3, "demo-default": 1e-3}
    with pytest.raises(SystemExit, match=r"render --rates: expected METHOD=RATE"):
        parity.main(["render", "--rates", "ddp:0.002", "--out", str(tmp_path)])


def test_byte_ratios_under_ten_keep_two_digits(tmp_path: Path) -> None:
    """A method that moves more bytes than DDP (desloc-k1: 1 / 3 of DDP's ratio) reads 0.33x, not 0x."""
    (tmp_path / "rates.json").write_text(json.dumps({"ddp": 1e-3, "desloc-k1": 1e-3}))
    _cell_w(tmp_path, "prose", 4, "ddp", 1e-3, 2.0, 1.0)
    _cell_w(tmp_path, "prose", 4, "desloc-k1", 1e-3, 2.2, 1 / 3)
    _cell_w(tmp_path, "prose", 4, "desloc-k1", 2e-3, 2.1, 1 / 3)
    parity.render(type("Args", (), {"out": str(tmp_path)})())
    table = (tmp_path / "latest.md").read_text()
    assert "| desloc-k1 | 0.001 | 1 | 2.2000 | 1.1000x | 0.33x |  |" in table
    assert "| desloc-k1 | 0.002 | 0 | 2.1000 | 1.0500x | 0.33x |" in table.split("Other rates", 1)[1]
    assert "| ddp | 0.001 | 1 | 2.0000 | 1.0000x | 1x |" in table


def test_a_target_met_only_on_the_mean_says_so(tmp_path: Path) -> None:
    (tmp_path / "rates.json").write_text(json.dumps({"ddp": 1e-3, "desloc": 1e-3}))
    for seed, (ddp, desloc) in enumerate([(2.0, 1.98), (2.0, 2.16)]):  # 0.99x and 1.08x: the mean 1.035x
        _cell(tmp_path, "prose", seed, "ddp", 1e-3, ddp, 1.0)
        _cell(tmp_path, "prose", seed, "desloc", 1e-3, desloc, 171.0)
    parity.render(type("Args", (), {"out": str(tmp_path)})())
    row = next(line for line in (tmp_path / "latest.md").read_text().splitlines() if "| desloc |" in line)
    assert row.endswith("| 1.0350 (0.9900-1.0800)x | 171x | met on the mean (not every seed) |")


def test_runs_of_another_length_are_compared_among_themselves(tmp_path: Path) -> None:
    """A longer run of the same corpus, size, W and seed is its own row, against DDP's run of that length:
    the 20-step cells must not replace the 10-step ones of the same seeds, nor mix in their ratios."""
    (tmp_path / "rates.json").write_text(json.dumps({"ddp": 1e-3, "desloc": 1e-3}))
    for steps, (ddp, desloc) in ((10, (2.0, 2.2)), (20, (1.8, 1.89))):
        _write_cell(tmp_path, "prose", 0, 4, "ddp", 1e-3, ddp, 1.0, steps=steps)
        _write_cell(tmp_path, "prose", 0, 4, "desloc", 1e-3, desloc, 171.0, steps=steps)
    parity.render(type("Args", (), {"out": str(tmp_path)})())
    table = (tmp_path / "latest.md").read_text()
    assert "after 10 or 20 steps" in table
    assert "| prose | small (10 steps) | 4 | desloc | 0.001 | 1 | 2.2000 | 1.1000x | 171x | missed |" in table
    assert "| prose | small (20 steps) | 4 | desloc | 0.001 | 1 | 1.8900 | 1.0500x | 171x | met |" in table
    geo = math.exp((math.log(1.1) + math.log(1.05)) / 2)
    assert f"- desloc: {geo:.4f}x over 2 runs" in table
    assert "over every cell and seed above:" in table  # no sweep in this folder: no tuning corpus to leave out
    # one length in the folder: the size column stays the size
    only = tmp_path / "only"
    _write_cell(only, "prose", 0, 4, "ddp", 1e-3, 2.0, 1.0, steps=20)
    _write_cell(only, "prose", 0, 4, "desloc", 1e-3, 2.1, 171.0, steps=20)
    (only / "rates.json").write_text(json.dumps({"ddp": 1e-3, "desloc": 1e-3}))
    parity.render(type("Args", (), {"out": str(only)})())
    assert "| prose | small | 4 | desloc | 0.001 | 1 | 2.1000 | 1.0500x | 171x | met |" in (only / "latest.md").read_text()


def _cell_opt(out: Path, corpus: str, seed: int, method: str, loss: float, ratio: float, options: tuple[str, ...]) -> None:
    _write_cell(out, corpus, seed, 2, method, 1e-3, loss, ratio, options)


def test_option_rows_are_named_by_their_settings_and_answer_for_the_default_only_with_its_own_settings(tmp_path: Path) -> None:
    from demo_lightning.algorithms import DeMoConfig

    assert parity.cell_name("prose", "small", 0, 2, "demo-default", 1e-3, 520, ("decay=0.999",)) == \
        "prose_small_s0_w2_demo-default+decay-0.999_lr0.001_t520"
    own = DeMoConfig().decay
    assert parity.default_settings((f"decay={own}",)) and parity.default_settings(())
    assert not parity.default_settings(("decay=0.5",)) and not parity.default_settings(("no_such_setting=1",))
    (tmp_path / "rates.json").write_text(json.dumps({"ddp": 1e-3, "demo-default": 1e-3}))
    for seed, (ddp, at_default, other) in enumerate([(2.0, 2.04, 2.2), (2.2, 2.2, 2.31)]):
        _cell_opt(tmp_path, "prose", seed, "ddp", ddp, 1.0, ())
        _cell_opt(tmp_path, "prose", seed, "demo-default", at_default, 110.0, (f"decay={own}",))
        _cell_opt(tmp_path, "prose", seed, "demo-default", other, 110.0, ("decay=0.5",))
    parity.render(type("Args", (), {"out": str(tmp_path)})())
    table = (tmp_path / "latest.md").read_text()
    # the default's own settings, given explicitly: the default's row, with its target
    assert f"| demo-default[decay={own}] (the default's settings) | 0.001 | 2 | 2.1200 (2.0400-2.2000) | 1.0100 (1.0000-1.0200)x | 110x | met |" in table
    assert "| demo-default[decay=0.5] | 0.001 | 2 | 2.2550 (2.2000-2.3100) | 1.0750 (1.0500-1.1000)x | 110x |  |" in table
    geo_other, geo_default = math.sqrt(1.1 * 1.05), math.sqrt(1.02 * 1.0)
    assert f"- demo-default: {geo_default:.4f}x over 2 runs" in table
    assert f"- demo-default[decay=0.5]: {geo_other:.4f}x over 2 runs; the default {geo_default:.4f}x over 2 of them" in table
    with pytest.raises(SystemExit, match="holds no cells"):
        parity.render(type("Args", (), {"out": str(tmp_path / "empty")})())


def test_curves_prints_the_training_loss_in_windows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert parity.window_means([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.5, 3.5, 5.0]
    with pytest.raises(ValueError):
        parity.window_means([1.0], 0)
    folder = tmp_path / "cell"
    folder.mkdir()
    record = {"method": "demo-sign1bit", "world_size": 2, "final_val_loss": 2.5, "train_loss": [4.0, 3.0, 2.0], "options": ["decay=0.9"]}
    (folder / "latest.json").write_text(json.dumps({"meta": {}, "records": [record]}))
    parity.main(["curves", str(folder), "--window", "2"])
    assert capsys.readouterr().out.strip() == "cell: demo-sign1bit [decay=0.9] W=2 val 2.5000 | train loss per 2 steps: 3.50 2.00"
    with pytest.raises(SystemExit, match="no latest.json"):
        parity.main(["curves", str(tmp_path / "missing")])


def test_byte_entropies_against_hand_counts() -> None:
    # "abab": unigram a, b at 1/2 each: ln 2; after a always b, after b always a: 0
    assert parity.byte_entropies(b"abab") == pytest.approx((math.log(2), 0.0))
    # "aab": unigram 2/3, 1/3; pairs (a,a), (a,b) after a (2 of them): each 1/2, so ln 2 for both pairs, over 2 pairs
    uni = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert parity.byte_entropies(b"aab") == pytest.approx((uni, math.log(2)))
    with pytest.raises(ValueError):
        parity.byte_entropies(b"a")


def test_a_warm_up_is_passed_on_and_a_folder_holds_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--warmup-steps`` reaches compare.py only when it is not its default (earlier cells' commands stay
    as they were); a stored cell made at another warm-up stops the run instead of standing in for it."""
    launched: list[list[str]] = []

    def fake_run(cmd: list[str], **_: object) -> None:
        launched.append(cmd)
        folder = Path(cmd[cmd.index("--out") + 1])
        folder.mkdir(parents=True)
        warmup = int(cmd[cmd.index("--warmup-steps") + 1]) if "--warmup-steps" in cmd else None
        meta = {"command": " ".join(cmd[1:]), "corpus": "stdlib", "seed": 0, "lr": 1e-3, "d_model": 128, "n_layer": 2,
                "steps": 10, **({"warmup_steps": warmup} if warmup is not None else {})}
        record = {"method": "ddp", "world_size": 2, "final_val_loss": 2.0, "bytes_sent_per_step": 1.0, "ratio_vs_ddp": 1.0,
                  "steady_ratio_vs_ddp": None, "ddp_bytes_per_step": 1.0, "n_trainable": 1}
        (folder / "latest.json").write_text(json.dumps({"meta": meta, "records": [record]}))

    monkeypatch.setattr(parity.subprocess, "run", fake_run)
    sweep = ["sweep", "--methods", "ddp", "--lrs", "1e-3", "--steps", "10"]
    parity.main([*sweep, "--out", str(tmp_path / "w20")])
    parity.main([*sweep, "--warmup-steps", "80", "--out", str(tmp_path / "w80")])
    assert "--warmup-steps" not in launched[0]
    assert launched[1][launched[1].index("--warmup-steps") + 1] == "80"
    parity.main([*sweep, "--warmup-steps", "80", "--out", str(tmp_path / "w80")])  # stored at 80: reused
    assert len(launched) == 2
    with pytest.raises(SystemExit, match="ran with --warmup-steps 20, not 80"):
        parity.main([*sweep, "--warmup-steps", "80", "--out", str(tmp_path / "w20")])
    # a cell stored before compare.py recorded the warm-up: read from its command
    assert parity.stored_warmup({"command": "python benchmarks/compare.py --warmup-steps 160 --seed 0"}) == 160
    assert parity.stored_warmup({"command": "python benchmarks/compare.py --seed 0"}) == 20


def test_gradient_clipping_is_passed_on_named_in_the_cells_and_kept_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--gradient-clip-val`` reaches compare.py and names its cells ``_clip<value>``; an unclipped run passes
    nothing; a folder holds one clipping (a clipped sweep or run into an unclipped folder, or into one holding a cell
    whose record disagrees with its name, stops before it trains), and render refuses a folder that mixes them."""
    launched: list[list[str]] = []
    losses = {"0.001": 2.0, "0.002": 1.9}

    def fake_run(cmd: list[str], **_: object) -> None:
        launched.append(cmd)
        folder = Path(cmd[cmd.index("--out") + 1])
        folder.mkdir(parents=True)
        clip = float(cmd[cmd.index("--gradient-clip-val") + 1]) if "--gradient-clip-val" in cmd else None
        lr = cmd[cmd.index("--lr") + 1]
        meta = {"command": " ".join(cmd[1:]), "corpus": "stdlib", "seed": 0, "lr": float(lr), "d_model": 128, "n_layer": 2,
                "steps": 10, "gradient_clip_val": clip}
        record = {"method": "ddp", "world_size": 2, "final_val_loss": losses[lr], "bytes_sent_per_step": 1.0,
                  "ratio_vs_ddp": 1.0, "steady_ratio_vs_ddp": None, "ddp_bytes_per_step": 1.0, "n_trainable": 1}
        (folder / "latest.json").write_text(json.dumps({"meta": meta, "records": [record]}))

    monkeypatch.setattr(parity.subprocess, "run", fake_run)
    sweep = ["sweep", "--methods", "ddp", "--steps", "10", "--out", str(tmp_path)]
    parity.main([*sweep, "--lrs", "1e-3"])
    assert "--gradient-clip-val" not in launched[0] and Path(launched[0][launched[0].index("--out") + 1]).name.endswith("_t10")
    for stage in (["sweep", "--lrs", "2e-3"], ["run", "--corpora", "prose", "--lr", "ddp=0.002"]):
        with pytest.raises(SystemExit, match=r"holds cells run with --gradient-clip-val \['None'\], not 1.0"):
            parity.main([*stage, "--methods", "ddp", "--steps", "10", "--out", str(tmp_path), "--gradient-clip-val", "1.0"])
    assert len(launched) == 1
    clipped = tmp_path / "clipped"
    parity.main([*sweep[:-1], str(clipped), "--lrs", "1e-3,2e-3", "--gradient-clip-val", "1"])
    assert launched[1][launched[1].index("--gradient-clip-val") + 1] == "1"
    assert Path(launched[2][launched[2].index("--out") + 1]).name == "stdlib_small_s0_w2_ddp_lr0.002_t10_clip1"
    assert json.loads((clipped / "sweep.json").read_text())["gradient_clip_val"] == 1.0
    assert parity.cell_name("stdlib", "small", 0, 2, "ddp", 2e-3, 10, clip=0.5).endswith("_t10_clip0.5")
    # a clipped folder renders and says so
    assert "gradients clipped at 1" in (clipped / "sweep.md").read_text()
    assert "Every method clipped its gradients' norm at 1 (`--gradient-clip-val`)." in (clipped / "latest.md").read_text()
    assert parity.best_rates(clipped) == {"ddp": 2e-3}
    # a stored cell whose record disagrees with its name is not reused: the folder then holds another clipping
    done = clipped / "cells" / "stdlib_small_s0_w2_ddp_lr0.001_t10_clip1" / "latest.json"
    saved = json.loads(done.read_text())
    saved["meta"]["gradient_clip_val"] = None
    done.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match=r"clipped holds cells run with --gradient-clip-val \['None'\], not 1.0"):
        parity.main([*sweep[:-1], str(clipped), "--lrs", "1e-3", "--gradient-clip-val", "1"])
    # render refuses a folder that mixes clippings (an unclipped cell put there by hand)
    shutil.copytree(next((tmp_path / "cells").iterdir()), clipped / "cells" / "stdlib_small_s0_w2_ddp_lr0.001_t10")
    with pytest.raises(SystemExit, match="mixes cells run with gradient clipping"):
        parity.render(type("Args", (), {"out": str(clipped)})())
    with pytest.raises(SystemExit) as info:
        parity.main([*sweep, "--lrs", "1e-3", "--gradient-clip-val", "0"])
    assert info.value.code == 2  # argparse's usage error: --gradient-clip-val must be > 0


def test_render_marks_the_byte_ratios_of_cells_that_coded_positions_with_elias_fano(tmp_path: Path) -> None:
    """Each cell records its position coding; a row's bytes say EF where every seed's cell used Elias-Fano,
    "EF at n of m" where only some did, nothing where none did (DDP, or cells from before the key existed)."""
    (tmp_path / "rates.json").write_text(json.dumps({"ddp": 1e-3, "demo-default": 1e-3}))
    for seed in (0, 1):
        _write_cell(tmp_path, "prose", seed, 2, "ddp", 1e-3, 2.0, 1.0)
        _write_cell(tmp_path, "prose", seed, 2, "demo-default", 1e-3, 2.1, 150.0, position_format="elias_fano")
        _write_cell(tmp_path, "cpp", seed, 2, "ddp", 1e-3, 2.0, 1.0)
        _write_cell(tmp_path, "cpp", seed, 2, "demo-default", 1e-3, 2.1, 150.0 if seed else 100.0,
                    position_format="elias_fano" if seed else None)
    _write_cell(tmp_path, "cpp", 0, 2, "demo-default", 2e-3, 2.2, 100.0, position_format="packed")  # another rate
    _write_cell(tmp_path, "cpp", 0, 2, "demo-default", 3e-3, 2.2, 140.0, options=("position_format=elias_fano",))
    parity.render(type("Args", (), {"out": str(tmp_path)})())
    rows = {(line.split(" | ")[0], line.split(" | ")[3], line.split(" | ")[4]): line
            for line in (tmp_path / "latest.md").read_text().splitlines() if line.startswith("| ")}
    assert "| 150x EF | met |" in rows[("| prose", "demo-default", "0.001")]
    assert "| 125x EF at 1 of 2 | met |" in rows[("| cpp", "demo-default", "0.001")]
    assert "| 1x |  |" in rows[("| prose", "ddp", "0.001")]
    assert rows[("| cpp", "demo-default", "0.002")].endswith("| 100x |")  # packed: no mark
    assert rows[("| cpp", "demo-default[position_format=elias_fano]", "0.003")].endswith("| 140x EF |")  # set, not recorded
    assert "Bytes marked EF: top-k positions coded with Elias-Fano" in (tmp_path / "latest.md").read_text()


def test_the_geometric_mean_over_several_world_sizes_names_each_ones_share(tmp_path: Path) -> None:
    (tmp_path / "rates.json").write_text(json.dumps({"ddp": 1e-3, "demo-default": 1e-3}))
    for seed in (0, 1):
        _write_cell(tmp_path, "prose", seed, 2, "ddp", 1e-3, 2.0, 1.0)
        _write_cell(tmp_path, "prose", seed, 2, "demo-default", 1e-3, 2.1, 120.0)
    _write_cell(tmp_path, "prose", 0, 4, "ddp", 1e-3, 2.0, 1.0)
    _write_cell(tmp_path, "prose", 0, 4, "demo-default", 1e-3, 2.2, 120.0)
    parity.render(type("Args", (), {"out": str(tmp_path)})())
    pooled = math.exp((2 * math.log(1.05) + math.log(1.1)) / 3)
    assert (f"- demo-default: {pooled:.4f}x over 3 runs (W 2: 1.0500x over 2, W 4: 1.1000x over 1)"
            in (tmp_path / "latest.md").read_text())


def test_a_folder_with_only_the_tuning_corpus_says_it_has_no_held_out_mean(tmp_path: Path) -> None:
    sweep = [{"method": "ddp", "lr": 1e-3, "loss": 2.0}, {"method": "demo-default", "lr": 1e-3, "loss": 2.2}]
    (tmp_path / "sweep.json").write_text(json.dumps({"corpus": "stdlib", "size": "small", "seed": 0, "world": 8, "steps": 10, "cells": sweep}))
    _write_cell(tmp_path, "stdlib", 0, 8, "ddp", 1e-3, 2.0, 1.0)
    _write_cell(tmp_path, "stdlib", 0, 8, "demo-default", 1e-3, 2.2, 100.0)
    parity.render(type("Args", (), {"out": str(tmp_path)})())
    table = (tmp_path / "latest.md").read_text()
    assert "| stdlib | small | 8 | demo-default | 0.001 | 1 | 2.2000 | 1.1000x | 100x | missed |" in table
    assert "left out:\n\n- none: no cell here is off the tuning corpus (stdlib)\n" in table


def _clip_cell(out: Path, seed: int, method: str, lr: float, loss: float, clip: float | None,
               clip_default: float | None = None) -> Path:
    folder = out / "cells" / parity.cell_name("stdlib", "small", seed, 2, method, lr, 10, clip=clip)
    folder.mkdir(parents=True)
    meta = {"command": f"python benchmarks/compare.py --methods {method}", "corpus": "stdlib", "seed": seed, "lr": lr,
            "d_model": 128, "n_layer": 2, "steps": 10, "gradient_clip_val": clip, "demo_clip_grad_norm_default": clip_default}
    record = {"method": method, "world_size": 2, "final_val_loss": loss, "bytes_sent_per_step": 1.0, "ratio_vs_ddp": 1.0,
              "steady_ratio_vs_ddp": None, "ddp_bytes_per_step": 1.0, "n_trainable": 1}
    (folder / "latest.json").write_text(json.dumps({"meta": meta, "records": [record]}))
    return folder


def test_clipping_pairs_each_cell_run_both_ways_across_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``parity.py clipping`` pairs the unclipped and clipped runs of one setting, across folders, per method, and
    counts where clipping lowered the loss; a setting run one way only, or another method, is left out."""
    plain, clipped = tmp_path / "plain", tmp_path / "clipped"
    _clip_cell(plain, 0, "demo-default", 2e-3, 2.0, None)
    _clip_cell(plain, 1, "demo-default", 2e-3, 1.8, None)
    _clip_cell(plain, 2, "demo-default", 2e-3, 1.7, None)  # never clipped: no pair
    _clip_cell(plain, 0, "ddp", 2e-3, 1.5, None)
    _clip_cell(clipped, 0, "demo-default", 2e-3, 1.9, 1.0)
    _clip_cell(clipped, 1, "demo-default", 2e-3, 1.85, 1.0)
    _clip_cell(clipped, 0, "demo-default", 3e-3, 1.6, 1.0)  # another rate: no pair
    pairs = parity.clipping([plain, clipped], "demo-default")
    assert [(p["seed"], p["unclipped"], p["clipped"], p["clip"]) for p in pairs] == [(0, 2.0, 1.9, "1"), (1, 1.8, 1.85, "1")]
    assert parity.clipping([plain, clipped], "ddp") == []
    parity.main(["clipping", str(plain), str(clipped)])
    out = capsys.readouterr().out
    assert "unclipped 2.0000, clipped at 1 1.9000 (-0.1000)" in out
    assert out.strip().endswith("demo-default: clipping lowered the validation loss in 1 of 2 cells")


def test_a_default_cell_from_before_the_default_clip_is_not_reused_unclipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unclipped ``demo-default`` cell stored by a revision whose exchange did not clip on its own is another run
    than today's default: ``run`` stops instead of reusing it; a cell that records the default clip is reused, and so
    is the old cell under ``--gradient-clip-val`` (where both revisions run the same exchange)."""
    monkeypatch.setattr(parity.subprocess, "run", lambda *a, **k: pytest.fail("a stored cell was re-run"))
    old = _clip_cell(tmp_path, 0, "demo-default", 2e-3, 2.0, None)
    with pytest.raises(SystemExit, match="before they clipped each worker's gradient"):
        parity.run_cell(tmp_path, "stdlib", "small", 0, 2, "demo-default", 2e-3, 10)
    saved = json.loads((old / "latest.json").read_text())
    saved["meta"]["demo_clip_grad_norm_default"] = 1.0
    (old / "latest.json").write_text(json.dumps(saved))
    assert parity.run_cell(tmp_path, "stdlib", "small", 0, 2, "demo-default", 2e-3, 10)["loss"] == 2.0
    _clip_cell(tmp_path, 1, "demo-default", 2e-3, 1.9, 1.0)
    assert parity.run_cell(tmp_path, "stdlib", "small", 1, 2, "demo-default", 2e-3, 10, clip=1.0)["loss"] == 1.9
