"""Smoke-runs configs/*.yaml through the ``demo-lightning`` CLI in one 2-process launch.

Driven by tests/test_cli.py: for every config given, builds it with the same parser as the console
script (``demo_lightning.cli.main(args, run=False)``) plus overrides for a few steps, then fits.
Lightning's launcher re-runs this script for rank 1, which fits the same sequence. Each rank writes
``rank{R}.json``: per config, the steps run, the last loss, and the strategy's class.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from demo_lightning.cli import build_cli

STEPS = 3


def overrides(config: str, out: Path) -> list[str]:
    name = Path(config).stem
    args = [
        f"--trainer.max_steps={STEPS}", f"--trainer.val_check_interval={STEPS}", "--trainer.limit_val_batches=1",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1",
        f"--trainer.logger.init_args.save_dir={out}", f"--trainer.logger.init_args.name={name}",
        f"--model.init_args.max_steps={STEPS}",
    ]
    if name.startswith("gpt"):
        args.append("--data.init_args.max_bytes=300000")
    return args


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("configs", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    results = {}
    for config in args.configs:
        cli = build_cli(["--config", config, *overrides(config, out)], run=False)
        assert cli is not None
        cli.trainer.fit(cli.model, cli.datamodule)
        results[Path(config).stem] = {
            "global_step": cli.trainer.global_step,
            "loss": float(cli.trainer.callback_metrics["train/loss"]),
            "val_loss": float(cli.trainer.callback_metrics.get("val/loss", float("nan"))),
            "strategy": type(cli.trainer.strategy).__name__,
            "world_size": cli.trainer.world_size,
            "params": [float(p.detach().double().sum()) for p in cli.model.parameters()][:4],
        }
    (out / f"rank{os.environ.get('LOCAL_RANK', '0')}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
