"""Callbacks: schedules, layer kinds, energy oracle, budget, policies (and their composition with the
adaptive keep ratio, in either order and in the shipped config), monitor; contract runs at 1 and 2
workers (every callback in the package: defaults, fit twice, resume to the same schedule position);
TensorBoard event files read back."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import scipy.fft
import torch
from torch import nn

from demo_lightning.algorithms import DeMoExchange, TensorSettings
from demo_lightning.callbacks import AdaptiveKeepRatio, LayerPolicy, LayerRule, Schedule, layer_kinds
from demo_lightning.callbacks.communication_monitor import modeled_seconds
from demo_lightning.comm import ByteLedger

from callback_run import STEPS, callback_classes
from dist_helpers import clean_env, free_port
from exchange_inputs import unclipped_of

HERE = Path(__file__).parent


# ---------------------------------------------------------------- schedules
def test_schedule_kinds_against_their_formulas() -> None:
    assert Schedule(kind="constant", start=0.3)(10_000) == 0.3
    lin = Schedule(kind="linear", start=0.9, end=0.99, steps=100, begin=10)
    assert lin(0) == 0.9 and lin(10) == 0.9 and lin(110) == pytest.approx(0.99) and lin(10_000) == pytest.approx(0.99)
    assert lin(60) == pytest.approx(0.945)
    cos = Schedule(kind="cosine", start=0.0, end=1.0)
    assert cos(50, total_steps=100) == pytest.approx(0.5)
    assert cos(25, total_steps=100) == pytest.approx(0.5 * (1 - math.cos(math.pi * 0.25)))
    steps = Schedule(kind="milestones", start=0.05, milestones={100: 0.1, 50: 0.07})
    assert [steps(s) for s in (0, 49, 50, 99, 100, 500)] == [0.05, 0.05, 0.07, 0.07, 0.1, 0.1]
    with pytest.raises(ValueError, match="total_steps"):
        cos(5)


# bad arguments of every callback and Schedule: tests/test_bad_input.py (one row each)


# ---------------------------------------------------------------- layer kinds
class _Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.mha = nn.MultiheadAttention(8, 2)
        self.attn = nn.Module()
        self.attn.q_proj, self.attn.v_proj, self.attn.out_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.mlp = nn.Module()
        self.mlp.up, self.mlp.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.head = nn.Linear(8, 2)
        self.cls_token = nn.Parameter(torch.zeros(8))
        self.scale = nn.Parameter(torch.ones(1))


def test_layer_kinds_of_common_modules() -> None:
    kinds = layer_kinds(_Zoo())
    assert kinds["embed.weight"] == "embedding"
    assert kinds["conv.weight"] == kinds["conv.bias"] == "conv"
    assert kinds["bn.weight"] == "norm"
    assert kinds["mha.in_proj_weight"] == "attention_qk"
    assert kinds["mha.out_proj.weight"] == "attention_out"
    assert kinds["attn.q_proj.weight"] == "attention_qk"
    assert kinds["attn.v_proj.weight"] == "attention_v"
    assert kinds["attn.out_proj.weight"] == "attention_out"
    assert kinds["mlp.up.weight"] == kinds["mlp.down.weight"] == "ffn"
    assert kinds["head.weight"] == "linear"
    assert kinds["cls_token"] == "embedding"
    assert kinds["scale"] == "other"


def test_layer_kinds_of_the_bundled_gpt() -> None:
    from demo_lightning.models import GPT

    kinds = layer_kinds(GPT(d_model=32, n_layer=1, n_head=2, block_size=16))
    assert kinds["tok.weight"] == kinds["pos.weight"] == "embedding"
    assert kinds["blocks.0.qkv.weight"] == "attention_qk"
    assert kinds["blocks.0.proj.weight"] == "attention_out"  # next to the fused qkv
    assert kinds["blocks.0.fc.weight"] == kinds["blocks.0.fc_out.weight"] == "ffn"
    assert kinds["blocks.0.ln1.weight"] == kinds["ln_f.bias"] == "norm"


# ---------------------------------------------------------------- energy oracle
def test_energy_captured_and_curve_match_a_scipy_dct() -> None:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(64, 128, dtype=torch.float64))
    opt = torch.optim.SGD([weight], lr=0.1)
    exchange = DeMoExchange(opt, unclipped_of(chunk=32, topk=10, decay=0.5, update="raw", dense_below=0, dense_vectors=False, value_format="fp32"))
    weight.grad = torch.randn_like(weight)
    momentum = weight.grad.numpy().copy()  # decay * 0 + g
    exchange.request_energy_curve()
    stats = exchange.step()
    (energy,) = stats.energy
    tiles = [scipy.fft.dctn(momentum[r : r + 32, c : c + 32], norm="ortho").ravel() for r in range(0, 64, 32) for c in range(0, 128, 32)]
    squared = [np.sort(t**2)[::-1] for t in tiles]
    total = float(sum(s.sum() for s in squared))
    assert energy.total == pytest.approx(total, rel=1e-12)
    assert energy.captured == pytest.approx(sum(s[:10].sum() for s in squared), rel=1e-12)
    curve = np.sum([np.cumsum(s) for s in squared], axis=0) / total
    np.testing.assert_allclose(energy.curve.numpy(), curve, rtol=1e-12)
    target = float(curve[99])  # the best 100 per tile reach exactly this fraction
    assert energy.k_for(target) == 100 and energy.k_for(float(curve[100]) + 1e-9) == 102
    assert stats.keep_ratio == pytest.approx(10 / 1024)
    # without a request the next step measures nothing; request_energy() gives totals without the curve
    weight.grad = torch.randn_like(weight)
    assert exchange.step().energy == []
    weight.grad = torch.randn_like(weight)
    exchange.request_energy()
    assert exchange.step().energy[0].curve is None


def test_per_tensor_settings_change_decay_k_and_bytes() -> None:
    a, b = nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.SGD([a, b], lr=0.1)
    exchange = DeMoExchange(opt, unclipped_of(topk=8, dense_below=0, dense_vectors=False, decay=0.9, update="raw"))
    base = exchange.payload_bytes(a)
    exchange.set_tensor_settings(b, TensorSettings(decay=0.0, topk=32))
    assert exchange.payload_bytes(b) > base and exchange.k_of(b) == 32 and exchange.k_of(a) == 8
    for _ in range(2):
        a.grad, b.grad = torch.ones(64, 64), torch.ones(64, 64)
        exchange.request_energy()
        stats = exchange.step()
    assert [e.k for e in stats.energy] == [8, 32]
    a.grad, b.grad = torch.ones(64, 64), torch.ones(64, 64)
    assert exchange.step().energy == []  # measured only on request
    # decay 0 on b: its momentum is this step's gradient less what was sent; a's keeps 0.9 of the last
    sent_b = torch.ones(64, 64) - exchange.momentum(b)
    assert torch.allclose(sent_b, b.grad, atol=1e-5)  # one worker: the shared update is what it sent
    with pytest.raises(ValueError, match="decay"):
        TensorSettings(decay=1.0)


# ---------------------------------------------------------------- monitor model
def test_modeled_seconds_is_hops_times_latency_plus_bytes_over_bandwidth() -> None:
    ledger = ByteLedger(rank=0)
    ledger.begin_step()
    ledger.record("all_gather", "demo/topk", 1000, world_size=4)
    ledger.record("all_reduce", "demo/dense", 400, world_size=4)
    ledger.end_step(ddp_bytes=1e6)
    records = ledger.step_records
    sent = sum(r.sent_bytes for r in records)
    expected = (3 + 6) * 0.001 + sent * 8 / 1e9
    assert modeled_seconds(records, 1.0, 0.001) == pytest.approx(expected)


# ---------------------------------------------------------------- policy and budget in a real fit
def _single_fit(callbacks: list, optimizer: str = "sgd", steps: int = 4, **strategy: Any) -> Any:
    import lightning.pytorch as pl

    from demo_lightning import DeMoStrategy
    from demo_lightning.data import TextDataModule
    from demo_lightning.models import GPTLightningModule

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=DeMoStrategy(**strategy), max_steps=steps, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    model = GPTLightningModule(block_size=32, d_model=64, n_layer=2, n_head=2, optimizer=optimizer, max_steps=steps)
    trainer.fit(model, TextDataModule(block_size=32, batch_size=4, max_bytes=40_000, max_val_bytes=2_000))
    return trainer


def test_layer_policy_first_matching_rule_wins_per_setting(isolated_process_group: None) -> None:
    rules = [
        LayerRule(pattern="*.fc.weight", topk=4),
        LayerRule(kind="ffn", keep_ratio=0.5, beta=0.5),
        LayerRule(kind="norm", dense=True),
        LayerRule(pattern="re:qkv", chunk=16),
        LayerRule(pattern="*", beta=Schedule(kind="linear", start=0.8, end=0.9, steps=4)),
    ]
    policy = LayerPolicy(rules=rules, print_settings=False)
    trainer = _single_fit([policy])
    exchange = trainer.strategy.exchanges[0]
    named = dict(trainer.lightning_module.named_parameters())
    fc, fc_out = named["model.blocks.0.fc.weight"], named["model.blocks.0.fc_out.weight"]
    assert exchange.tensor_settings(fc) == TensorSettings(decay=0.5, topk=4)  # topk from rule 0, beta from rule 1
    assert exchange.tensor_settings(fc_out) == TensorSettings(decay=0.5, keep_ratio=0.5)
    assert exchange.tensor_settings(named["model.ln_f.weight"]).dense is True
    assert exchange.tensor_settings(named["model.blocks.1.qkv.weight"]).chunk == 16
    # the beta ramp: 0.8 at step 0, applied before the 4th (last) step: 0.8 + 0.1 * 3/4
    assert exchange.decay_of(named["model.tok.weight"]) == pytest.approx(0.875)
    assert policy.effective["model.tok.weight"]["beta"] == pytest.approx(0.8)
    assert "model.blocks.0.fc.weight" in policy.format_table()


def test_layer_policy_lambda_needs_decoupled_momentum(isolated_process_group: None) -> None:
    with pytest.raises(ValueError, match="DecoupledMomentum"):
        _single_fit([LayerPolicy(rules=[LayerRule(lam=0.1)])], steps=1)


def test_language_preset_sets_lambda_and_beta_on_decoupled_momentum(isolated_process_group: None) -> None:
    import lightning.pytorch as pl

    from demo_lightning.data import TextDataModule
    from demo_lightning.models import GPTLightningModule
    from demo_lightning.optim import DecoupledMomentum

    class _Model(GPTLightningModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return DecoupledMomentum(self.parameters(), lr=1e-2)

    policy = LayerPolicy(preset="language", print_settings=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="desloc", max_steps=3, callbacks=[policy], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    model = _Model(block_size=32, d_model=64, n_layer=1, n_head=2, max_steps=3)
    trainer.fit(model, TextDataModule(block_size=32, batch_size=4, max_bytes=40_000, max_val_bytes=2_000))
    optimizer = trainer.optimizers[0]
    named = dict(model.named_parameters())
    options = {name: optimizer.param_options[p] for name, p in named.items()}
    assert options["model.tok.weight"]["lam"] == 0.2 and options["model.ln_f.weight"]["lam"] == 0.0
    assert options["model.blocks.0.fc.weight"]["lam"] == 0.05 and options["model.blocks.0.qkv.weight"]["lam"] == 0.1
    # without a DeMo exchange, beta goes to the optimizer: the ramp 0.9 -> 0.99 over 3 steps, before step 3
    assert options["model.tok.weight"]["beta"] == pytest.approx(0.9 + 0.09 * 2 / 3)


def test_bandwidth_budget_caps_the_bytes_the_exchange_plans_and_sends(isolated_process_group: None) -> None:
    free = AdaptiveKeepRatio(keep_ratio=0.05)
    _single_fit([free], steps=2)
    budget = int(free.planned_bytes * 0.7)  # above the floor of one coefficient per tile plus dense tensors
    capped = AdaptiveKeepRatio(keep_ratio=0.05, max_bytes_per_step=budget)
    trainer = _single_fit([capped], steps=2)
    assert free.planned_bytes > budget >= capped.planned_bytes > 0.95 * budget
    exchange = trainer.strategy.exchanges[0]
    assert sum(exchange.payload_bytes(p) for p in exchange.parameters()) == capped.planned_bytes
    assert all(k >= 1 for k in capped.current_k.values())


# ---------------------------------------------------------------- LayerPolicy x AdaptiveKeepRatio
class _Kinds(pl.LightningModule):
    """A tiny module with one tensor per layer kind the rules below address (all compressed: dense_below=0, dense_vectors=False)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.Module()
        self.attn.q_proj = nn.Linear(32, 32, bias=False)  # attention_qk
        self.mlp = nn.Module()
        self.mlp.up = nn.Linear(32, 64, bias=False)  # ffn
        self.head = nn.Linear(32, 32, bias=False)  # linear, a topk rule
        self.extra = nn.Linear(32, 32, bias=False)  # linear, no strength rule

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return sum((m(x) ** 2).mean() for m in (self.attn.q_proj, self.mlp.up, self.head, self.extra))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class _KRecorder(pl.Callback):
    """Records, at every batch start (after the callbacks before it), each tensor's applied k and decay."""

    def __init__(self, adaptive: AdaptiveKeepRatio) -> None:
        self.adaptive = adaptive
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        exchange = trainer.strategy.exchanges[0]
        names = {p: n for n, p in pl_module.named_parameters()}
        self.steps.append({
            "step": trainer.global_step,
            "k": {names[p]: exchange.k_of(p) for p in exchange.parameters()},
            "decay": {names[p]: exchange.decay_of(p) for p in exchange.parameters()},
            "controller_k": dict(self.adaptive.controller_k),
        })


