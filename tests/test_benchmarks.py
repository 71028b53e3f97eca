"""The benchmark scripts run, and their closed-form figures match formulas recomputed here."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from demo_lightning import DeMoStrategy, DesLocStrategy
from demo_lightning.models import GPT

ROOT = Path(__file__).parent.parent
FORMATS = ("sign", "bf16", "int8", "fp32")
STAGES = {
    "to_tiles", "dct2", "select", "select_lowpass", "scatter", "idct2", "from_tiles", "decode", "dct2_gemms", "matmul_floor",
}


def _topk_payload(shape: tuple[int, ...], value_format: str, chunk: int = 64, k: int = 64, positions_as: str = "elias_fano") -> int:
    """Bytes of one tensor's top-k segment, from the wire layout (positions, then values): each position in
    ``ceil(log2 n)`` bits (``"packed"``), or a tile's ``k`` sorted positions as their Elias-Fano code, ``k``
    low parts of ``L = floor(log2(n / k))`` bits and a unary high part of ``k + ((n - 1) >> L) + 1`` bits,
    where that is smaller (the default, ``"auto"``)."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
    tr, tc = min(chunk, rows), min(chunk, cols)
    tiles = math.ceil(rows / tr) * math.ceil(cols / tc)
    n = tr * tc
    k = min(k, n)
    count = tiles * k
    per_tile = k * max(1, math.ceil(math.log2(n)))
    if positions_as == "elias_fano":
        low = int(math.log2(n // k)) if 2 * k <= n else 0
        per_tile = min(per_tile, k * low + k + ((n - 1) >> low) + 1)
    positions = math.ceil(tiles * per_tile / 8)
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
    dense = sum(2 * p.numel() for p in params if p.numel() < 4096)  # the norms, all-reduced in bf16 (dense_format)
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
    # the sign default's crossover at k 64: about 2 * 4 * 4096 / 76 ~ 430 workers (64 + 8 + 4 bytes a tile; 108 and
    # ~300 with fixed-width positions)
    assert 410 <= table["crossover"]["topk sign"]["world_size"] <= 440
    for fmt in ("bf16", "fp32"):  # low-pass all-reduces: a constant ratio to DDP, never crosses
        assert table["crossover"][f"lowpass {fmt}"]["world_size"] is None
        assert all(row[f"lowpass {fmt}"]["received"] < row["ddp"]["received"] for row in rows.values())


# ---------------------------------------------------------------------------------------------- compare.py
def _load_compare() -> Any:
    if str(ROOT / "benchmarks") not in sys.path:  # compare.py imports its sibling readme_section
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("compare_benchmark", ROOT / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_compare_quick_run_writes_records_plots_and_a_table_that_rerenders(tmp_path: Path) -> None:
    compare = _load_compare()
    out = tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--methods", "ddp,demo+desloc", "--world-sizes", "2",
           "--steps", "6", "--val-every", "3", "--warmup", "1", "--max-bytes", "300000",
           "--out", str(out), "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    saved = json.loads((out / "latest.json").read_text())
    meta, records = saved["meta"], saved["records"]
    by = {r["method"]: r for r in records}
    assert set(by) == {"ddp", "demo+desloc"}
    required = {"method", "world_size", "steps", "final_val_loss", "bytes_sent_per_step", "bytes_received_per_step",
                "ratio_vs_ddp", "step_time_s", "exchange_share", "peak_rss_mb"}
    gpt = GPT(block_size=128, d_model=128, n_layer=2)
    params = list(gpt.parameters())
    n = sum(p.numel() for p in params)
    for r in records:
        assert required <= set(r), required - set(r)
        assert r["world_size"] == 2 and r["steps"] == 6 and r["n_trainable"] == n == meta["n_trainable"]
        assert [s for s, _ in r["val_curve"]] == [3, 6]
        assert 0 < r["final_val_loss"] < math.log(256) + 0.5 and r["final_val_loss"] == r["val_curve"][-1][1]
        assert 0 < r["step_time_s"] and 0 <= r["compute_s"] <= r["step_time_s"] and 200 < r["peak_rss_mb"] < 8000
        assert math.isclose(r["ratio_vs_ddp"], r["ddp_bytes_per_step"] / r["bytes_sent_per_step"], rel_tol=1e-12)
        for b, modeled in r["modeled"].items():  # step time at B = compute + the ledger's bytes and hops
            assert math.isclose(modeled["step_s"], r["compute_s"] + r["modeled_comm_s_per_step"][b], rel_tol=1e-12)
    ddp, ours = by["ddp"], by["demo+desloc"]
    # DDP: one fp32 ring all-reduce of every gradient, 2 (W-1)/W * 4 n; no exchange of ours
    assert ddp["bytes_sent_per_step"] == ddp["bytes_received_per_step"] == 4 * n and ddp["exchange_share"] == 0
    # ours, before any DES-LOC sync: the top-k sign payload (all-gathered: (W-1) x payload), the dense
    # tensors' fp32 all-reduce and the guard's 9 bytes (its flag byte and the exchange's plan digest), exactly
    payload = sum(_topk_payload(tuple(p.shape), "sign", positions_as="packed") for p in params if p.numel() >= 4096)
    dense = sum(4 * p.numel() for p in params if p.numel() < 4096)  # demo+desloc keeps fp32 norms (compare.PREVIOUS_DEFAULTS)
    assert ours["bytes_sent_per_step"] == ours["bytes_received_per_step"] == payload + dense + 9
    assert ours["position_format"] == "packed" and "position_format" not in ddp  # the coding the run used, recorded
    assert ours["ratio_vs_ddp"] > 50 and 0 < ours["exchange_share"] < 1
    # long run: the parameter average (every 256) and the residual average (every 512), which 6 steps
    # never hold, each at one fp32 all-reduce of every parameter; DDP has no periodic average
    long_run = payload + dense + 9 + 4 * n / 256 + 4 * n / 512
    assert math.isclose(ours["steady_ratio_vs_ddp"], 4 * n / long_run, rel_tol=1e-12) and ddp["steady_ratio_vs_ddp"] is None
    # modeled time: 1 Gbit/s is slower than 100 Gbit/s for DDP, the link matters less for ours
    slow, fast = ddp["modeled"]["1"]["step_s"], ddp["modeled"]["100"]["step_s"]
    assert slow - fast > 0.9 * (4 * n * 8 / 1e9) * (1 - 1 / 100)
    assert ours["modeled"]["1"]["step_s"] - ours["modeled"]["100"]["step_s"] < slow - fast
    assert ddp["steps_to_target"] is not None and ddp["target_val_loss"] == ddp["final_val_loss"]
    # plots are PNGs; the table is a pure function of the JSON
    for name in ("compare_loss_vs_step.png", "compare_loss_vs_bytes.png", "compare_modeled_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    table = (out / "latest.md").read_text()
    assert table == compare.render(meta, records) and "`demo+desloc`" in table and "| target |" in table
    assert table.strip() in proc.stdout


def test_compare_digits_task_trains_the_resnet_and_records_accuracy_and_exact_bytes(tmp_path: Path) -> None:
    """``--corpus digits``: the vision task (the timm ResNet-10t on scikit-learn's digits) through the same
    worker and merge; the bytes are the codec's layout for the ResNet's tensors (4-D convolutions tiled
    as ``(out, in * kh * kw)``), recomputed here."""
    import timm

    compare = _load_compare()
    out = tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--corpus", "digits", "--methods", "demo-sign1bit",
           "--world-sizes", "2", "--steps", "3", "--val-every", "3", "--warmup", "1", "--batch-size", "8",
           "--out", str(out), "--workdir", str(tmp_path / "work"), "--no-plots"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    saved = json.loads((out / "latest.json").read_text())
    meta, (record,) = saved["meta"], saved["records"]
    net = timm.create_model(compare.DIGITS_MODEL, pretrained=False, num_classes=10, in_chans=3, **compare.DIGITS_KWARGS)
    params = [p for p in net.parameters() if p.requires_grad]
    assert record["n_trainable"] == sum(p.numel() for p in params) == meta["n_trainable"] and meta["corpus"] == "digits"
    payload = sum(_topk_payload(tuple(p.shape), "sign", positions_as="packed") for p in params if p.numel() >= 4096)
    dense = sum(4 * p.numel() for p in params if p.numel() < 4096)  # demo-sign1bit keeps fp32 norms (compare.PREVIOUS_DEFAULTS)
    assert record["bytes_sent_per_step"] == payload + dense + 9  # 2 workers: one all-gathered payload, dense all-reduce, guard
    assert [s for s, _ in record["val_acc_curve"]] == [3] and 0 <= record["final_val_acc"] <= 1
    assert 0 < record["final_val_loss"] < 10 and record["final_val_loss"] == record["val_curve"][-1][1]
    table = (out / "latest.md").read_text()
    assert f"timm {compare.DIGITS_MODEL} on the digits at 32x32, 8 images per worker per step" in table
    with pytest.raises(SystemExit):  # neither a named corpus, the digits, nor a path
        compare.parse_args(["--corpus", str(tmp_path / "no-such-text")])


def test_only_the_default_row_follows_the_default_position_coding() -> None:
    """Elias-Fano positions became the default (``"auto"``) after most cells were measured: every DeMo row but
    ``demo-default`` (and every DES-LOC row through the codec) pins the fixed width it was measured with, so a
    stored cell re-runs with its bytes, not only its loss."""
    compare = _load_compare()
    coded = {name: m.options.get("position_format") for name, m in compare.METHODS.items()
             if m.kind == "demo" or m.options.get("compress_params")}
    assert coded.pop("demo-default") is None and len(coded) > 20
    assert set(coded.values()) == {"packed"}, {k: v for k, v in coded.items() if v != "packed"}
    assert compare.position_format(DeMoStrategy()) == "elias_fano"
    assert compare.position_format(DeMoStrategy(value_format="mixed")) == "packed"
    assert compare.position_format(DeMoStrategy(selection="lowpass")) is None  # no positions sent
    assert compare.position_format(DesLocStrategy()) is None  # averages whole tensors
    assert compare.position_format(DesLocStrategy(compress_params=True)) == "elias_fano"


def test_compare_option_lays_settings_over_a_method_and_reaches_the_workers() -> None:
    compare = _load_compare()
    base = compare.METHODS["demo-sign1bit"]
    got = compare.with_options(base, ["topk=256", "decay=0.999", "transform=haar"])
    # demo-sign1bit is the default before issue 18: no early phase, norms in fp32, dense under 4,096 elements only
    # (compare.PREVIOUS_DEFAULTS), positions at the fixed width, no clipping of its own
    pinned = {"clip_grad_norm": None, "position_format": "packed", "early_steps": 0, "dense_format": "fp32", "dense_below": 4096,
              "dense_vectors": False}
    assert got.options == {**pinned, "value_format": "sign", "topk": 256, "decay": 0.999, "transform": "haar"}
    assert got.kind == base.kind and got.lr == base.lr and got.optimizer == base.optimizer
    assert "topk=256" in got.description and base.options == {**pinned, "value_format": "sign"}  # unchanged
    assert compare.with_options(compare.METHODS["ddp"], ["topk=256"]) is compare.METHODS["ddp"]  # Lightning's DDP: none of ours
    assert "clip_grad_norm" not in compare.METHODS["demo-default"].options  # today's default: it clips (issue 18)
    assert compare.with_options(base, None) is base
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        compare.with_options(base, ["topk"])
    args = compare.parse_args(["--methods", "ddp,demo-sign1bit", "--world-sizes", "2", "--steps", "160",
                               "--schedule-steps", "520", "--option", "topk=256", "--option", "decay=0.999",
                               "--weight-decay", "0.1", "--gradient-clip-val", "1.0"])
    shared = args.shared
    assert shared[shared.index("--weight-decay") + 1] == "0.1"  # every worker builds its model with it
    assert shared[shared.index("--gradient-clip-val") + 1] == "1.0"  # and its Trainer clips with it
    assert "--gradient-clip-val" not in compare.parse_args([]).shared  # no clipping unless asked
    assert shared[shared.index("--schedule-steps") + 1] == "520" and shared[shared.index("--steps") + 1] == "160"
    assert [shared[i + 1] for i, a in enumerate(shared) if a == "--option"] == ["topk=256", "decay=0.999"]
    with pytest.raises(SystemExit):  # a schedule shorter than the run
        compare.parse_args(["--steps", "160", "--schedule-steps", "100"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--methods", "demo-sign1bit", "--option", "=3"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--weight-decay", "-0.1"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--gradient-clip-val", "0"])


def test_readme_results_are_the_rendering_of_the_committed_json() -> None:
    compare = _load_compare()
    saved = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    records = saved["records"]
    assert {r["method"] for r in records} == set(compare.ISSUE_METHODS) and {r["world_size"] for r in records} == {2, 4}
    assert all(r["steps"] >= 500 for r in records)
    readme = (ROOT / "README.md").read_text()
    section = readme.split(compare.README_START, 1)[1].split(compare.README_END, 1)[0]
    assert section.strip() == compare.render(saved["meta"], records).strip()
    assert (ROOT / "benchmarks" / "results" / "latest.md").read_text().strip() == section.strip()


def test_long_run_ratio_counts_each_periodic_average_once_at_its_period() -> None:
    compare = _load_compare()
    ddp = 1_000_000.0

    def rows(steps: int, syncs: dict[int, dict[str, float]]) -> list[dict]:
        return [{"sent_by_tag": {"guard/nonfinite": 1.0, **syncs.get(t, {})}} for t in range(1, steps + 1)]

    # Local Adam, K 512 for the parameters and both moments: one sync of each in 520 steps;
    # desloc/state/exp_avg_sq must not be taken for desloc/state/exp_avg
    keys = {"desloc/params": ddp, "desloc/state/exp_avg": ddp, "desloc/state/exp_avg_sq": ddp}
    periods = {"desloc/params": 512, "desloc/buffers": 512, "desloc/state/exp_avg": 512, "desloc/state/exp_avg_sq": 512}
    assert math.isclose(compare.long_run_ratio(rows(520, {512: keys}), periods, ddp), ddp / (1 + 3 * ddp / 512), rel_tol=1e-12)
    # compressed parameter syncs every 16 (32 held in 520 steps, 900 bytes each over two tags);
    # moments every 768 / 1536, never held: one dense all-reduce each at its period
    codec = {"desloc/params_compressed/topk": 700.0, "desloc/params_compressed/dense": 200.0}
    periods = {"desloc/params": 16, "desloc/buffers": 16, "desloc/state/exp_avg": 768, "desloc/state/exp_avg_sq": 1536}
    got = compare.long_run_ratio(rows(520, {t: codec for t in range(16, 521, 16)}), periods, ddp)
    assert math.isclose(got, ddp / (1 + 900 / 16 + ddp / 768 + ddp / 1536), rel_tol=1e-12)
    assert compare.long_run_ratio(rows(10, {}), {}, ddp) is None  # nothing periodic: the run ratio is the long-run ratio



@pytest.mark.slow  # ~1 min (two 2-process fits and a git worktree): a benchmark tool's A/B mode, kept out of CI's 15 minutes
def test_exchange_share_measures_a_revision_side_by_side_from_its_own_worktree(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "exchange_share.py"), "--batch-sizes", "2", "--steps", "3",
           "--against", "HEAD", "--rounds", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    saved = json.loads((tmp_path / "exchange_share_ab.json").read_text())
    rows = {r["library"]: r for r in saved["rows"]}
    assert len(rows) == 2 and "HEAD" in rows and saved["meta"]["against"] == "HEAD"
    ours = next(r for label, r in rows.items() if label != "HEAD")
    # the revision's workers imported its worktree's demo_lightning, ours the repository's
    assert ours["library_paths"] == [str(ROOT)] and rows["HEAD"]["library_paths"] != [str(ROOT)]
    for r in rows.values():
        assert r["rounds"] == 1 and r["batch_size"] == 2 and r["step_time_s"] > 0 and 0 < r["exchange_share"] < 1
    assert (tmp_path / "exchange_share_ab.md").read_text().count("| 2 | 256 |") == 2
