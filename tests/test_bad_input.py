"""One table of bad input: every strategy, callback, schedule and optimizer argument, and the
combinations that cannot work, each with the exception (or warning) it must raise, a pattern that
names the argument and a pattern that names the fix. One test per row.

Rows marked ``fit`` run a 1-process fit (a process group of one, as a real job has) because the
error can only show once the Trainer, the optimizer or a checkpoint exist.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from demo_lightning import DeMoStrategy, DesLocStrategy
from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig
from demo_lightning.callbacks import (
    AdaptiveKeepRatio,
    AdaptiveSyncPeriods,
    CommunicationMonitor,
    LayerPolicy,
    LayerRule,
    Schedule,
)
from demo_lightning.optim import DecoupledMomentum

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Row:
    """``act(tmp_path)`` must raise ``error`` (or warn it) with a message matching ``argument`` and ``fix``."""

    id: str
    act: Callable[[Path], Any]
    error: type
    argument: str
    fix: str
    fit: bool = False


# ---------------------------------------------------------------------------- a tiny module and 1-process fits
class _Tiny(pl.LightningModule):
    def __init__(self, optimizer: Callable[[list[nn.Parameter]], Any] | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.make_optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=1e-2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return self.make_optimizer(list(self.parameters()))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)), batch_size=8)


def _fit(strategy: Any = "demo", optimizer: Any = None, callbacks: tuple = (), plugins: tuple = (), ckpt: Path | None = None, **trainer: Any) -> pl.Trainer:
    options = dict(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    options.update(trainer)
    t = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, callbacks=list(callbacks), plugins=list(plugins), **options)
    t.fit(_Tiny(optimizer), _loader(), ckpt_path=str(ckpt) if ckpt else None)
    return t


def _fp16_scaler() -> Any:
    # Lightning turns precision="16-mixed" into bf16 on CPU: pass the fp16 plugin with its GradScaler directly
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def _zero(params: list[nn.Parameter]) -> Any:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=1e-2)


def _checkpoint_from_two_workers(tmp_path: Path) -> None:
    """A 1-process demo checkpoint rewritten as if 2 workers had saved it, then resumed by 1 (its
    momenta restart from zero: no shard is read, so the shards directory may as well be gone)."""
    ckpt = tmp_path / "two.ckpt"
    _fit(DeMoStrategy(dense_below=0, dense_vectors=False)).save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=True)
    extra = state["optimizer_states"][0]["demo_lightning"]
    assert extra["layout"] == "shards"
    extra["world_size"] = 2
    torch.save(state, ckpt)
    shutil.rmtree(f"{ckpt}.shards")
    _fit(DeMoStrategy(dense_below=0, dense_vectors=False), ckpt=ckpt, max_steps=3)


def _param() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3))]


def _baseline_run(tmp_path: Path) -> Path:
    """A DDP run's TensorBoard directory with a ``train/loss`` curve (for CommunicationMonitor(baseline=...))."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "ddp" / "version_0")) as writer:
        for step in range(3):
            writer.add_scalar("train/loss", 2.0 - 0.1 * step, step)
    return tmp_path / "ddp" / "version_0"


# ---------------------------------------------------------------------------- the table
RANGE = r"must (lie in|be)"  # the message states the valid values: that is the fix for a value out of range