_COMPOSE_RULES = [
    LayerRule(kind="attention_qk", keep_ratio=1 / 8, beta=0.5),  # 4x the strategy's 8/256
    LayerRule(kind="ffn", keep_ratio=Schedule(kind="linear", start=1 / 64, end=1 / 32, steps=4)),  # 1/2 -> 1x
    LayerRule(pattern="head.*", topk=4),  # 4 of 256: 1/2 x
]


def _compose_fit(adaptive_kwargs: dict[str, Any], policy_first: bool, steps: int = 5) -> tuple[list[dict[str, Any]], AdaptiveKeepRatio]:
    from torch.utils.data import DataLoader, TensorDataset

    from demo_lightning import DeMoStrategy

    policy = LayerPolicy(rules=list(_COMPOSE_RULES), print_settings=False)
    adaptive = AdaptiveKeepRatio(**adaptive_kwargs)
    recorder = _KRecorder(adaptive)
    pair = [policy, adaptive] if policy_first else [adaptive, policy]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=DeMoStrategy(chunk=16, topk=8, dense_below=0, dense_vectors=False), max_steps=steps,
        callbacks=[*pair, recorder], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )
    data = DataLoader(TensorDataset(torch.randn(64, 32, generator=torch.Generator().manual_seed(1))), batch_size=8)
    trainer.fit(_Kinds(), data)
    assert "0.125 x adaptive" in policy.format_table()  # the table names the base ratio as scaled
    return recorder.steps, adaptive


