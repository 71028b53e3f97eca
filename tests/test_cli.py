"""For users: the demo-lightning CLI, every config parsed and smoke-run on 2 processes, the
examples (one under torchrun), offline data with the user's own paths, the TensorBoard picture."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from demo_lightning.cli import build_cli, main as cli_main
from demo_lightning.data import ImageDataModule, TextDataModule

from dist_helpers import clean_env, free_port

HERE = Path(__file__).parent
ROOT = HERE.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
SCRIPT = Path(sys.executable).parent / "demo-lightning"


def _env() -> dict[str, str]:
    env = clean_env()
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return env


def _print_config(*args: str) -> dict[str, Any]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit) as exit_info:
        cli_main([*args, "--print_config"])
    assert exit_info.value.code in (0, None), buffer.getvalue()
    return yaml.safe_load(buffer.getvalue())


def test_console_script_help_lists_the_subcommands() -> None:
    assert SCRIPT.exists(), "pip install -e . creates the demo-lightning console script"
    out = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    for sub in ("fit", "validate", "test", "predict"):
        assert sub in out.stdout
    fit_help = subprocess.run([str(SCRIPT), "fit", "--help"], capture_output=True, text=True, timeout=120, env=_env())
    assert fit_help.returncode == 0 and "--trainer.strategy" in fit_help.stdout


def test_console_script_fit_exits_zero(tmp_path: Path) -> None:
    """A finished fit returns status 0 from the console script (its entry point returns None)."""
    proc = subprocess.run(
        [str(SCRIPT), "fit", "--config", str(ROOT / "configs" / "gpt_demo.yaml"), "--trainer.devices=1", "--trainer.max_steps=1",
         "--trainer.limit_val_batches=0", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
         f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.max_bytes=200000"],
        capture_output=True, text=True, timeout=300, env=_env(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Communication summary" in proc.stdout + proc.stderr


def test_the_expected_configs_exist() -> None:
    assert {c.stem for c in CONFIGS} >= {
        "gpt_demo", "gpt_ddp", "gpt_desloc", "gpt_demo_desloc", "resnet_demo_digits", "vit_desloc_digits",
    }


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_parses_to_our_classes(config: Path) -> None:
    resolved = _print_config("fit", "--config", str(config))
    model, data = resolved["model"]["class_path"], resolved["data"]["class_path"]
    assert model.startswith("demo_lightning.models.") and data.startswith("demo_lightning.data.")
    strategy = resolved["trainer"]["strategy"]
    assert strategy == "ddp" or strategy["class_path"] in ("demo_lightning.DeMoStrategy", "demo_lightning.DesLocStrategy")


def test_strategies_by_registered_name_and_short_class_names() -> None:
    resolved = _print_config(
        "fit", "--trainer.strategy=demo", "--model=GPTLightningModule", "--data=TextDataModule",
        "--trainer.callbacks+=CommunicationMonitor", "--trainer.callbacks+=LayerPolicy",
        "--trainer.callbacks.preset=language",
    )
    assert resolved["trainer"]["strategy"] == "demo"
    assert resolved["model"]["class_path"] == "demo_lightning.models.GPTLightningModule"
    callbacks = [c["class_path"] for c in resolved["trainer"]["callbacks"]]
    # jsonargparse prints the shortest import path: the package's top level exports the callbacks
    assert callbacks == ["demo_lightning.CommunicationMonitor", "demo_lightning.LayerPolicy"]
    assert resolved["trainer"]["callbacks"][1]["init_args"]["preset"] == "language"


def test_a_bad_strategy_argument_in_yaml_names_itself(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "gpt_demo.yaml").read_text().replace("topk: null", "topk: -3"))
    # jsonargparse reports the strategy's own ValueError among the Union's alternatives
    with pytest.raises(ValueError, match=r"topk must be a positive integer \(coefficients kept per chunk\), got -3"):
        build_cli(["--config", str(bad), "--trainer.devices=1"], run=False)


@pytest.fixture(scope="module")
def config_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("configs")
    proc = subprocess.run(
        [sys.executable, str(HERE / "config_run.py"), "--out", str(out), *map(str, CONFIGS)],
        env=_env(), capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_every_config_smoke_runs_on_two_processes(config_runs: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = config_runs
    from config_run import STEPS

    assert set(ranks[0]) == {c.stem for c in CONFIGS}
    for name, result in ranks[0].items():
        assert result["global_step"] == STEPS and result["world_size"] == 2, name
        assert torch.isfinite(torch.tensor(result["loss"])) and torch.isfinite(torch.tensor(result["val_loss"])), name
        if result["strategy"] == "DeMoStrategy":  # replicas identical after every DeMo step
            assert ranks[1][name]["params"] == result["params"], name
    assert ranks[0]["gpt_ddp"]["strategy"] == "DDPStrategy"
    assert ranks[0]["vit_desloc_digits"]["strategy"] == "DesLocStrategy"


def test_tensorboard_picture_from_a_config_run(config_runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    out, _ = config_runs
    png = tmp_path / "tb.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tensorboard_picture.py"), str(out / "gpt_demo"), "--out", str(png)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for tag in ("train/loss", "comm/bytes_sent_per_step", "comm/cumulative_ratio_vs_ddp", "comm/modeled_seconds_per_step/1Gbps"):
        assert tag in proc.stdout


def _ranks_printed(stdout: str) -> dict[int, str]:
    # the ranks share one pipe, so a line may start after another process's partial output
    pattern = r"rank (\d): ((?:params|syncs by tag) .*?ratio vs DDP [\d.]+x)"
    return {int(r): line for r, line in re.findall(pattern, stdout)}


def test_own_module_example_under_torchrun_keeps_replicas_identical() -> None:
    """torchrun sets the cluster environment multi-node runs use (TorchElasticEnvironment)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "own_module.py"), "--max-steps", "5"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    printed = _ranks_printed(proc.stdout)
    assert set(printed) == {0, 1}
    hashes = {r: line.split(",")[0] for r, line in printed.items()}
    assert hashes[0] == hashes[1] and "params" in hashes[0]
    assert "ratio vs DDP" in printed[0]