ROWS = [
    # DeMoStrategy
    Row("demo-chunk", lambda _: DeMoStrategy(chunk=0), ValueError, r"\bchunk\b", r"positive integer.*paper uses 64"),
    Row("demo-topk", lambda _: DeMoStrategy(topk=0), ValueError, r"\btopk\b", r"positive integer"),
    Row("demo-keep_ratio", lambda _: DeMoStrategy(keep_ratio=1.5), ValueError, r"keep_ratio", r"\(0, 1\].*e\.g\. keep_ratio=0\.01"),
    Row("demo-topk-and-keep_ratio", lambda _: DeMoStrategy(topk=4, keep_ratio=0.1), ValueError, r"topk.*keep_ratio", r"drop one of them"),
    Row("demo-decay", lambda _: DeMoStrategy(decay=1.0), ValueError, r"\bdecay\b", r"\[0, 1\).*paper uses 0\.999"),
    Row("demo-selection", lambda _: DeMoStrategy(selection="random"), ValueError, r"selection", r"one of \('topk', 'lowpass', 'shared'\)"),
    Row("demo-selection-shared-sign", lambda _: DeMoStrategy(selection="shared"), ValueError, r"selection='shared'.*value_format='sign'",
        r"use value_format='fp32', 'bf16' or 'fp16'"),
    Row("demo-transform", lambda _: DeMoStrategy(transform="wavelet"), ValueError, r"\btransform\b", r"one of \('dct', 'haar', 'identity'\)"),
    Row("demo-transform-identity-lowpass", lambda _: DeMoStrategy(transform="identity", selection="lowpass"), ValueError,
        r"transform='identity'.*selection='lowpass'", r"use selection='topk'.*keep_ratio=1\.0"),
    Row("demo-hierarchy", lambda _: DeMoStrategy(hierarchy="rack"), ValueError, r"hierarchy", r"one of \('flat', 'node'\)"),
    Row("demo-value_format", lambda _: DeMoStrategy(value_format="fp8"), ValueError, r"value_format", r"one of \('fp32'"),
    Row("demo-compensation", lambda _: DeMoStrategy(compensation=1.5), ValueError, r"\bcompensation\b", r"\[0, 1\].*0 switches it off"),
    Row("demo-fp16_share", lambda _: DeMoStrategy(value_format="mixed", fp16_share=1.0), ValueError, r"fp16_share", r"\(0, 1\).*e\.g\. 0\.25"),
    Row("demo-position_group_size", lambda _: DeMoStrategy(position_group_size=0), ValueError, r"position_group_size", r"share their positions; 1: off"),
    Row("demo-position_format", lambda _: DeMoStrategy(position_format="gamma"), ValueError, r"position_format", r"'packed'.*'elias_fano'"),
    Row("demo-position_format-mixed", lambda _: DeMoStrategy(position_format="elias_fano", value_format="mixed"), ValueError,
        r"position_format", r"use another value_format, or position_format='packed'"),
    Row("demo-position_group_size-lowpass", lambda _: DeMoStrategy(position_group_size=4, selection="lowpass"), ValueError,
        r"position_group_size=4.*selection='lowpass'", r"use selection='topk', or position_group_size=1"),
    Row("demo-position_group_size-shared", lambda _: DeMoStrategy(position_group_size=2, selection="shared", value_format="bf16"),
        ValueError, r"position_group_size=2.*selection='shared'", r"use selection='topk'"),
    Row("demo-update", lambda _: DeMoStrategy(update="adam"), ValueError, r"\bupdate\b", r"one of \('sign', 'raw', 'normalized'\)"),
    Row("demo-dense_below", lambda _: DeMoStrategy(dense_below=-1), ValueError, r"dense_below", r"non-negative integer"),
    Row("demo-dense_format", lambda _: DeMoStrategy(dense_format="fp16"), ValueError, r"dense_format", r"'bf16'.*'fp32'"),
    Row("demo-dense_vectors", lambda _: DeMoStrategy(dense_vectors="yes"), ValueError, r"dense_vectors", r"True \(1-D tensors.*or False"),
    Row("demo-early_steps", lambda _: DeMoStrategy(early_steps=-5), ValueError, r"early_steps", r"0 switches it off"),
    Row("demo-early_topk_factor", lambda _: DeMoStrategy(early_topk_factor=0), ValueError, r"early_topk_factor", r"1 switches it off"),
    Row("demo-retain_sent", lambda _: DeMoStrategy(retain_sent=1.0), ValueError, r"retain_sent", r"\[0, 1\).*takes it all out"),
    Row("demo-gradient_ema", lambda _: DeMoStrategy(gradient_ema=1.0), ValueError, r"gradient_ema", r"\[0, 1\).*Signum's 0.9"),
    Row("demo-clip_grad_norm", lambda _: DeMoStrategy(clip_grad_norm=0.0), ValueError, r"clip_grad_norm", r"None switches it off"),
    Row("demo-clip_grad_norm-word", lambda _: DeMoStrategy(clip_grad_norm="on"), ValueError, r"clip_grad_norm",  # type: ignore[arg-type]
        r"None \(off\) or 'auto'"),
    Row("demo-bucket_cap_mb", lambda _: DeMoStrategy(bucket_cap_mb=0), ValueError, r"bucket_cap_mb", r"must be > 0"),
    Row("demo-param_sync_every", lambda _: DeMoStrategy(param_sync_every=0), ValueError, r"param_sync_every", r"integer period >= 1"),
    Row("demo-state_sync_every-type", lambda _: DeMoStrategy(state_sync_every=[4]), ValueError, r"state_sync_every", r"e\.g\. \{'exp_avg': 48"),
    Row("demo-state_sync_every-step", lambda _: DeMoStrategy(state_sync_every={"step": 4}), ValueError, r"state_sync_every\['step'\]", r"remove 'step'"),
    Row("demo-timeout-zero", lambda _: DeMoStrategy(timeout=0), ValueError, r"timeout", r"must be > 0 seconds"),
    Row("demo-timeout-type", lambda _: DeMoStrategy(timeout="1h"), ValueError, r"timeout", r"seconds \(a number\) or a datetime\.timedelta"),
    Row("demo-timeout-timedelta", lambda _: DeMoStrategy(timeout=timedelta(0)), ValueError, r"timeout", r"must be > 0 seconds"),
    Row("demo-start_method", lambda _: DeMoStrategy(start_method="thread"), ValueError, r"start_method", r"one of \('popen', 'spawn'"),
    Row("demo-process_group_backend", lambda _: DeMoStrategy(process_group_backend="tcp"), ValueError, r"process_group_backend", r"one of \[.*'gloo'.*or None"),
    Row("demo-nonfinite", lambda _: DeMoStrategy(nonfinite="ignore"), ValueError, r"nonfinite", r"'skip'.*'raise'"),
    # DesLocStrategy
    Row("desloc-param_sync_every-zero", lambda _: DesLocStrategy(param_sync_every=0), ValueError, r"param_sync_every", r"integer period >= 1"),
    Row("desloc-param_sync_every-none", lambda _: DesLocStrategy(param_sync_every=None), ValueError, r"param_sync_every", r"integer period >= 1"),
    Row("desloc-state_sync_every-period", lambda _: DesLocStrategy(state_sync_every={"exp_avg": 0}), ValueError, r"state_sync_every\['exp_avg'\]", r"integer period >= 1"),
    Row("desloc-state_sync_every-step", lambda _: DesLocStrategy(state_sync_every={"step": 4}), ValueError, r"state_sync_every\['step'\]", r"remove 'step'"),
    Row("desloc-sync_buffers", lambda _: DesLocStrategy(sync_buffers="no"), ValueError, r"sync_buffers", r"True or False"),
    Row("desloc-dense_format", lambda _: DesLocStrategy(dense_format="int8"), ValueError, r"dense_format", r"'bf16'.*'fp32'"),
    Row("desloc-dense_below", lambda _: DesLocStrategy(compress_params=True, dense_below=-3), ValueError, r"dense_below", r"non-negative integer"),
    Row("desloc-dense_vectors", lambda _: DesLocStrategy(compress_params=True, dense_vectors=1), ValueError, r"dense_vectors", r"True \(1-D tensors.*or False"),
    Row("desloc-compress_params", lambda _: DesLocStrategy(compress_params="yes"), ValueError, r"compress_params", r"True or False"),
    Row("desloc-chunk", lambda _: DesLocStrategy(compress_params=True, chunk=0), ValueError, r"\bchunk\b", r"positive integer"),
    Row("desloc-topk", lambda _: DesLocStrategy(compress_params=True, topk=-1), ValueError, r"\btopk\b", r"positive integer"),
    Row("desloc-keep_ratio", lambda _: DesLocStrategy(compress_params=True, keep_ratio=0.0), ValueError, r"keep_ratio", r"\(0, 1\]"),
    Row("desloc-value_format", lambda _: DesLocStrategy(compress_params=True, value_format="fp4"), ValueError, r"value_format", r"one of"),
    Row("desloc-position_format", lambda _: DesLocStrategy(compress_params=True, selection="lowpass", position_format="elias_fano"),
        ValueError, r"position_format", r"use selection='topk', or position_format='packed'"),
    Row("desloc-fp16_share", lambda _: DesLocStrategy(compress_params=True, fp16_share=0), ValueError, r"fp16_share", r"\(0, 1\)"),
    Row("desloc-selection", lambda _: DesLocStrategy(compress_params=True, selection="random"), ValueError, r"selection", r"one of"),
    Row("desloc-transform", lambda _: DesLocStrategy(compress_params=True, transform="fft"), ValueError, r"\btransform\b",
        r"one of \('dct', 'haar', 'identity'\)"),
    Row("desloc-bucket_cap_mb", lambda _: DesLocStrategy(bucket_cap_mb=-1), ValueError, r"bucket_cap_mb", r"must be > 0"),
    Row("desloc-process_group_backend", lambda _: DesLocStrategy(process_group_backend=1), ValueError, r"process_group_backend", r"one of \[.*'gloo'.*or None"),
    Row("desloc-timeout", lambda _: DesLocStrategy(timeout=-5), ValueError, r"timeout", r"must be > 0 seconds"),
    Row("desloc-start_method", lambda _: DesLocStrategy(start_method="fork-exec"), ValueError, r"start_method", r"one of \('popen'"),
    Row("desloc-nonfinite", lambda _: DesLocStrategy(nonfinite=True), ValueError, r"nonfinite", r"'skip'.*'raise'"),
    Row("desloc-final_sync", lambda _: DesLocStrategy(final_sync="yes"), ValueError, r"final_sync", r"True or False"),
    Row(
        "desloc-state-key-the-optimizer-lacks",
        lambda _: _fit(DesLocStrategy(param_sync_every=1, state_sync_every={"momentum_buffer": 1}), lambda p: torch.optim.AdamW(p)),
        ValueError, r"state_sync_every names 'momentum_buffer'", r"keeps only \['exp_avg', 'exp_avg_sq', 'step'\]; name one of those keys", fit=True,
    ),
    # Schedule
    Row("schedule-kind", lambda _: Schedule(kind="exp"), ValueError, r"Schedule kind", r"one of \('constant'"),
    Row("schedule-start", lambda _: Schedule(start="high"), ValueError, r"Schedule start", r"must be a number"),
    Row("schedule-end", lambda _: Schedule(kind="linear", start=0.1), ValueError, r"\bend\b", r"needs end \(the value the ramp reaches\)"),
    Row("schedule-steps", lambda _: Schedule(kind="cosine", start=0.1, end=0.2, steps=0), ValueError, r"Schedule steps", r"positive integer or None"),
    Row("schedule-begin", lambda _: Schedule(begin=-1), ValueError, r"Schedule begin", r"non-negative integer"),
    Row("schedule-milestones-missing", lambda _: Schedule(kind="milestones"), ValueError, r"milestones", r"e\.g\. \{5000: 0\.1\}"),
    Row("schedule-milestones-key", lambda _: Schedule(kind="milestones", milestones={-5: 0.1}), ValueError, r"milestones keys", r"non-negative integer steps"),
    Row("schedule-milestones-value", lambda _: Schedule(kind="milestones", milestones={5: "x"}), ValueError, r"milestones values", r"must be numbers"),
    # AdaptiveKeepRatio
    Row("akr-keep_ratio", lambda _: AdaptiveKeepRatio(keep_ratio=0.0), ValueError, r"keep_ratio", r"\(0\.0, 1\.0\]"),
    Row("akr-keep_ratio-schedule", lambda _: AdaptiveKeepRatio(keep_ratio=Schedule(kind="linear", start=0.01, end=2.0)), ValueError, r"keep_ratio", r"\(0\.0, 1\.0\]"),
    Row("akr-keep_ratio-type", lambda _: AdaptiveKeepRatio(keep_ratio="1/32"), ValueError, r"keep_ratio", r"a number or a Schedule"),
    Row("akr-energy", lambda _: AdaptiveKeepRatio(energy=1.5), ValueError, r"\benergy\b", r"\(0, 1\]"),
    Row("akr-min_keep_ratio", lambda _: AdaptiveKeepRatio(min_keep_ratio=0.0), ValueError, r"min_keep_ratio", r"\(0, 1\]"),
    Row("akr-max_keep_ratio", lambda _: AdaptiveKeepRatio(max_keep_ratio=1.5), ValueError, r"max_keep_ratio", r"\(0, 1\]"),
    Row("akr-min-above-max", lambda _: AdaptiveKeepRatio(min_keep_ratio=0.5, max_keep_ratio=0.1), ValueError, r"min_keep_ratio.*max_keep_ratio", r"must not exceed"),
    Row("akr-update_every", lambda _: AdaptiveKeepRatio(update_every=0), ValueError, r"update_every", r"positive integer"),
    # AdaptiveSyncPeriods (and the averager's set_period it drives)
    Row("asp-min_period", lambda _: AdaptiveSyncPeriods(min_period=0), ValueError, r"min_period", r"integer period >= 1"),
    Row("asp-max_period", lambda _: AdaptiveSyncPeriods(max_period={"params": 0}), ValueError, r"max_period\['params'\]", r"integer period >= 1"),
    Row("asp-min-above-max", lambda _: AdaptiveSyncPeriods(min_period=64, max_period=16), ValueError, r"min_period.*max_period", r"must not exceed"),
    Row("asp-factor", lambda _: AdaptiveSyncPeriods(factor=1.0), ValueError, r"\bfactor\b", r"must be > 1"),
    Row("asp-low", lambda _: AdaptiveSyncPeriods(low=0.0), ValueError, r"\blow\b", r"\(0, 1\]"),
    Row("asp-high", lambda _: AdaptiveSyncPeriods(high=0.5), ValueError, r"\bhigh\b", r"must be >= 1"),
    Row("asp-low-above-high", lambda _: AdaptiveSyncPeriods(low=1.0, high=1.0), ValueError, r"low \(1\.0\).*high", r"must be below"),
    Row("asp-target", lambda _: AdaptiveSyncPeriods(target=-1.0), ValueError, r"\btarget\b", r"must be > 0"),
    Row("asp-target-name", lambda _: AdaptiveSyncPeriods(target={"weights": 0.1}), ValueError, r"target names 'weights'", r"'params' or 'state/"),
    Row("asp-quantities", lambda _: AdaptiveSyncPeriods(quantities="params"), ValueError, r"quantities", r"list of quantity names"),
    Row(
        "asp-quantities-unknown", lambda _: _fit("desloc", callbacks=(AdaptiveSyncPeriods(quantities=["state/nope"]),)),
        ValueError, r"names \['state/nope'\]", r"name those quantities", fit=True,
    ),
    Row("asp-states_follow_params", lambda _: AdaptiveSyncPeriods(states_follow_params="yes"), ValueError, r"states_follow_params", r"True or False"),
    Row("asp-start_step", lambda _: AdaptiveSyncPeriods(start_step=-1), ValueError, r"start_step", r"non-negative integer"),
    Row("asp-log_periods", lambda _: AdaptiveSyncPeriods(log_periods="no"), ValueError, r"log_periods", r"True or False"),
    Row(
        "asp-with-demo", lambda _: _fit("demo", callbacks=(AdaptiveSyncPeriods(),)),
        ValueError, r"AdaptiveSyncPeriods.*DeMoStrategy has no DES-LOC averager", r"use Trainer\(strategy='desloc'\)", fit=True,
    ),
    Row("desloc-set_period-name", lambda _: DesLocAverager(torch.optim.SGD(_param(), lr=0.1), DesLocConfig(param_sync_every=2)).set_period("weights", 4),
        ValueError, r"name='weights'", r"it averages \['params'"),
    Row("desloc-set_period-period", lambda _: DesLocAverager(torch.optim.SGD(_param(), lr=0.1), DesLocConfig(param_sync_every=2)).set_period("params", 0),
        ValueError, r"\bperiod\b", r"integer period >= 1"),
    Row("akr-max_bytes_per_step", lambda _: AdaptiveKeepRatio(max_bytes_per_step=0), ValueError, r"max_bytes_per_step", r"positive integer \(bytes\) or None"),
    Row(
        "akr-with-ddp", lambda _: _fit("ddp", callbacks=(AdaptiveKeepRatio(),)),
        ValueError, r"AdaptiveKeepRatio.*DDPStrategy has no DeMo exchange", r"use Trainer\(strategy='demo'\) or remove the callback", fit=True,
    ),
    Row(
        "akr-with-desloc", lambda _: _fit("desloc", callbacks=(AdaptiveKeepRatio(),)),
        ValueError, r"DesLocStrategy has no DeMo exchange", r"use Trainer\(strategy='demo'\) or remove the callback", fit=True,
    ),
    Row(
        "akr-ramp-without-an-end", lambda _: _fit(callbacks=(AdaptiveKeepRatio(),), max_steps=-1, max_epochs=-1),
        ValueError, r"keep_ratio ramps until the end of training", r"set max_steps, or the Schedule's steps", fit=True,
    ),
    # LayerRule / LayerPolicy
    Row("rule-pattern", lambda _: LayerRule(pattern=""), ValueError, r"LayerRule pattern", r"non-empty glob or 're:<regex>'"),
    Row("rule-regex", lambda _: LayerRule(pattern="re:("), ValueError, r"LayerRule pattern 're:\('", r"not a valid regex"),
    Row("rule-kind", lambda _: LayerRule(kind="mlp"), ValueError, r"LayerRule kind", r"one of \(.*'ffn'"),
    Row("rule-beta", lambda _: LayerRule(beta=1.0), ValueError, r"LayerRule beta", r"\[0\.0, 1\.0\)"),
    Row("rule-keep_ratio", lambda _: LayerRule(keep_ratio=2.0), ValueError, r"LayerRule keep_ratio", r"\(0\.0, 1\.0\]"),
    Row("rule-keep_ratio-and-topk", lambda _: LayerRule(keep_ratio=0.1, topk=4), ValueError, r"keep_ratio or topk", r"drop one of them"),
    Row("rule-topk", lambda _: LayerRule(topk=0), ValueError, r"\btopk\b", r"positive integer"),
    Row("rule-chunk", lambda _: LayerRule(chunk=0), ValueError, r"LayerRule chunk", r"positive integer"),
    Row("rule-dense", lambda _: LayerRule(dense="yes"), ValueError, r"LayerRule dense", r"True, False or None"),
    Row("rule-lam", lambda _: LayerRule(lam=-0.1), ValueError, r"LayerRule lam", r"\[0\.0, inf\]"),
    Row("policy-preset", lambda _: LayerPolicy(preset="audio"), ValueError, r"preset", r"one of \('language', 'vision'\) or None"),
    Row("policy-small_batch", lambda _: LayerPolicy(preset="vision", small_batch="yes"), ValueError, r"\bsmall_batch\b",
        r"True, False or None"),
    Row("policy-small_batch-without-preset", lambda _: LayerPolicy(small_batch=True), ValueError, r"small_batch=True.*preset is None",
        r"pass preset='language' or 'vision', or leave small_batch=None"),
    Row("policy-rules", lambda _: LayerPolicy(rules=[{"pattern": "*"}]), ValueError, r"rules\[0\]", r"must be a LayerRule"),
    Row(
        "policy-lam-without-decoupled-momentum", lambda _: _fit("demo", callbacks=(LayerPolicy(rules=[LayerRule(lam=0.1)], print_settings=False),)),
        ValueError, r"sets lam for net\.0\.weight", r"use demo_lightning\.optim\.DecoupledMomentum, or remove lam from the rule", fit=True,
    ),
    Row(
        "policy-beta-with-ddp", lambda _: _fit("ddp", callbacks=(LayerPolicy(rules=[LayerRule(beta=0.9)], print_settings=False),)),
        ValueError, r"sets beta for net\.0\.weight", r"use strategy='demo' or demo_lightning\.optim\.DecoupledMomentum, or remove beta", fit=True,
    ),
    Row(
        "policy-ramp-without-an-end",
        lambda _: _fit("demo", callbacks=(LayerPolicy(rules=[LayerRule(beta=Schedule(kind="linear", start=0.9, end=0.99))], print_settings=False),),
                       max_steps=-1, max_epochs=-1),
        ValueError, r"beta schedule for net\.0\.weight ramps until the end of training", r"set max_steps or its steps", fit=True,
    ),
    # CommunicationMonitor
    Row("monitor-log_every", lambda _: CommunicationMonitor(log_every=0), ValueError, r"log_every", r"integer >= 1"),
    Row("monitor-inter_gbps", lambda _: CommunicationMonitor(inter_gbps=10), ValueError, r"inter_gbps and intra_gbps go together",
        r"e\.g\. CommunicationMonitor\(inter_gbps=10, intra_gbps=400\)"),
    Row("monitor-intra_gbps", lambda _: CommunicationMonitor(inter_gbps=10, intra_gbps=-1), ValueError, r"intra_gbps", r"must be > 0"),
    Row("monitor-histogram_every", lambda _: CommunicationMonitor(histogram_every=-1), ValueError, r"histogram_every", r"integer >= 0"),
    Row("monitor-bandwidths_gbps", lambda _: CommunicationMonitor(bandwidths_gbps=[]), ValueError, r"bandwidths_gbps", r"non-empty list of positive numbers"),
    Row("monitor-latency_ms", lambda _: CommunicationMonitor(latency_ms=-1), ValueError, r"latency_ms", r"number >= 0"),
    Row("monitor-divergence_every", lambda _: CommunicationMonitor(divergence_every=0), ValueError, r"divergence_every", r"positive integer or None"),
    Row("monitor-bucket_cap_mb", lambda _: CommunicationMonitor(bucket_cap_mb=0), ValueError, r"bucket_cap_mb", r"must be > 0"),
    Row(
        "monitor-with-ddp", lambda _: _fit("ddp", callbacks=(CommunicationMonitor(),)),
        ValueError, r"CommunicationMonitor.*DDPStrategy has none", r"use Trainer\(strategy='demo'\) or 'desloc', or remove the callback", fit=True,
    ),
    Row("monitor-baseline-type", lambda _: CommunicationMonitor(baseline=3), ValueError, r"\bbaseline\b",
        r"e\.g\. baseline='lightning_logs/ddp/version_0'"),
    Row(
        "monitor-baseline-missing", lambda p: _fit("demo", callbacks=(CommunicationMonitor(baseline=p / "ddp"),)),
        ValueError, r"baseline='.*ddp' does not exist", r"pass baseline= the TensorBoard run directory of the DDP run", fit=True,
    ),
    Row("monitor-loss_tag", lambda _: CommunicationMonitor(loss_tag=""), ValueError, r"\bloss_tag\b", r"e\.g\. 'train/loss'"),
    Row(
        "monitor-loss_tag-not-in-baseline",
        lambda p: _fit("demo", callbacks=(CommunicationMonitor(baseline=_baseline_run(p), loss_tag="train/nll"),)),
        ValueError, r"no scalar 'train/nll' \(loss_tag='train/nll'\)", r"pass loss_tag= the tag the module logs its training loss under", fit=True,
    ),
    # DecoupledMomentum
    Row("dm-lr", lambda _: DecoupledMomentum(_param(), lr=0.0), ValueError, r"\blr\b", r"\(0, inf\)"),
    Row("dm-beta", lambda _: DecoupledMomentum(_param(), lr=0.1, beta=1.0), ValueError, r"\bbeta\b", r"\[0, 1\)"),
    Row("dm-lam", lambda _: DecoupledMomentum(_param(), lr=0.1, lam=-1.0), ValueError, r"\blam\b", r"\[0, inf\)"),
    Row("dm-eps", lambda _: DecoupledMomentum(_param(), lr=0.1, eps=0.0), ValueError, r"\beps\b", r"\(0, inf\)"),
    Row("dm-weight_decay", lambda _: DecoupledMomentum(_param(), lr=0.1, weight_decay=-0.1), ValueError, r"weight_decay", r"\[0, inf\)"),
    Row("dm-param_options", lambda _: DecoupledMomentum(_param(), lr=0.1).set_param_options(torch.zeros(2), lam=0.1), ValueError, r"\bparam\b", r"not a parameter of this optimizer"),
    # combinations that cannot work
    Row(
        "demo-fp16-grad-scaler", lambda _: _fit("demo", plugins=(_fp16_scaler(),)),
        ValueError, r"precision='16-mixed'", r"Use precision='bf16-mixed' or '32-true'", fit=True,
    ),
    Row(
        "desloc-fp16-grad-scaler", lambda _: _fit("desloc", plugins=(_fp16_scaler(),)),
        ValueError, r"precision='16-mixed'", r"Use precision='bf16-mixed' or '32-true'", fit=True,
    ),
    Row(
        "demo-zero-redundancy-optimizer", lambda _: _fit("demo", _zero),
        ValueError, r"sharded optimizer ZeroRedundancyOptimizer", r"Use the plain optimizer it wraps", fit=True,
    ),
    Row(
        "desloc-lbfgs", lambda _: _fit("desloc", lambda p: torch.optim.LBFGS(p)),
        ValueError, r"cannot drive LBFGS", r"Use a first-order optimizer", fit=True,
    ),
    Row(
        "demo-sign-update-with-adamw", lambda _: _fit("demo", lambda p: torch.optim.AdamW(p)),
        UserWarning, r"update='sign'.*AdamW", r"use torch\.optim\.SGD\(momentum=0\), or update='raw'", fit=True,
    ),
    Row(
        "checkpoint-from-another-world-size", _checkpoint_from_two_workers,
        UserWarning, r"comes from 2 workers, this run has 1", r"DeMo momenta restart from zero", fit=True,
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_input_names_the_argument_and_the_fix(row: Row, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if row.fit:
        request.getfixturevalue("isolated_process_group")
    if issubclass(row.error, Warning):
        with pytest.warns(row.error) as record:
            row.act(tmp_path)
        messages = [str(w.message) for w in record if re.search(row.argument, str(w.message))]
        assert messages, [str(w.message) for w in record]
        message = messages[0]
    else:
        with pytest.raises(row.error) as info:
            row.act(tmp_path)
        message = str(info.value)
    assert re.search(row.argument, message), f"the message does not name the argument: {message}"
    assert re.search(row.fix, message), f"the message does not name the fix: {message}"


def test_table_covers_every_public_argument() -> None:
    """Every constructor argument a user sets has at least one row (the Trainer sets the rest)."""
    import inspect

    set_by_trainer = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin", "self"}
    ids = " ".join(row.id for row in ROWS)
    prefixes = {DeMoStrategy: "demo-", DesLocStrategy: "desloc-", AdaptiveKeepRatio: "akr-", AdaptiveSyncPeriods: "asp-", LayerRule: "rule-",
                LayerPolicy: "policy-", CommunicationMonitor: "monitor-", Schedule: "schedule-", DecoupledMomentum: "dm-"}
    missing = []
    for cls, prefix in prefixes.items():
        for name in inspect.signature(cls.__init__).parameters:
            if name in set_by_trainer or name in ("params", "print_settings", "defaults"):
                continue
            if f"{prefix}{name}" not in ids:
                missing.append(f"{cls.__name__}({name}=...)")
    assert not missing, f"no bad-input row for {missing}"