_MULTIPLIER_AT = {  # policy ratio / strategy ratio (8 of a 16x16 tile = 1/32), per step for the ffn schedule
    "attn.q_proj.weight": lambda t: (1 / 8) / (1 / 32),
    "mlp.up.weight": lambda t: Schedule(kind="linear", start=1 / 64, end=1 / 32, steps=4)(t) / (1 / 32),
    "head.weight": lambda t: (4 / 256) / (1 / 32),
    "extra.weight": lambda t: 1.0,
}


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)


def test_adaptive_schedule_scales_each_tensors_policy_ratio_in_either_callback_order(isolated_process_group: None) -> None:
    """k_p = clamp(ceil(s(t) / r_strategy * r_p * tile), 1, tile): the schedule's level relative to the
    strategy's ratio multiplies each rule's ratio; a tensor without a strength rule follows s(t)."""
    ramp = Schedule(kind="linear", start=1 / 32, end=1 / 8, steps=4)
    runs = [_compose_fit({"keep_ratio": ramp}, policy_first=order) for order in (True, False)]
    (first, _), (second, _) = runs
    assert [s["k"] for s in first] == [s["k"] for s in second]  # callback order does not matter
    assert [s["decay"] for s in first] == [s["decay"] for s in second]
    for record in first:
        t = record["step"]
        expected = {name: min(256, max(1, _ceil(ramp(t) * m(t) * 256))) for name, m in _MULTIPLIER_AT.items()}
        assert record["k"] == expected, t
        assert record["decay"]["attn.q_proj.weight"] == 0.5  # the policy's other settings still apply
    k0 = first[0]["k"]
    assert k0["attn.q_proj.weight"] > k0["extra.weight"] > k0["mlp.up.weight"] and k0["head.weight"] == k0["mlp.up.weight"]
    assert len({tuple(s["k"].values()) for s in first}) > 2  # both schedules move


