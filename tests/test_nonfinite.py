"""Non-finite guard: a NaN/inf on any rank leads every rank to the same decision (skip or raise).

Levels: the flags of one rank (no processes); the agreement on 2 real gloo ranks; the strategies in
one process (counting, warning, checkpoint); real 2-process Lightning fits with a NaN on one rank
(nothing of ours changes in the skipped step, replicas stay in sync, training finishes) and with
``nonfinite="raise"`` (both processes fail with the fix in the message, no hang).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from demo_lightning import DeMoStrategy, DesLocStrategy
from demo_lightning.algorithms import NonFiniteFlags, agree_nonfinite, gather_nonfinite
from demo_lightning.algorithms.guard import GRAD, GUARD_TAG, INF, LOSS, NAN, local_nonfinite_flags
from demo_lightning.comm import Communicator

from dist_helpers import clean_env, free_port, run_workers, tensor_hash

HERE = Path(__file__).parent
NAN_F = float("nan")


# ---------------------------------------------------------------------------- one rank, no processes
def _params(*grads: Optional[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = g
        params.append(p)
    return params


@pytest.mark.parametrize(
    ("grads", "loss", "expected"),
    [
        ((torch.ones(4), None), torch.tensor(0.5), 0),
        ((None, None), None, 0),  # no gradient, training_step returned None: finite
        ((torch.ones(4),), 0.5, 0),
        ((torch.ones(4),), {"loss": NAN_F}, 0),  # not a loss we understand: counts as finite
        ((torch.tensor([1.0, NAN_F, 0.0, 0.0]), None), torch.tensor(0.5), GRAD | NAN),
        ((torch.ones(4), torch.tensor([0.0, 0.0, -math.inf, 0.0])), torch.tensor(0.5), GRAD | INF),
        ((torch.ones(4),), torch.tensor(NAN_F), LOSS | NAN),
        ((torch.ones(4),), math.inf, LOSS | INF),
        ((torch.tensor([NAN_F, math.inf, 0.0, 0.0]),), torch.tensor(math.inf), LOSS | GRAD | NAN | INF),
        ((), torch.tensor(NAN_F, dtype=torch.bfloat16), LOSS | NAN),
    ],
)
def test_local_flags(grads: tuple, loss: Any, expected: int) -> None:
    assert local_nonfinite_flags(_params(*grads), loss) == expected


def test_single_process_agreement_is_the_local_flag_and_is_in_the_ledger() -> None:
    comm = Communicator()  # no process group: the identity, still recorded
    assert not agree_nonfinite(_params(torch.ones(4)), torch.tensor(1.0), comm)
    flags = gather_nonfinite(_params(torch.ones(4)), torch.tensor(NAN_F), comm)
    assert flags and flags.per_rank == (LOSS | NAN,) and flags.ranks == [0]
    assert comm.ledger.totals[GUARD_TAG].calls == 2 and comm.ledger.totals[GUARD_TAG].payload_bytes == 2


def test_error_message_names_step_ranks_values_and_fix() -> None:
    flags = NonFiniteFlags((0, GRAD | INF, LOSS | GRAD | NAN))
    assert flags.ranks == [1, 2]
    message = str(flags.error(step=7))
    for part in ("optimizer step 7", "2 of 3 rank(s)", "rank 1: gradients (inf)", "rank 2: loss and gradients (NaN)",
                 "learning rate", "gradient_clip_val", "bf16-mixed", "nonfinite='skip'"):
        assert part in message, part
    assert not NonFiniteFlags((0, 0)) and NonFiniteFlags((0, 0)).describe() == ""


@pytest.mark.parametrize("cls", [DeMoStrategy, DesLocStrategy])
@pytest.mark.parametrize("value", ["ignore", "SKIP", None, True])
def test_bad_nonfinite_raises_value_error_naming_it(cls: type, value: Any) -> None:
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('skip', 'raise'\)"):
        cls(nonfinite=value)


def test_nonfinite_default_is_skip() -> None:
    assert DeMoStrategy().nonfinite == "skip" and DesLocStrategy().nonfinite == "skip"
    assert DesLocStrategy(nonfinite="raise").nonfinite == "raise"


# ---------------------------------------------------------------------------- 2 gloo ranks, no Lightning
def _agreement_worker(rank: int, world_size: int) -> dict[str, Any]:
    comm = Communicator()
    params = _params(torch.ones(4), None)
    out: dict[str, Any] = {"clean": agree_nonfinite(params, torch.tensor(1.0), comm)}
    if rank == 1:
        params[0].grad[2] = NAN_F  # only rank 1 sees it
    out["local_after_poison"] = local_nonfinite_flags(params, torch.tensor(1.0))
    out["poisoned"] = agree_nonfinite(params, torch.tensor(1.0), comm)
    params[0].grad = torch.ones(4)
    out["loss_flags"] = gather_nonfinite(params, math.inf if rank == 0 else 0.5, comm).per_rank
    out["none_loss"] = agree_nonfinite(params, None, comm)
    totals = comm.ledger.totals[GUARD_TAG]
    out["ledger"] = (totals.calls, totals.payload_bytes, totals.sent_bytes)
    out["other_tags"] = sorted(t for t in comm.ledger.totals if t != GUARD_TAG)
    return out


def test_two_ranks_agree_when_only_one_sees_a_nan(tmp_path: Path) -> None:
    results = run_workers(_agreement_worker, 2, tmp_path, timeout=120, collective_timeout=30)
    assert [r["local_after_poison"] for r in results] == [0, GRAD | NAN]  # rank 0 alone would not know
    for r in results:
        assert r["clean"] is False
        assert r["poisoned"] is True  # both ranks decide the same
        assert r["loss_flags"] == (LOSS | INF, 0)
        assert r["none_loss"] is False
        assert r["ledger"] == (4, 4, 4.0)  # 4 agreements, 1 byte each, ring all-gather (W-1) * 1 byte
        assert r["other_tags"] == []  # nothing else was communicated


# ---------------------------------------------------------------------------- strategies in one process
class _Net(pl.LightningModule):
    """A classifier whose loss is NaN at the steps in ``nan_at`` and ``None`` at the steps in ``none_at``."""

    def __init__(self, nan_at: tuple[int, ...] = (), none_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.nan_at, self.none_at = nan_at, none_at

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.trainer.global_step in self.none_at:
            return None
        return loss * NAN_F if self.trainer.global_step in self.nan_at else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class _Hashes(pl.Callback):
    def __init__(self) -> None:
        self.params: list[list[str]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.params.append([tensor_hash(p) for p in pl_module.parameters()])


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)), batch_size=8)


def _trainer(strategy: Any, max_steps: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )


def _strategy(name: str, **kwargs: Any) -> Any:
    return DeMoStrategy(dense_below=0, dense_vectors=False, **kwargs) if name == "demo" else DesLocStrategy(param_sync_every=2, **kwargs)


@pytest.mark.usefixtures("isolated_process_group")
@pytest.mark.parametrize("name", ["demo", "desloc"])
def test_single_process_skips_count_warn_once_and_survive_a_checkpoint(tmp_path: Path, name: str) -> None:
    hashes = _Hashes()
    trainer = _trainer(_strategy(name), 8, callbacks=[hashes])  # one epoch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Net(nan_at=(2, 3), none_at=(1,)), _loader())
    skip_warnings = [w for w in caught if "Skipped this optimizer step" in str(w.message)]
    assert len(skip_warnings) == 1 and "optimizer step 2" in str(skip_warnings[0].message)  # first skip only
    strategy = trainer.strategy
    assert strategy.skipped_steps == 2  # steps 2 and 3; the None loss of step 1 is not a skip
    assert trainer.global_step == 8  # Lightning counts skipped steps
    assert trainer.callback_metrics["guard/skipped_steps"] == 2
    h = hashes.params
    assert h[2] == h[1] and h[3] == h[1] and h[4] != h[3]  # skipped steps change nothing; the next one does
    if name == "desloc":
        assert strategy.averagers[0].step_count == 6  # our schedule counts only the 6 steps taken
    else:
        assert strategy.last_stats.steps == 6
    ckpt = tmp_path / "guard.ckpt"
    trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=True)["optimizer_states"][0]["demo_lightning"]["skipped_steps"] == 2
    resumed = _trainer(_strategy(name), 10)
    assert resumed.strategy.skipped_steps == 0
    resumed.fit(_Net(nan_at=(2, 3)), _loader(), ckpt_path=str(ckpt))
    assert resumed.strategy.skipped_steps == 2 and resumed.global_step == 10


@pytest.mark.usefixtures("isolated_process_group")
def test_single_process_raise_names_the_step_and_the_fix() -> None:
    trainer = _trainer(_strategy("demo", nonfinite="raise"), 4)
    model = _Net(nan_at=(1,))
    with pytest.raises(FloatingPointError, match=r"optimizer step 1 .*rank 0: loss and gradients \(NaN\).*nonfinite='skip'"):
        trainer.fit(model, _loader())
    assert trainer.strategy.skipped_steps == 0


# ---------------------------------------------------------------------------- real 2-process Lightning fits
def _run(out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = clean_env()
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(HERE / "lightning_run.py"), "--out", str(out), "--max-bytes", "12000", *extra]
    # capture_output waits for every rank: rank 1 inherits the pipes, so a hung rank trips the timeout
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _fit(out: Path, *extra: str) -> list[dict[str, Any]]:
    proc = _run(out, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _check_skipped_step(ranks: list[dict[str, Any]], s: int, nan_rank: int, loss_poisoned: bool) -> int:
    """Everything of ours on every rank is bitwise unchanged by step ``s``; the next step changes it."""
    n = ranks[0]["global_step"]
    assert n > s + 3, "the run must continue well past the skipped step"
    for rank, r in enumerate(ranks):
        assert r["skipped"] == [t == s for t in range(n)], rank
        assert r["skipped_steps"] == 1
        assert [c["guard/skipped_steps"] for c in r["comm"]] == [0.0] * s + [1.0] * (n - s)
        # only the guard moved in the skipped step: its flag byte and the exchange's 8-byte plan digest
        assert r["comm"][s]["comm/bytes_sent_per_step"] == 9.0
        # Lightning still counts the skipped step, and its step-interval LR scheduler steps
        assert r["global_steps"] == list(range(1, n + 1))
        assert r["lrs"][s] != r["lrs"][s - 1]
        for key in ("param_hashes", "momentum_hashes", "state_hashes"):
            h = r[key]
            assert h[s] == h[s - 1], (rank, key)
            if h[s] and any(h[s].values() if isinstance(h[s], dict) else h[s]):
                assert h[s + 1] != h[s], (rank, key)  # negative control: a taken step changes it
        assert math.isnan(r["losses"][s]) == (loss_poisoned and rank == nan_rank)
        assert all(math.isfinite(x) for t, x in enumerate(r["losses"]) if t != s)  # training continues
    return n


def test_demo_skip_leaves_every_rank_unchanged_and_replicas_in_sync(tmp_path: Path) -> None:
    s = 3
    ranks = _fit(
        tmp_path, "--optimizer", "adamw", "--strategy-json", json.dumps({"update": "raw"}),
        "--nan-at", str(s), "--nan-rank", "1", "--nan-kind", "loss",
    )
    n = _check_skipped_step(ranks, s, nan_rank=1, loss_poisoned=True)
    assert ranks[0]["param_hashes"] == ranks[1]["param_hashes"]  # replicas identical at every step
    assert ranks[0]["state_hashes"] == ranks[1]["state_hashes"]
    for r in ranks:
        assert r["exchanges"] == n - 1  # the exchange ran at every step but the skipped one


K_X = 4


@pytest.mark.slow  # in CI, tests/test_resume.py skips a NaN step under desloc and checks the lagging counter
def test_desloc_skip_keeps_the_schedule_counter_and_syncs_on_it(tmp_path: Path) -> None:
    s = K_X - 1  # would have been the first parameter sync
    options = {"param_sync_every": K_X, "state_sync_every": {"exp_avg": K_X, "exp_avg_sq": 2 * K_X}}
    ranks = _fit(
        tmp_path, "--strategy", "desloc", "--optimizer", "adamw", "--strategy-json", json.dumps(options),
        "--nan-at", str(s), "--nan-rank", "1", "--nan-kind", "grad",
    )
    n = _check_skipped_step(ranks, s, nan_rank=1, loss_poisoned=False)
    counts = [c[0] for c in ranks[0]["desloc_steps"]]
    assert counts == [t + 1 if t < s else t for t in range(n)]
    assert ranks[1]["desloc_steps"] == ranks[0]["desloc_steps"]
    a, b = ranks[0], ranks[1]
    for t, k in enumerate(counts):
        # replicas agree exactly after the syncs of the (shifted) schedule, and differ between them
        assert (a["param_hashes"][t] == b["param_hashes"][t]) == (k % K_X == 0), t
        if k % K_X == 0:
            assert a["state_hashes"][t]["exp_avg"] == b["state_hashes"][t]["exp_avg"], t
    assert a["param_hashes"][s] != b["param_hashes"][s]  # the skipped step did not sync
    assert a["syncs"] == [{"params": (n - 1) // K_X, "state/exp_avg": (n - 1) // K_X, "state/exp_avg_sq": (n - 1) // (2 * K_X)}]


@pytest.mark.slow  # in CI, tests/test_resume.py's combination variant skips a NaN step and resumes bitwise
def test_demo_with_desloc_schedule_skip_keeps_residuals_and_counter(tmp_path: Path) -> None:
    s = 3
    options = {"param_sync_every": 4, "state_sync_every": {"demo_momentum": 2}}
    ranks = _fit(tmp_path, "--strategy-json", json.dumps(options), "--nan-at", str(s), "--nan-rank", "0", "--nan-kind", "loss")
    n = _check_skipped_step(ranks, s, nan_rank=0, loss_poisoned=True)
    assert ranks[0]["param_hashes"] == ranks[1]["param_hashes"]
    counts = [c[0] for c in ranks[0]["desloc_steps"]]
    assert counts == [t + 1 if t < s else t for t in range(n)]
    for t, k in enumerate(counts):
        assert (ranks[0]["momentum_hashes"][t] == ranks[1]["momentum_hashes"][t]) == (k % 2 == 0), t


def test_raise_stops_both_processes_with_the_fix_and_no_hang(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = _run(tmp_path, "--nonfinite", "raise", "--nan-at", "2", "--nan-rank", "1", "--nan-kind", "grad", timeout=180)
    assert proc.returncode != 0
    assert time.monotonic() - start < 180
    for rank in range(2):  # every rank raised the same error (not one rank failing and the other timing out)
        message = (tmp_path / f"rank{rank}.error").read_text()
        assert message.startswith("FloatingPointError: Non-finite values (NaN/inf) at optimizer step 2"), message
        for part in ("rank 1: gradients (inf)", "lower the learning rate", "gradient_clip_val", "bf16-mixed", "nonfinite='skip'"):
            assert part in message, (rank, part)
        assert not (tmp_path / f"rank{rank}.pt").exists()
    assert "FloatingPointError" in proc.stderr


def test_settings_changed_on_one_rank_stop_both_processes_with_the_same_error(tmp_path: Path) -> None:
    # the plan digest travels in the guard's all-gather: both ranks learn of the mismatch before any data moves
    start = time.monotonic()
    proc = _run(tmp_path, "--diverge-settings-at", "2", timeout=180)
    assert proc.returncode != 0 and time.monotonic() - start < 180
    for rank in range(2):
        message = (tmp_path / f"rank{rank}.error").read_text()
        assert message.startswith("RuntimeError: the list of tensors to exchange"), (rank, message)
        assert "differs between rank 0 and rank(s) [1]" in message and "same TensorSettings on every rank" in message, message
    assert "SIGABRT" not in proc.stderr and "Timed out" not in proc.stderr


def test_the_guard_checks_a_param_group_added_after_setup() -> None:
    """The runtime's participants read the optimizer's groups at every step (BackboneFinetuning adds
    a group mid-fit): a NaN in the new group's gradient skips the step instead of entering the mean."""
    from datetime import timedelta

    from demo_lightning.algorithms import CodecConfig, DeMoConfig
    from demo_lightning.strategies.runtime import CommunicationRuntime

    a, b = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.SGD([a], lr=0.1)
    runtime = CommunicationRuntime(DeMoConfig(CodecConfig(dense_below=0, dense_vectors=False), update="raw"), None, "skip", "flat", timedelta(seconds=60))
    runtime.attach(opt, [], "test")
    opt.add_param_group({"params": [b]})
    a.grad, b.grad = torch.randn(64, 64), torch.randn(64, 64)
    b.grad[3, 4] = float("nan")
    before = b.detach().clone()
    with pytest.warns(UserWarning, match="Skipped this optimizer step"):
        runtime.step(opt, opt.step, loss=torch.tensor(1.0))
    assert runtime.last_step_skipped and runtime.skipped_steps == 1 and torch.equal(b, before)
    assert not torch.isnan(runtime.exchanges[0].momentum(b)).any()