def test_desloc_example_with_its_own_optimizer_syncs_each_state_on_its_period() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "desloc_own_optimizer.py"), "--max-steps", "48"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    printed = _ranks_printed(proc.stdout)
    assert set(printed) == {0, 1}
    # 48 steps: parameters every 8 (6 syncs), momentum_buffer every 24 (2), square_avg every 48 (1)
    assert "'desloc/params': 6" in printed[0] and "'desloc/state/momentum_buffer': 2" in printed[0]
    assert "'desloc/state/square_avg': 1" in printed[0]


def test_users_own_text_and_image_folders(tmp_path: Path) -> None:
    from PIL import Image

    text = tmp_path / "corpus.txt"
    text.write_text("hello world, this is my own text. " * 400)
    dm = TextDataModule(path=str(text), block_size=16, batch_size=2)
    with pytest.raises(RuntimeError, match="training split is not loaded yet: call setup"):
        dm.train_dataloader()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (2, 17) and bytes(batch[0].tolist()).decode(errors="ignore").strip()
    # training drops the last partial batch (equal steps on every rank); validation keeps all, in order
    assert len(dm.train_dataloader()) == len(dm.train_set) // 2
    val = torch.cat(list(dm.val_dataloader()))
    assert torch.equal(val, torch.stack([dm.val_set[i] for i in range(len(dm.val_set))]))
    assert torch.equal(torch.cat(list(dm.test_dataloader())), val) and torch.equal(torch.cat(list(dm.predict_dataloader())), val)

    for label in ("cats", "dogs"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (20, 12), color=(40 * i, 100, 200 if label == "cats" else 0)).save(tmp_path / "images" / label / f"{i}.png")
    images = ImageDataModule(path=str(tmp_path / "images"), image_size=16, batch_size=4, val_fraction=0.2)
    images.setup("fit")
    x, y = next(iter(images.train_dataloader()))
    assert images.num_classes == 2 and x.shape == (4, 3, 16, 16) and set(y.tolist()) <= {0, 1}
    assert len(images.val_set) == 2 and len(images.train_set) == 8
    with pytest.raises(FileNotFoundError, match="one sub-folder per class"):
        ImageDataModule(path=str(tmp_path / "missing"))


def test_bundled_digits_and_timm_models_build_offline() -> None:
    from demo_lightning.models import ImageClassifier

    dm = ImageDataModule(image_size=32, batch_size=8)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and len(dm.train_set) + len(dm.val_set) == 1797
    for name, kwargs in (("resnet18", {}), ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 4})):
        model = ImageClassifier(model_name=name, model_kwargs=kwargs)
        assert model(x).shape == (8, 10)
    with pytest.raises(ValueError, match="model_name"):
        ImageClassifier(model_name="resnet_does_not_exist")


@pytest.mark.usefixtures("isolated_process_group")
def test_validate_test_and_predict_subcommands_and_the_progress_bar_bytes(tmp_path: Path) -> None:
    config = str(ROOT / "configs" / "gpt_demo.yaml")
    small = [
        "--config", config, "--trainer.devices=1", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.max_bytes=200000",
        "--data.init_args.max_val_bytes=4000", "--model.init_args.d_model=32", "--model.init_args.n_layer=1",
        "--model.init_args.n_head=2", "--model.init_args.block_size=32", "--data.init_args.block_size=32",
    ]
    with_bar = ["--trainer.enable_progress_bar=true" if a == "--trainer.enable_progress_bar=false" else a for a in small]
    with contextlib.redirect_stderr(io.StringIO()):  # the bar itself
        fitted = build_cli(["fit", *with_bar, "--trainer.max_steps=2", "--trainer.limit_val_batches=0"])
    # the strategy puts this step's bytes sent on the progress bar as a human size; the logged
    # metric stays a number (TensorBoard) and is not on the bar a second time
    trainer = fitted.trainer
    items = trainer.progress_bar_callback.get_metrics(trainer, fitted.model)
    assert re.fullmatch(r"\d+(\.\d)? (B|kB|MB|GB|TB)/step", items["comm/sent"]), items
    from demo_lightning.comm.ledger import human_bytes

    assert items["comm/sent"] == f"{human_bytes(trainer.strategy.last_traffic.sent_bytes)}/step"
    assert "comm/bytes_sent_per_step" not in items and "loss" in " ".join(items)
    assert float(trainer.callback_metrics["comm/bytes_sent_per_step"]) == trainer.strategy.last_traffic.sent_bytes
    ckpt = tmp_path / "fitted.ckpt"
    fitted.trainer.save_checkpoint(ckpt)
    validated = build_cli(["validate", *small, f"--ckpt_path={ckpt}"])
    assert torch.isfinite(torch.tensor(float(validated.trainer.callback_metrics["val/loss"])))
    tested = build_cli(["test", *small, f"--ckpt_path={ckpt}"])
    assert torch.isfinite(torch.tensor(float(tested.trainer.callback_metrics["test/loss"])))
    predicted = build_cli(["predict", *small, f"--ckpt_path={ckpt}", "--trainer.limit_predict_batches=2"])
    assert predicted.trainer.predict_loop.predictions  # next-byte predictions per window
    first = predicted.trainer.predict_loop.predictions[0]
    assert first.dtype == torch.int64 and first.shape[-1] == 32