def test_adaptive_energy_controller_scales_each_tensors_policy_ratio_in_either_callback_order(isolated_process_group: None) -> None:
    """k_p = clamp(ceil(k_energy * r_p / r_strategy), [min_keep_ratio, max_keep_ratio] of the tile)."""
    kwargs = {"energy": 0.3, "update_every": 1, "max_keep_ratio": 0.5}
    (first, adaptive), (second, _) = [_compose_fit(kwargs, policy_first=order) for order in (True, False)]
    assert [(s["k"], s["controller_k"]) for s in first] == [(s["k"], s["controller_k"]) for s in second]
    low, high = max(1, _ceil(adaptive.min_keep_ratio * 256)), math.floor(0.5 * 256 + 1e-9)
    assert first[0]["controller_k"] == {}  # before the first measurement: the strategy's k (8) as the controller's level
    for record in first:
        t = record["step"]
        for name, m in _MULTIPLIER_AT.items():
            level = record["controller_k"].get(name, 8)
            assert record["k"][name] == min(high, max(low, _ceil(level * m(t)))), (t, name)
    assert first[-1]["controller_k"]  # the controller measured


@pytest.mark.usefixtures("isolated_process_group")
def test_shipped_demo_desloc_config_applies_the_language_preset_under_the_adaptive_ramp(tmp_path: Path) -> None:
    """configs/gpt_demo_desloc.yaml: beside the adaptive ramp the language preset gives each kind its share
    of the ramp's level (its ratio over its overall ratio): attention Q/K 1.5x (0.12 / 0.08), feed-forward
    0.75x (0.06 / 0.08), the rest 1x; norms dense. This is what the exchange applies."""
    from demo_lightning.cli import build_cli

    config = HERE.parent / "configs" / "gpt_demo_desloc.yaml"
    cli = build_cli([
        "--config", str(config), "--trainer.devices=1", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.init_args.max_steps=2", "--model.init_args.block_size=32",
        "--data.init_args.block_size=32", "--data.init_args.batch_size=4", "--data.init_args.max_bytes=60000",
    ], run=False)
    assert cli is not None
    trainer = cli.trainer
    recorder = _KRecorder(next(cb for cb in trainer.callbacks if isinstance(cb, AdaptiveKeepRatio)))
    trainer.callbacks.append(recorder)
    trainer.fit(cli.model, cli.datamodule)
    assert {type(cb).__name__ for cb in trainer.callbacks} >= {"LayerPolicy", "AdaptiveKeepRatio"}
    exchange = trainer.strategy.exchanges[0]
    named = dict(cli.model.named_parameters())
    k = {name: exchange.k_of(p) for name, p in named.items()}
    kinds = layer_kinds(cli.model)
    by_kind: dict[str, set[int]] = {}
    for name, value in k.items():
        if named[name].dim() == 2:  # matrices: tiles of 64 x 64 (biases are small, sent densely)
            by_kind.setdefault(kinds[name], set()).add(value)
    # the last step's ramp level s (cosine 1/128 -> 1/32 over 2 steps, before step 1: halfway), tiles of 4096
    s = (1 / 128 + 1 / 32) / 2
    assert by_kind["attention_qk"] == {_ceil(s * 1.5 * 4096)}  # 1.5x the ramp
    assert by_kind["ffn"] == {_ceil(s * 0.75 * 4096)}  # 0.75x the ramp
    assert by_kind["attention_out"] == {_ceil(s * 4096)}  # the preset's overall ratio: the ramp itself
    assert {k[name] for name in k if kinds[name] == "norm"} == {0}  # the preset's dense norms
    assert min(by_kind["attention_qk"]) > min(by_kind["attention_out"]) > min(by_kind["ffn"])
    first = recorder.steps[0]["k"]  # step 0: the ramp's start
    assert first["model.blocks.0.qkv.weight"] == _ceil((1 / 128) * 1.5 * 4096) and first["model.blocks.0.fc.weight"] == _ceil((1 / 128) * 0.75 * 4096)
    policy = next(cb for cb in trainer.callbacks if isinstance(cb, LayerPolicy))
    assert policy.small_batch_used is True and policy.global_batch == 4  # 4 windows x 1 device: small (the shares stay)


