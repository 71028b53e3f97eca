"""Trainer(strategy="demo"): registration, arguments, precision, and real 2-process Lightning fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from demo_lightning import DeMoStrategy

from dist_helpers import clean_env, free_port

HERE = Path(__file__).parent


class _Classifier(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 64, generator=g), torch.randint(0, 4, (64,), generator=g)), batch_size=16)


def _trainer(**kwargs: Any) -> pl.Trainer:
    base = dict(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(**{**base, **kwargs})


def test_registered_name_builds_the_strategy() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert "demo" in StrategyRegistry
    trainer = _trainer(strategy="demo")
    assert isinstance(trainer.strategy, DeMoStrategy)
    assert trainer.strategy.demo_config.codec.strength == (64, None)
    assert (trainer.strategy.demo_config.codec.value_format, trainer.strategy.demo_config.decay) == ("sign", 0.99)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"topk": 0}, "topk"),
        ({"keep_ratio": 1.2}, "keep_ratio"),
        ({"keep_ratio": 0.0}, "keep_ratio"),
        ({"topk": 8, "keep_ratio": 0.1}, "not both"),
        ({"decay": 1.0}, "decay"),
        ({"decay": -0.5}, "decay"),
        ({"value_format": "fp4"}, "value_format"),
        ({"selection": "random"}, "selection"),
        ({"update": "nesterov"}, "update"),
        ({"timeout": 0}, "timeout"),
        ({"hierarchy": "rack"}, "hierarchy"),
        ({"selection": "shared"}, r"selection='shared'.*value_format"),  # the default 1-bit values cannot be summed
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        DeMoStrategy(**kwargs)


@pytest.mark.usefixtures("isolated_process_group")
def test_single_device_fit_logs_comm_metrics_and_keeps_momentum_in_the_exchange() -> None:
    model = _Classifier("adamw")
    trainer = _trainer(strategy=DeMoStrategy(update="raw", dense_below=100))
    trainer.fit(model, _loader())
    for name in ("comm/bytes_sent_per_step", "comm/bytes_received_per_step", "comm/ratio_vs_ddp"):
        assert name in trainer.callback_metrics
    opt = trainer.optimizers[0]
    exchange = trainer.strategy.exchanges[0]
    assert all("exp_avg" in opt.state[p] and "demo_momentum" not in opt.state[p] for p in model.parameters())
    assert all(exchange.has_momentum(p) for p in model.parameters())
    assert trainer.strategy.last_stats.steps == 4


@pytest.mark.usefixtures("isolated_process_group")
def test_node_hierarchy_on_one_process_warns_and_runs_flat() -> None:
    trainer = _trainer(strategy=DeMoStrategy(hierarchy="node", update="raw", dense_below=100))
    with pytest.warns(UserWarning, match="hierarchy='node' needs several nodes of several processes.*running flat"):
        trainer.fit(_Classifier("adamw"), _loader())
    assert trainer.strategy.node_groups is None and trainer.strategy.last_stats.steps == 4
    assert "comm/inter_node_bytes_per_step" in trainer.callback_metrics


@pytest.mark.usefixtures("isolated_process_group")
def test_sign_update_with_a_momentum_optimizer_warns() -> None:
    with pytest.warns(UserWarning, match="update='raw'"):
        _trainer(strategy="demo").fit(_Classifier("adamw"), _loader())


@pytest.mark.usefixtures("isolated_process_group")
def test_fp16_with_grad_scaler_is_refused_with_a_clear_error() -> None:
    # Lightning turns precision="16-mixed" into bf16 on CPU, so pass the fp16 plugin with its scaler directly
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = _trainer(strategy="demo", plugins=[plugin])
    with pytest.raises(ValueError, match="bf16-mixed"):
        trainer.fit(_Classifier(), _loader())


def _fit(out: Path, *extra: str, timeout: float = 240) -> list[dict[str, Any]]:
    env = clean_env()
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(HERE / "lightning_run.py"), "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_two_process_fit_replicas_identical_every_step_momenta_differ(tmp_path: Path) -> None:
    ranks = _fit(tmp_path, "--accumulate", "2", "--rank-seeded-init", "--max-bytes", "20000")
    # each rank built different weights; rank 0's were broadcast before training
    assert not torch.equal(ranks[0]["initial_params"]["model.tok.weight"], ranks[1]["initial_params"]["model.tok.weight"])
    assert ranks[0]["param_hashes"] == ranks[1]["param_hashes"]
    assert len(ranks[0]["param_hashes"]) > 4
    assert ranks[0]["momentum_hashes"][-1] != ranks[1]["momentum_hashes"][-1]  # negative control
    for r in ranks:
        assert r["exchanges"] == r["global_step"]  # one exchange per optimizer step, not per micro-batch
        last = r["comm"][-1]
        assert last["comm/bytes_sent_per_step"] > 0
        assert last["comm/ratio_vs_ddp"] > 1
    # the gloo group is destroyed at exit, not left to interpreter finalisation (which can SIGABRT)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.exit").read_text()) == {"process_group_alive": False}


def test_two_process_bf16_mixed_fit_with_position_groups_keeps_replicas_identical(tmp_path: Path) -> None:
    """bf16-mixed, int8 values and position groups of 2: the strategy names the tensors from the module, so
    each group is one projection of the two blocks, and the ledger's bytes are the plan's (followers send values)."""
    ranks = _fit(tmp_path, "--precision", "bf16-mixed", "--max-bytes", "20000", "--strategy-json", json.dumps({"value_format": "int8", "position_group_size": 2}))
    assert ranks[0]["param_hashes"] == ranks[1]["param_hashes"]
    groups = ranks[0]["position_groups"]
    assert groups["shared"] and all(a.replace(".1.", ".0.") == b for a, b in groups["shared"]), groups["shared"]
    assert len(groups["shared"]) == 4  # qkv, proj, fc, fc_out of block 1 use block 0's positions
    dense = sum(t.numel() for t in ranks[0]["params"].values() if t.numel() < 100)  # dense_below=100: the norms
    # W = 2: the ring all-gather sends the payload once, the ring all-reduce of the bf16 dense tensors 2 bytes each, the guard 9
    assert ranks[0]["comm"][-1]["comm/bytes_sent_per_step"] == pytest.approx(groups["payload"] + 2 * dense + 9)


@pytest.mark.slow  # superseded in CI by tests/test_resume.py (demo, desloc, combination; exception and kill)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_resume_continues_bitwise_identically_on_every_rank(tmp_path: Path, optimizer: str) -> None:
    extra = ["--optimizer", optimizer, "--max-bytes", "30000", "--strategy-json", json.dumps({"update": "sign" if optimizer == "sgd" else "raw"})]
    ckpt = tmp_path / "half.ckpt"
    full = _fit(tmp_path / "full", "--max-epochs", "2", *extra)
    half = _fit(tmp_path / "half", "--max-epochs", "1", "--ckpt-out", str(ckpt), *extra)
    resumed = _fit(tmp_path / "resumed", "--max-epochs", "2", "--ckpt-in", str(ckpt), *extra)
    for rank in range(2):
        f, h, r = full[rank], half[rank], resumed[rank]
        assert r["global_step"] == f["global_step"] == 2 * h["global_step"]
        for name, tensor in f["params"].items():
            assert torch.equal(tensor, r["params"][name]), name
        assert f["momenta"].keys() == r["momenta"].keys()
        for index, tensor in f["momenta"].items():
            assert torch.equal(tensor, r["momenta"][index]), index
        assert f["losses"][h["global_step"]:] == r["losses"]  # the loss curve continues exactly
        # negative control: the state did change between the checkpoint and the end
        assert any(not torch.equal(h["params"][n], t) for n, t in f["params"].items())
        assert any(not torch.equal(h["momenta"][i], t) for i, t in f["momenta"].items())
    assert not torch.equal(full[0]["momenta"][0], full[1]["momenta"][0])  # each rank got its own back


def test_desloc_strategy_is_registered_and_validates() -> None:
    from demo_lightning import DesLocStrategy

    assert isinstance(_trainer(strategy="desloc").strategy, DesLocStrategy)
    with pytest.raises(ValueError, match="param_sync_every"):
        DesLocStrategy(param_sync_every=0)
    with pytest.raises(ValueError, match="step"):
        DesLocStrategy(state_sync_every={"step": 4})


K_X, K_U, K_V = 5, 10, 20
DESLOC = [
    "--strategy", "desloc", "--optimizer", "adamw", "--max-bytes", "30000",
    "--strategy-json", json.dumps({"param_sync_every": K_X, "state_sync_every": {"exp_avg": K_U, "exp_avg_sq": K_V}}),
]


@pytest.mark.slow  # superseded in CI by tests/test_resume.py's desloc variant
def test_desloc_fit_syncs_on_schedule_and_resumes_between_syncs_bitwise(tmp_path: Path) -> None:
    ckpt = tmp_path / "half.ckpt"
    full = _fit(tmp_path / "full", "--max-epochs", "2", *DESLOC)
    half = _fit(tmp_path / "half", "--max-epochs", "1", "--ckpt-out", str(ckpt), *DESLOC)
    resumed = _fit(tmp_path / "resumed", "--max-epochs", "2", "--ckpt-in", str(ckpt), *DESLOC)
    steps = half[0]["global_step"]
    assert steps % K_X != 0, "the checkpoint must fall between two parameter syncs"
    # between syncs the replicas differ, at syncs they agree
    for t, (a, b) in enumerate(zip(full[0]["param_hashes"], full[1]["param_hashes"]), start=1):
        assert (a == b) == (t % K_X == 0), t
    for t, (a, b) in enumerate(zip(full[0]["state_hashes"], full[1]["state_hashes"]), start=1):
        if t % K_U == 0:
            assert a["exp_avg"] == b["exp_avg"], t
        if t % K_V == 0:
            assert a["exp_avg_sq"] == b["exp_avg_sq"], t
    # the fit ended between syncs: the final sync left both ranks on the average (each rank's own
    # replica went into the checkpoint, which is why the resumed run below continues bitwise)
    for name, tensor in half[0]["params"].items():
        assert torch.equal(tensor, half[1]["params"][name]), name
    total = full[0]["global_step"]
    final = {"final": 1} if total % K_X else {}
    assert full[0]["syncs"] == [{"params": total // K_X, "state/exp_avg": total // K_U, "state/exp_avg_sq": total // K_V, **final}]
    for rank in range(2):
        f, r = full[rank], resumed[rank]
        for name, tensor in f["params"].items():
            assert torch.equal(tensor, r["params"][name]), (rank, name)
        assert f["opt_state"].keys() == r["opt_state"].keys()
        for key, tensor in f["opt_state"].items():
            assert torch.equal(tensor, r["opt_state"][key]), (rank, key)
        assert f["losses"][steps:] == r["losses"]
        assert f["syncs"] == r["syncs"]


def test_demo_with_desloc_schedule_averages_the_residual_momenta_on_their_period(tmp_path: Path) -> None:
    options = {"param_sync_every": 8, "state_sync_every": {"demo_momentum": 4}}
    ranks = _fit(tmp_path, "--max-bytes", "20000", "--strategy-json", json.dumps(options))
    a, b = ranks[0]["momentum_hashes"], ranks[1]["momentum_hashes"]
    for t, (ha, hb) in enumerate(zip(a, b), start=1):
        assert (ha == hb) == (t % 4 == 0), t
    assert ranks[0]["param_hashes"] == ranks[1]["param_hashes"]
    total = ranks[0]["global_step"]
    assert ranks[0]["syncs"] == [{"params": total // 8, "state/demo_momentum": total // 4}]


def test_strategies_are_configurable_from_lightning_cli_yaml(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    from demo_lightning import DesLocStrategy
    from demo_lightning.data import TextDataModule
    from demo_lightning.models import GPTLightningModule

    config = tmp_path / "desloc.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 1\n"
        "  strategy:\n"
        "    class_path: demo_lightning.DesLocStrategy\n"
        "    init_args: {param_sync_every: 16, state_sync_every: {exp_avg: 48, exp_avg_sq: 96}}\n"
    )
    cli = LightningCLI(GPTLightningModule, TextDataModule, run=False, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DesLocStrategy)
    assert strategy.desloc_config.param_sync_every == 16
    assert strategy.desloc_config.state_periods == {"exp_avg": 48, "exp_avg_sq": 96}
    demo = LightningCLI(
        GPTLightningModule, TextDataModule, run=False,
        args=["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "demo"],
    )
    assert isinstance(demo.trainer.strategy, DeMoStrategy)


def test_desloc_with_every_period_one_matches_lightning_ddp_in_float64(tmp_path: Path) -> None:
    common = ["--optimizer", "sgd", "--momentum", "0.9", "--precision", "64-true", "--max-bytes", "12000"]
    ddp = _fit(tmp_path / "ddp", "--strategy", "ddp", *common)
    desloc = _fit(
        tmp_path / "desloc", "--strategy", "desloc", *common,
        "--strategy-json", json.dumps({"param_sync_every": 1, "state_sync_every": {"momentum_buffer": 1}}),
    )
    assert ddp[0]["global_step"] == desloc[0]["global_step"] > 10
    for name, tensor in ddp[0]["params"].items():
        assert tensor.dtype == torch.float64
        torch.testing.assert_close(desloc[0]["params"][name], tensor, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(desloc[1]["params"][name], tensor, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------- gradient clipping (issue 13)
class _ClipProbe(pl.Callback):
    """Records each step's raw gradients (after backward), what the exchange's momentum receives
    (``p.grad`` when ``DeMoExchange.step`` starts) and the parameters after every step."""

    def __init__(self) -> None:
        self.raw: list[list[torch.Tensor]] = []
        self.entering: list[list[torch.Tensor]] = []
        self.params: list[list[torch.Tensor]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params.append([p.detach().clone() for p in pl_module.parameters()])
        for exchange in getattr(trainer.strategy, "exchanges", []):
            original = exchange.step

            def step(*args: Any, _original: Any = original, _ex: Any = exchange, **kwargs: Any) -> Any:
                self.entering.append([p.grad.detach().clone() for p in _ex.parameters()])
                return _original(*args, **kwargs)

            exchange.step = step

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.raw.append([p.grad.detach().clone() for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.params.append([p.detach().clone() for p in pl_module.parameters()])


@pytest.mark.usefixtures("isolated_process_group")
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_under_demo_clips_the_local_gradient_not_the_shared_update(algorithm: str) -> None:
    lr, clip = 1e-2, 0.05
    probe = _ClipProbe()
    strategy = DeMoStrategy(topk=8, dense_below=100, update="sign")
    trainer = _trainer(strategy=strategy, gradient_clip_val=clip, gradient_clip_algorithm=algorithm, callbacks=[probe])
    trainer.fit(_Classifier("sgd"), _loader())
    assert len(probe.entering) == len(probe.raw) == 4
    for raw, entering in zip(probe.raw, probe.entering):
        expected = [g.clone() for g in raw]
        if algorithm == "norm":
            assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in raw])) > clip  # clipping bites
            torch.nn.utils.clip_grad_norm_(_as_params(expected), clip)
        else:
            torch.nn.utils.clip_grad_value_(_as_params(expected), clip)
        for want, got in zip(expected, entering):  # the momentum receives the clipped local gradient
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    # the shared update is sign(Q), unclipped: every coordinate moves by exactly lr (or not at all)
    moved = 0
    for before, after in zip(probe.params, probe.params[1:]):
        for a, b in zip(before, after):
            step = (b - a).abs()
            assert torch.all((step == 0) | torch.isclose(step, torch.full_like(step, lr), rtol=1e-3, atol=0)), step.max()
            moved += int((step > 0).sum())
    assert moved > 0


def _as_params(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        params.append(p)
    return params


# ---------------------------------------------------------------- 0-D parameters, final sync (issue 13)
class _Gated(_Classifier):
    """A learnable scalar registered on the LightningModule itself: the first of ``parameters()``."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__(optimizer)
        self.gate = torch.nn.Parameter(torch.tensor(1.0))
        self.bias_1d = torch.nn.Parameter(torch.zeros(4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.gate * self.net(x) + self.bias_1d, y)


@pytest.mark.usefixtures("isolated_process_group")
@pytest.mark.parametrize("which", ["desloc", "demo+desloc"])
def test_a_learnable_scalar_first_in_the_module_trains_under_desloc_and_the_combination(which: str) -> None:
    from demo_lightning import DesLocStrategy

    model = _Gated("adamw")
    assert next(model.parameters()) is model.gate and model.gate.dim() == 0
    if which == "desloc":
        strategy: Any = DesLocStrategy(param_sync_every=2)
    else:
        strategy = DeMoStrategy(update="raw", dense_below=100, param_sync_every=2, state_sync_every={"exp_avg": 2, "exp_avg_sq": 4})
    trainer = _trainer(strategy=strategy, max_steps=4)
    trainer.fit(model, _loader())
    averager = trainer.strategy.averagers[0]
    assert averager.stats.syncs["params"] == 2 and set(averager.state_periods) == {"exp_avg", "exp_avg_sq"}
    assert float(model.gate) != 1.0  # the scalar trained


def test_desloc_fit_ends_with_every_rank_on_the_averaged_model(tmp_path: Path) -> None:
    ranks = _fit(tmp_path, *DESLOC)
    assert ranks[0]["global_step"] % K_X != 0, "the fit must end between syncs"
    assert ranks[0]["param_hashes"][-1] != ranks[1]["param_hashes"][-1]  # the last step left the replicas apart
    for name, tensor in ranks[0]["params"].items():
        assert torch.equal(tensor, ranks[1]["params"][name]), name
    assert ranks[0]["syncs"][0]["final"] == 1
