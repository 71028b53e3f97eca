"""DES-LOC averaging: DDP equivalence, replica hashes, schedule and byte accounting, faults, config errors."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from demo_lightning.algorithms.desloc import (
    DesLocAverager,
    DesLocConfig,
    default_state_periods,
    half_life,
    periods_from_betas,
)
from demo_lightning.codec import segment_nbytes
from demo_lightning.comm import Communicator

from dist_helpers import run_workers, tensor_hash

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------- single process
def test_half_life_rule_and_default_periods() -> None:
    assert half_life(0.5) == pytest.approx(1.0)
    assert half_life(0.9) == pytest.approx(6.579, abs=1e-3)
    assert half_life(0.999) == pytest.approx(692.8, abs=0.1)
    assert default_state_periods(16) == {"exp_avg": 48, "momentum_buffer": 48, "exp_avg_sq": 96, "max_exp_avg_sq": 96}
    adam = torch.optim.Adam([nn.Parameter(torch.zeros(1))], betas=(0.9, 0.99))
    assert periods_from_betas(4, adam) == {"exp_avg": 7, "exp_avg_sq": 69}
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    assert periods_from_betas(16, sgd) == {"momentum_buffer": 16}


def test_schedule_names_exactly_the_due_quantities() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={"exp_avg": 3, "exp_avg_sq": 6}))
    seen = {}
    for step in range(1, 13):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        seen[step] = avg.after_step()
    assert seen[1] == [] and seen[2] == ["params"] and seen[3] == ["state/exp_avg"]
    assert seen[6] == ["params", "state/exp_avg", "state/exp_avg_sq"] and seen[12] == seen[6]
    totals = avg.comm.ledger.totals
    assert totals["desloc/params"].calls == 6 and totals["desloc/state/exp_avg"].calls == 4
    assert totals["desloc/state/exp_avg_sq"].calls == 2 and "desloc/state/step" not in totals


def test_defaults_follow_the_keys_the_optimizer_keeps() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=4))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    avg.after_step()
    assert avg.state_periods == {"exp_avg": 12, "exp_avg_sq": 24}


class _CountingOptimizer(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = torch.tensor([len(self.state[p])], dtype=torch.int64)
        return out


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"param_sync_every": 0}, "param_sync_every"),
        ({"param_sync_every": -4}, "param_sync_every"),
        ({"param_sync_every": 1.5}, "param_sync_every"),
        ({"state_sync_every": {"exp_avg": 0}}, "exp_avg"),
        ({"state_sync_every": {"step": 4}}, "step"),
        ({"state_sync_every": [4]}, "state_sync_every"),
        ({"clip_grad_norm": 0.0}, "clip_grad_norm"),
        ({"param_sync_every": None, "compress_params": True}, "compress_params"),
    ],
)
def test_bad_config_is_rejected_naming_it(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        DesLocConfig(**kwargs)


def test_state_key_the_optimizer_does_not_keep_is_rejected_at_first_sync() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={"momentum_buffer": 4}))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="momentum_buffer.*keeps only"):
        avg.after_step()


def test_compressed_sync_state_of_another_model_is_rejected_and_changes_nothing() -> None:
    def averager(model: nn.Module) -> DesLocAverager:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={}, compress_params=True))

    torch.manual_seed(0)
    saved = averager(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))).state_dict()
    assert [tuple(a.shape) for a in saved["anchor"]] == [(8, 4), (8,), (2, 8), (2,)]
    for other in (nn.Sequential(nn.Linear(4, 8)), nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))):
        target = averager(other)
        before = [a.clone() for a in target.state_dict()["anchor"]]
        with pytest.raises(ValueError, match="saved DES-LOC anchor holds 4 tensors.*different model"):
            target.load_state_dict({**saved, "step_count": 7})
        assert target.step_count == 0 and all(torch.equal(a, b) for a, b in zip(target.state_dict()["anchor"], before))
    same = averager(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    same.load_state_dict({**saved, "step_count": 7})
    assert same.step_count == 7 and all(torch.equal(a, b) for a, b in zip(same.state_dict()["anchor"], saved["anchor"]))


def test_non_floating_state_is_rejected() -> None:
    model = nn.Linear(4, 4)
    opt = _CountingOptimizer(model.parameters(), lr=0.1)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={"count": 2}))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="count.*not a floating-point"):
        avg.after_step()


def test_clipping_before_the_local_step() -> None:
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=1, clip_grad_norm=1.0)).attach()
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([-0.6, -0.8, 0.0]))
    assert avg.step_count == 1


# ---------------------------------------------------------------- real processes
def _ddp_vs_desloc(rank: int, world: int, steps: int) -> dict[str, Any]:
    """SGD-momentum in float64: DDP (grads all-reduced by hand) against DES-LOC with every period 1."""
    results = {}
    for mode in ("ddp", "desloc"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        avg = DesLocAverager(opt, DesLocConfig(param_sync_every=1, state_sync_every={"momentum_buffer": 1}), Communicator())
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            if mode == "ddp":
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
                opt.step()
            else:
                opt.step()
                avg.after_step()
        results[mode] = [p.detach().clone() for p in model.parameters()]
    return results


def test_all_periods_one_with_sgd_momentum_equals_ddp(tmp_path: Path) -> None:
    for result in run_workers(_ddp_vs_desloc, 2, tmp_path, 6):
        for a, b in zip(result["ddp"], result["desloc"]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _replicas(rank: int, world: int, steps: int, periods: dict[str, int], k_x: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = Communicator()
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=k_x, state_sync_every=periods), comm, model.buffers())
    per_step = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
        if rank == 1 and step == 7:
            opt.state.clear()  # a worker restarted with lost optimizer state
        comm.ledger.begin_step()
        synced = avg.after_step()
        traffic = comm.ledger.end_step(0.0)
        per_step.append({
            "synced": synced,
            "sent": traffic.sent_bytes,
            "params": [tensor_hash(p) for p in model.parameters()] + [tensor_hash(b) for b in model.buffers() if b.is_floating_point()],
            "exp_avg": [tensor_hash(opt.state[p]["exp_avg"]) for p in model.parameters() if "exp_avg" in opt.state[p]],
            "exp_avg_sq": [tensor_hash(opt.state[p]["exp_avg_sq"]) for p in model.parameters() if "exp_avg_sq" in opt.state[p]],
        })
    n = sum(p.numel() for p in model.parameters())
    totals = {tag: t.sent_bytes for tag, t in comm.ledger.totals.items()}
    return {"steps": per_step, "n": n, "totals": totals, "finite": all(torch.isfinite(p).all() for p in model.parameters())}


def test_replicas_equal_after_each_sync_differ_between_and_recover_from_lost_state(tmp_path: Path) -> None:
    k_x, periods, steps = 2, {"exp_avg": 6, "exp_avg_sq": 12}, 24
    r0, r1 = run_workers(_replicas, 2, tmp_path, steps, periods, k_x)
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"]), start=1):
        expected = (["params"] if t % k_x == 0 else []) + [f"state/{k}" for k, p in periods.items() if t % p == 0]
        assert a["synced"] == b["synced"] == expected
        if t % k_x == 0:
            assert a["params"] == b["params"], t
        else:
            assert a["params"] != b["params"], t  # negative control: local steps diverge between syncs
        for key, period in periods.items():
            if t % period == 0 and t > 8:  # rank 1 lost its state after step 8
                assert a[key] == b[key], (key, t)
        if t == 9:
            assert a["exp_avg"] != b["exp_avg"]  # the reset really happened
    assert r0["finite"] and r1["finite"]
    # bytes: ring all-reduce of n fp32 values, 2 (W-1)/W n 4 per quantity, plus 2 BatchNorm buffers with params
    n, buffers = r0["n"], 2 * 32
    per_param = 2 * (2 - 1) / 2 * 4
    total = sum(s["sent"] for s in r0["steps"])
    # the only other traffic: one-off agreements on which keys and which tensors to average (a count and a
    # 64-bit digest each: 2 int64); they count in the ledger's totals but in no optimizer step's traffic
    checks = (2 - 1) * 2 * 2 * 8
    assert total + checks == sum(r0["totals"].values())
    assert r0["totals"].pop("desloc/keys") == (2 - 1) * 2 * 8
    assert r0["totals"].pop("desloc/layout") == (2 - 1) * 2 * 8
    assert set(r0["totals"]) == {"desloc/params", "desloc/buffers", "desloc/state/exp_avg", "desloc/state/exp_avg_sq"}
    expected_total = per_param * (steps / k_x * (n + buffers) + steps / 6 * n + steps / 12 * n)
    assert total == pytest.approx(expected_total)
    # the formula n (1/K_x + 1/K_u + 1/K_v) bytes per step (buffers aside)
    assert (total - per_param * steps / k_x * buffers) / steps == pytest.approx(per_param * n * (1 / k_x + 1 / 6 + 1 / 12))


def _rosenbrock(rank: int, world: int, config: dict, steps: int) -> float:
    torch.manual_seed(0)
    xy = nn.Parameter(torch.tensor([-1.5, 2.0]))
    opt = torch.optim.Adam([xy], lr=5e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=1e-4)  # anneal below the noise floor
    avg = DesLocAverager(opt, DesLocConfig(**config), Communicator())
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        x, y = xy
        ((1 - x) ** 2 + 100 * (y - x**2) ** 2).backward()
        xy.grad += 2.0 * torch.randn(2, generator=gen)  # each worker's own gradient noise
        opt.step()
        avg.after_step()
        schedule.step()
    avg.sync_now(["params"])
    return float(torch.dist(xy.detach(), torch.tensor([1.0, 1.0])))


@pytest.mark.parametrize(
    "config",
    [
        {"param_sync_every": 8, "state_sync_every": {"exp_avg": 24, "exp_avg_sq": 48}},  # DES-LOC
        pytest.param({"param_sync_every": 8, "state_sync_every": {"exp_avg": 8, "exp_avg_sq": 8}}, marks=pytest.mark.slow),  # Local Adam
    ],
)
def test_rosenbrock_with_noisy_workers_converges(tmp_path: Path, config: dict) -> None:
    distances = run_workers(_rosenbrock, 3, tmp_path, config, 4000)
    assert max(distances) < 0.1, distances
    assert len(set(distances)) == 1  # the final sync leaves every worker on the same point


def _lost_peer(rank: int, world: int, delay: float) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=1, state_sync_every={}), Communicator())
    before = [p.detach().clone() for p in model.parameters()]
    if rank == 1:
        time.sleep(delay)  # a peer that stops answering for longer than the timeout
    start = time.monotonic()
    try:
        avg.after_step()
        raised = None
    except Exception as exc:  # noqa: BLE001 - the point of the test
        raised = f"{type(exc).__name__}: {exc}"
    return {
        "raised": raised,
        "seconds": time.monotonic() - start,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
        "step_count": avg.step_count,
    }


def test_sync_with_a_lost_peer_raises_within_the_timeout_and_keeps_local_state(tmp_path: Path) -> None:
    r0, r1 = run_workers(_lost_peer, 2, tmp_path, 8.0, collective_timeout=3.0, timeout=120)
    assert r0["raised"] is not None and r0["seconds"] < 3.0 + 4.0, r0
    assert r1["raised"] is not None, r1  # its partner is gone by the time it arrives
    for r in (r0, r1):
        assert r["unchanged"] and r["step_count"] == 0


def _compressed(rank: int, world: int, codec: dict, steps: int) -> dict[str, Any]:
    from demo_lightning.algorithms import CodecConfig

    out = {}
    for mode in ("exact", "compressed"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        comm = Communicator()
        config = DesLocConfig(param_sync_every=2, state_sync_every={}, compress_params=mode == "compressed", codec=CodecConfig(**codec))
        avg = DesLocAverager(opt, config, comm)
        hashes = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * step + rank)
            opt.zero_grad()
            model(torch.randn(8, 64, generator=gen)).pow(2).mean().backward()
            opt.step()
            avg.after_step()
            hashes.append([tensor_hash(p) for p in model.parameters()])
        tag = "desloc/params" if mode == "exact" else "desloc/params_compressed"
        sent = sum(t.sent_bytes for name, t in comm.ledger.totals.items() if name.startswith(tag))
        out[mode] = {"params": [p.detach().clone() for p in model.parameters()], "hashes": hashes, "sent": sent}
    return out


def test_compressed_parameter_sync_keeps_replicas_identical_and_saves_bytes(tmp_path: Path) -> None:
    r0, r1 = run_workers(_compressed, 2, tmp_path, {"topk": 64, "dense_below": 200}, 8)
    for t in range(2, 9, 2):
        assert r0["compressed"]["hashes"][t - 1] == r1["compressed"]["hashes"][t - 1]
    assert r0["compressed"]["sent"] < r0["exact"]["sent"] / 10
    # lossy: close to, but not equal to, exact averaging
    drift = max(float((a - b).abs().max()) for a, b in zip(r0["compressed"]["params"], r0["exact"]["params"]))
    assert 0 < drift < 0.05


def test_compressed_parameter_sync_keeping_everything_is_exact_averaging(tmp_path: Path) -> None:
    r0, _ = run_workers(_compressed, 2, tmp_path, {"keep_ratio": 1.0, "value_format": "fp32", "dense_below": 200}, 4)
    for a, b in zip(r0["compressed"]["params"], r0["exact"]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compressed_parameter_sync_at_one_bit_per_coefficient(tmp_path: Path) -> None:
    # lowpass keeping every coefficient, sign values: no positions, 1 bit per coefficient + one fp32
    # scale per 64x64 tile; the biases (< dense_below) go as fp32 all-reduces
    codec = {"selection": "lowpass", "keep_ratio": 1.0, "value_format": "sign", "dense_below": 200}
    r0, r1 = run_workers(_compressed, 2, tmp_path, codec, 8)
    for t in range(2, 9, 2):
        assert r0["compressed"]["hashes"][t - 1] == r1["compressed"]["hashes"][t - 1]
    tiles = 2 * (128 * 64 // 4096)
    per_sync = segment_nbytes(tiles, 4096, 4096, "sign", False) + 2 * (2 - 1) / 2 * 4 * (128 + 64)
    assert segment_nbytes(tiles, 4096, 4096, "sign", False) == tiles * (4 + 4096 // 8)
    assert r0["compressed"]["sent"] == pytest.approx(4 * per_sync)
    drift = max(float((a - b).abs().max()) for a, b in zip(r0["compressed"]["params"], r0["exact"]["params"]))
    assert 0 < drift < 0.05