# ---------------------------------------------------------------- contract at 1 and 2 workers
@pytest.fixture(scope="module", params=[1, 2], ids=["1-worker", "2-workers"])
def contract(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, list[dict]]:
    world = request.param
    out = tmp_path_factory.mktemp(f"contract{world}")
    env = clean_env()
    env.update(MASTER_PORT=str(free_port()), CONTRACT_DEVICES=str(world))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(HERE / "callback_run.py"), "--out", str(out)], env=env, capture_output=True, text=True, timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return world, out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_contract_covers_every_callback_class(contract: tuple[int, Path, list[dict]]) -> None:
    _, _, ranks = contract
    names = {c.__name__ for c in callback_classes()}
    assert names >= {"AdaptiveKeepRatio", "CommunicationMonitor", "LayerPolicy"}
    assert set(ranks[0]["classes"]) == names


@pytest.mark.parametrize("name", sorted(c.__name__ for c in callback_classes()))
def test_callback_contract_defaults_refit_and_resume(contract: tuple[int, Path, list[dict]], name: str) -> None:
    world, _, ranks = contract
    for rank in ranks:
        record = rank[name]
        assert len(record["defaults"]) == STEPS // 2  # constructible with defaults, and fits
        full, half, resumed = record["full"], record["first_half"], record["resumed"]
        assert [s["step"] for s in full] == list(range(1, STEPS + 1))
        # fitted a second time, the same instance behaves as a fresh one
        assert half == full[: STEPS // 2]
        # resumed from the half-way checkpoint: the same schedule position, settings and training
        assert [s["step"] for s in resumed] == list(range(STEPS // 2 + 1, STEPS + 1))
        assert resumed == full[STEPS // 2 :]
    if world == 2:  # every rank applies identical settings at every step
        assert [s["settings"] for s in ranks[0][name]["full"]] == [s["settings"] for s in ranks[1][name]["full"]]
        assert [s["params"] for s in ranks[0][name]["full"]] == [s["params"] for s in ranks[1][name]["full"]]


def test_contract_schedules_actually_move(contract: tuple[int, Path, list[dict]]) -> None:
    """Negative control for the resume checks: the recorded state changes within a run."""
    _, _, ranks = contract
    full = ranks[0]
    assert len({s["settings"]["model.tok.weight"] for s in full["LayerPolicy"]["full"]}) > 2  # beta ramps 0.9 -> 0.99
    assert len({json.dumps(s["state"]) for s in full["CommunicationMonitor"]["full"]}) == STEPS  # totals grow
    adaptive = [json.dumps(s["state"]["controller_k"], sort_keys=True) for s in full["AdaptiveKeepRatio"]["full"]]
    assert len(set(adaptive)) > 1  # the controller re-measured
    assert len({s["settings"]["model.blocks.0.fc.weight"] for s in full["AdaptiveKeepRatio"]["defaults"]}) > 1  # ramp
    periods = [json.dumps(s["periods"], sort_keys=True) for s in full["AdaptiveSyncPeriods"]["full"]]
    if contract[0] == 2:  # one worker is its own mean: nothing drifts apart, nothing to adapt
        assert len(set(periods)) > 1, periods  # DES-LOC's periods moved with the measured divergence
        assert any(s["params"] is None for s in full["AdaptiveSyncPeriods"]["full"])  # and replicas differed between syncs


def test_monitor_tensorboard_events_have_the_expected_tags_and_values(contract: tuple[int, Path, list[dict]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    world, out, ranks = contract
    (events,) = list((out / "tb" / "CommunicationMonitor-full").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars, histograms = set(acc.Tags()["scalars"]), set(acc.Tags()["histograms"])

    def last(tag: str) -> float:
        return acc.Scalars(tag)[-1].value

    for tag in ("comm/cumulative_sent_bytes", "comm/cumulative_ratio_vs_ddp", "comm/modeled_seconds_per_step/1Gbps",
                "comm/ddp_modeled_seconds_per_step/1Gbps", "demo/keep_ratio", "demo/energy_captured/ffn",
                "demo/energy_captured/norm", "comm/step_sent_bytes/demo/topk"):
        assert tag in scalars, sorted(scalars)
        assert len(acc.Scalars(tag)) == STEPS
    assert {"demo/dct_abs/ffn", "demo/residual_norm/attention"} <= histograms
    assert 0 < last("demo/energy_captured/ffn") < 1
    assert last("demo/energy_captured/norm") == pytest.approx(1.0)  # small tensors go dense: everything sent
    # the early phase (4 x k 64 = 256 a tile) spans these 8 steps: 28 full 64 x 64 tiles of the 2-D tensors and
    # the position embedding's one 32 x 64 tile (2,048 elements: compressed since dense_below fell to 1,024)
    assert last("demo/keep_ratio") == pytest.approx((28 * 256 + 256) / (28 * 4096 + 2048))
    summary = ranks[0]["CommunicationMonitor"]["summary"]
    if world == 2:
        assert last("comm/step_sent_bytes/demo/topk") > 0
        assert last("comm/cumulative_ratio_vs_ddp") == pytest.approx(summary["ratio_vs_ddp"], rel=1e-6) and last("comm/cumulative_ratio_vs_ddp") > 5
        assert 0 < last("comm/modeled_seconds_per_step/1Gbps") < last("comm/ddp_modeled_seconds_per_step/1Gbps")
    else:
        assert last("comm/cumulative_sent_bytes") == 0  # one worker sends nothing


def test_the_default_keep_ratio_schedule_sends_more_later_in_training(isolated_process_group: None) -> None:
    """DeMo-adv's "sync more later" (seed 000 §4): AdaptiveKeepRatio() with no arguments raises each
    tensor's k over the run, from 1/128 of a tile at the first step to 1/32 at the last (a cosine ramp),
    never down; the exchange's bytes follow."""
    from torch.utils.data import DataLoader, TensorDataset

    from demo_lightning import DeMoStrategy

    class _Bytes(pl.Callback):
        def __init__(self) -> None:
            self.sent: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.sent.append(trainer.strategy.last_traffic.payload_bytes)  # one process: the payload (nothing is sent)

    adaptive = AdaptiveKeepRatio()
    recorder, sent = _KRecorder(adaptive), _Bytes()
    steps = 12
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=DeMoStrategy(chunk=32, dense_below=0, dense_vectors=False), max_steps=steps,
        callbacks=[adaptive, recorder, sent], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )
    data = DataLoader(TensorDataset(torch.randn(96, 32, generator=torch.Generator().manual_seed(2))), batch_size=8)
    trainer.fit(_Kinds(), data)
    tile = 32 * 32
    ks = [record["k"]["extra.weight"] for record in recorder.steps]
    assert ks[0] == _ceil(tile / 128) and ks[-1] >= _ceil(0.95 * tile / 32)
    assert all(a <= b for a, b in zip(ks, ks[1:])) and ks[-1] > ks[0]
    assert all(a <= b for a, b in zip(sent.sent, sent.sent[1:])) and sent.sent[-1] > sent.sent[0]
