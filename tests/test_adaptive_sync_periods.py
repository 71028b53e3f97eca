"""DES-LOC periods that adapt (issue 16 item 7): the averager's run-time periods against a countdown
oracle, the controller's rule against a hand-written sequence, two gloo workers on different data
agreeing on every period, and the averager's and controller's checkpoints.

The Lightning layer (2-process fit, fit twice, resume to the same schedule) runs in the callback
contract (tests/callback_run.py, tests/test_callbacks.py); bad input in tests/test_bad_input.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from demo_lightning.algorithms.adaptive_periods import (
    ADAPTIVE_TAG,
    AdaptivePeriodController,
    AdaptivePeriodsConfig,
    next_period,
)
from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig
from demo_lightning.comm import Communicator

from dist_helpers import run_workers, tensor_hash

pytestmark = pytest.mark.timeout(120)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(8, 8, generator=gen)).pow(2).mean().backward()
    opt.step()


def _countdown_oracle(periods: dict[str, int], changes: dict[int, dict[str, int]], steps: int) -> dict[int, list[str]]:
    """Quantities averaged after each step, by countdown: each quantity's next sync step, moved on by
    its period when it fires; a change after step ``s`` sets the next sync to ``s + new period``."""
    next_sync = dict(periods)
    out: dict[int, list[str]] = {}
    for t in range(1, steps + 1):
        out[t] = [q for q in periods if next_sync[q] == t]
        for q in out[t]:
            next_sync[q] += periods[q]
        for q, period in changes.get(t, {}).items():
            if period != periods[q]:
                periods[q], next_sync[q] = period, t + period
    return out


def test_changed_periods_sync_exactly_where_a_countdown_oracle_says_and_survive_a_checkpoint() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={"exp_avg": 4, "exp_avg_sq": 8}))
    assert avg.state_dict().keys() == {"step_count", "syncs"}  # unchanged periods: the old layout
    changes = {3: {"params": 5}, 10: {"state/exp_avg": 3, "params": 2}, 11: {"params": 2}, 14: {"state/exp_avg_sq": 1}}
    oracle = _countdown_oracle({"params": 2, "state/exp_avg": 4, "state/exp_avg_sq": 8}, changes, 24)
    seen: dict[int, list[str]] = {}
    saved: dict[str, Any] = {}
    for t in range(1, 25):
        _train_step(model, opt, t)
        seen[t] = avg.after_step()
        for name, period in changes.get(t, {}).items():
            avg.set_period(name, period)
        if t == 12:
            saved = avg.state_dict()
    assert seen == oracle
    assert seen[5] == [] and seen[8] == ["params", "state/exp_avg", "state/exp_avg_sq"]  # 3 + 5 = 8: re-anchored
    assert avg.periods == {"params": 2, "state/exp_avg": 3, "state/exp_avg_sq": 1}
    assert avg.state_periods == {"exp_avg": 3, "exp_avg_sq": 1}
    assert saved["periods"] == {"params": 2, "state/exp_avg": 3} and saved["period_anchors"] == {"params": 10, "state/exp_avg": 10}
    # a fresh averager from the step-12 state continues the same schedule
    fresh = DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={"exp_avg": 4, "exp_avg_sq": 8}))
    fresh.load_state_dict(saved)
    resumed = {}
    for t in range(13, 25):
        resumed[t] = fresh.due()
        fresh.step_count += 1
        for name, period in changes.get(t, {}).items():
            fresh.set_period(name, period)
    assert resumed == {t: oracle[t] for t in range(13, 25)}
    # a checkpoint without periods (an earlier version) loads as the configured schedule
    old = DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={"exp_avg": 4, "exp_avg_sq": 8}))
    old.set_period("params", 7)
    old.load_state_dict({"step_count": 12, "syncs": {}})
    assert old.periods == {"params": 2, "state/exp_avg": 4, "state/exp_avg_sq": 8} and old.due() == []
    assert old.due(16) == ["params", "state/exp_avg", "state/exp_avg_sq"]


def test_divergence_is_measured_only_when_asked_and_matches_its_formula() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=1, state_sync_every={"exp_avg": 1}))
    _train_step(model, opt, 0)
    avg.after_step()
    assert avg.last_divergence == {}  # off by default
    avg.measure_divergence = True
    _train_step(model, opt, 1)
    assert avg.after_step() == ["params", "state/exp_avg"]
    assert avg.last_divergence == {"params": 0.0, "state/exp_avg": 0.0}  # one worker is its own mean
    # the formula, on made-up replica and mean
    v, m = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])], [torch.tensor([0.0, 4.0]), torch.tensor([1.0])]
    got = DesLocAverager._divergence({"x": (v, m), "zero": ([torch.zeros(2)], [torch.zeros(2)]), "inf": ([torch.ones(1)], [torch.zeros(1)])})
    assert got["x"] == pytest.approx(3.0 / math.sqrt(17.0)) and got["zero"] == 0.0 and got["inf"] == math.inf


def test_next_period_rule_rounds_clamps_and_keeps_on_non_finite() -> None:
    config = AdaptivePeriodsConfig(factor=1.5, low=0.5, high=2.0)
    assert next_period(3, 0.1, 1.0, config, 1, 100) == 4  # floor(4.5)
    assert next_period(2, 0.1, 1.0, AdaptivePeriodsConfig(factor=1.1), 1, 100) == 3  # at least K + 1
    assert next_period(9, 5.0, 1.0, config, 1, 100) == 6  # ceil(6.0)
    assert next_period(2, 5.0, 1.0, AdaptivePeriodsConfig(factor=1.1), 1, 100) == 1  # at most K - 1
    assert next_period(4, 1.0, 1.0, config, 1, 100) == 4  # inside the band
    assert next_period(64, 0.1, 1.0, config, 1, 80) == 80 and next_period(2, 9.0, 1.0, config, 2, 80) == 2  # bounds
    assert next_period(5, math.nan, 1.0, config, 1, 100) == 5 and next_period(5, math.inf, 1.0, config, 1, 100) == 5


def test_controller_follows_a_hand_written_sequence_within_bounds() -> None:
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=4, state_sync_every={"exp_avg": 12, "exp_avg_sq": 24}))
    config = AdaptivePeriodsConfig(min_period=2, max_period={"params": 16, "state/exp_avg": 48, "state/exp_avg_sq": 96},
                                   target={"state/exp_avg_sq": 0.01})
    ctl = AdaptivePeriodController(avg, config)
    # (divergences agreed at a sync) -> periods after it, worked out by hand from the rule
    sequence: list[tuple[dict[str, float], dict[str, int]]] = [
        ({"params": 1.0, "state/exp_avg": 0.2}, {"params": 4, "state/exp_avg": 12, "state/exp_avg_sq": 24}),  # calibrate both
        ({"params": 0.4}, {"params": 8, "state/exp_avg": 12, "state/exp_avg_sq": 24}),  # 0.4 < 0.5: x2
        ({"params": 0.3, "state/exp_avg": 0.05}, {"params": 16, "state/exp_avg": 24, "state/exp_avg_sq": 24}),
        ({"params": 0.1}, {"params": 16, "state/exp_avg": 24, "state/exp_avg_sq": 24}),  # max_period 16
        ({"state/exp_avg_sq": 0.001}, {"params": 16, "state/exp_avg": 24, "state/exp_avg_sq": 48}),  # given target 0.01
        ({"params": 3.0, "state/exp_avg": 0.5}, {"params": 8, "state/exp_avg": 12, "state/exp_avg_sq": 48}),  # > 2 tau: / 2
        ({"params": 1.5, "state/exp_avg": 0.3}, {"params": 8, "state/exp_avg": 12, "state/exp_avg_sq": 48}),  # in the band
        ({"params": 5.0, "state/exp_avg": 9.0}, {"params": 4, "state/exp_avg": 6, "state/exp_avg_sq": 48}),
        ({"params": 5.0, "state/exp_avg": 9.0}, {"params": 2, "state/exp_avg": 3, "state/exp_avg_sq": 48}),
        ({"params": 5.0, "state/exp_avg": 9.0}, {"params": 2, "state/exp_avg": 2, "state/exp_avg_sq": 48}),  # min 2 (= K_x)
        ({"params": 0.1, "state/exp_avg": 0.2}, {"params": 4, "state/exp_avg": 4, "state/exp_avg_sq": 48}),  # band: exp_avg keeps 2, lifted to K_x
    ]
    for step, (divergence, periods) in enumerate(sequence, start=1):
        avg.step_count = step
        ctl.update(step, divergence)
        assert avg.periods == periods, (step, divergence)
    assert ctl.targets == {"params": 1.0, "state/exp_avg": 0.2, "state/exp_avg_sq": 0.01}
    with pytest.warns(RuntimeWarning, match="not finite"):
        ctl.update(len(sequence) + 1, {"params": math.nan})
    assert avg.periods == sequence[-1][1]
    # the controller's state round-trips; its periods live in the averager's
    other = AdaptivePeriodController(avg, config)
    other.load_state_dict(ctl.state_dict())
    assert other.state_dict() == ctl.state_dict() and other.adaptations == len(sequence) + 1


def test_controller_calibrates_only_after_start_step_and_only_its_quantities() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={"exp_avg": 4, "exp_avg_sq": 8}))
    ctl = AdaptivePeriodController(avg, AdaptivePeriodsConfig(quantities=["state/exp_avg"], start_step=4)).attach()
    assert avg.measure_divergence
    for t in range(1, 9):
        _train_step(model, opt, t)
        avg.after_step()
    assert [h["step"] for h in ctl.history] == [8]  # step 4 is not after 4
    assert set(ctl.last_divergence) == {"state/exp_avg"}  # only its quantity was agreed on
    assert ctl.targets == {}  # one process: the divergence is 0, which calibrates nothing
    ctl.remove()
    assert not avg.measure_divergence


def test_a_zero_first_divergence_calibrates_nothing_and_the_next_drift_does() -> None:
    """Identical replicas (DeMo keeps them so) measure 0: no target yet, so the period is not frozen."""
    model = nn.Linear(4, 4)
    avg = DesLocAverager(torch.optim.SGD(model.parameters(), lr=0.1), DesLocConfig(param_sync_every=4, state_sync_every={}))
    ctl = AdaptivePeriodController(avg, AdaptivePeriodsConfig())
    ctl.update(4, {"params": 0.0})
    assert ctl.targets == {} and avg.periods == {"params": 4}
    ctl.update(8, {"params": 0.02})  # the first drift sets the target
    assert ctl.targets == {"params": 0.02} and avg.periods == {"params": 4}
    ctl.update(12, {"params": 0.005})  # below 0.5 x target: twice as long
    assert avg.periods == {"params": 8}


# ---------------------------------------------------------------- two gloo workers, different data
def _two_workers(rank: int, world: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    comm = Communicator()
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={"exp_avg": 4, "exp_avg_sq": 8}), comm)
    # a tight band: the periods move within a few syncs
    ctl = AdaptivePeriodController(avg, AdaptivePeriodsConfig(factor=2.0, low=0.9, high=1.1, max_period=16)).attach()
    rows = []
    for t in range(1, steps + 1):
        _train_step(model, opt, 1000 * rank + t)  # each rank its own data
        comm.ledger.begin_step()
        synced = avg.after_step()
        traffic = comm.ledger.end_step(0.0)
        rows.append({
            "synced": synced, "periods": dict(avg.periods), "local": dict(avg.last_divergence),
            "agreed": {q: ctl.last_divergence.get(q) for q in synced}, "adaptive_bytes": sum(
                r.sent_bytes for r in comm.ledger.step_records if r.tag == ADAPTIVE_TAG),
            "params": tensor_hash(torch.cat([p.detach().reshape(-1) for p in model.parameters()])), "sent": traffic.sent_bytes,
        })
    totals = comm.ledger.totals.get(ADAPTIVE_TAG)
    return {"rows": rows, "calls": totals.calls if totals else 0, "payload": totals.payload_bytes if totals else 0,
            "targets": dict(ctl.targets), "history": ctl.history}


def test_two_workers_on_different_data_agree_on_every_period(tmp_path: Path) -> None:
    r0, r1 = run_workers(_two_workers, 2, tmp_path, 40)
    rows0, rows1 = r0["rows"], r1["rows"]
    assert [r["periods"] for r in rows0] == [r["periods"] for r in rows1]  # identical schedule everywhere
    assert [r["synced"] for r in rows0] == [r["synced"] for r in rows1]
    assert [r["agreed"] for r in rows0] == [r["agreed"] for r in rows1]  # the same all-reduced numbers, bitwise
    assert r0["targets"] == r1["targets"] and r0["history"] == r1["history"]
    assert len({r["periods"]["params"] for r in rows0}) > 1  # the periods actually moved
    for row0, row1 in zip(rows0, rows1):
        for q in row0["synced"]:  # agreed = mean of the two ranks' own measurements
            assert row0["agreed"][q] == pytest.approx((row0["local"][q] + row1["local"][q]) / 2, rel=1e-12)
            assert row0["local"][q] > 0
        if "params" in row0["synced"]:
            assert row0["params"] == row1["params"]  # replicas equal right after a parameter sync
    assert any(a["params"] != b["params"] for a, b in zip(rows0, rows1) if "params" not in a["synced"])  # negative control
    # the ledger: one float64 all-reduce per sync, one value per quantity averaged there (2 workers: sent = payload)
    syncs = [r for r in rows0 if r["synced"]]
    assert r0["calls"] == len(syncs) and r0["payload"] == 8 * sum(len(r["synced"]) for r in syncs)
    assert all(r["adaptive_bytes"] == 8 * len(r["synced"]) for r in rows0)
