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
    # the only other traffic: agreements that count in the ledger's totals but in no optimizer step's traffic:
    # once, which keys to average (a count and a 64-bit digest, then one byte per key plus one); at every sync
    # (every rank, whatever changed locally), which tensors to average (a count and a digest: 2 int64)
    sync_steps = sum(1 for t in range(1, steps + 1) if t % k_x == 0 or any(t % p == 0 for p in periods.values()))
    assert r0["totals"].pop("desloc/keys") == (2 - 1) * (2 * 8 + len(periods) + 1)
    assert r0["totals"].pop("desloc/layout") == (2 - 1) * 2 * 8 * sync_steps
    assert total == sum(r0["totals"].values())
    assert set(r0["totals"]) == {"desloc/params", "desloc/buffers", "desloc/state/exp_avg", "desloc/state/exp_avg_sq"}
    # each state sync carries one holder count per tensor (fp32) in its all-reduce
    n_tensors = len(r0["steps"][0]["params"]) - 2
    expected_total = per_param * (steps / k_x * (n + buffers) + (steps / 6 + steps / 12) * (n + n_tensors))
    assert total == pytest.approx(expected_total)
    total -= per_param * (steps / 6 + steps / 12) * n_tensors
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
    r0, _ = run_workers(_compressed, 2, tmp_path, {"keep_ratio": 1.0, "value_format": "fp32", "dense_below": 200, "dense_format": "fp32"}, 4)
    for a, b in zip(r0["compressed"]["params"], r0["exact"]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compressed_parameter_sync_at_one_bit_per_coefficient(tmp_path: Path) -> None:
    # lowpass keeping every coefficient, sign values: no positions, 1 bit per coefficient + one fp32
    # scale per 64x64 tile; the biases (< dense_below) go as bf16 all-reduces (dense_format's default)
    codec = {"selection": "lowpass", "keep_ratio": 1.0, "value_format": "sign", "dense_below": 200}
    r0, r1 = run_workers(_compressed, 2, tmp_path, codec, 8)
    for t in range(2, 9, 2):
        assert r0["compressed"]["hashes"][t - 1] == r1["compressed"]["hashes"][t - 1]
    tiles = 2 * (128 * 64 // 4096)
    per_sync = segment_nbytes(tiles, 4096, 4096, "sign", False) + 2 * (2 - 1) / 2 * 2 * (128 + 64)
    assert segment_nbytes(tiles, 4096, 4096, "sign", False) == tiles * (4 + 4096 // 8)
    assert r0["compressed"]["sent"] == pytest.approx(4 * per_sync)
    drift = max(float((a - b).abs().max()) for a, b in zip(r0["compressed"]["params"], r0["exact"]["params"]))
    assert 0 < drift < 0.05


# ---------------------------------------------------------------- issue 13 regressions
class _Scalars(nn.Module):
    """0-D, 1-D and N-D parameters; ``order`` puts them in any registration order."""

    def __init__(self, order: str) -> None:
        super().__init__()
        made = {"0": lambda: nn.Parameter(torch.tensor(1.0)), "1": lambda: nn.Parameter(torch.zeros(6)), "2": lambda: nn.Parameter(torch.zeros(6, 4))}
        for i, kind in enumerate(order):
            self.register_parameter(f"p{i}_{kind}d", made[kind]())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.sum()
        for p in self.parameters():
            out = out + (p * x.mean()).pow(2).sum() + p.sum()
        return out


@pytest.mark.parametrize("order", ["012", "210", "102"])
@pytest.mark.parametrize("compress", [False, True])
def test_zero_dim_parameters_in_any_order_are_averaged_with_their_states(order: str, compress: bool) -> None:
    torch.manual_seed(0)
    model = _Scalars(order)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=1, state_sync_every={"exp_avg": 1, "exp_avg_sq": 1}, compress_params=compress))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4)).backward()
        opt.step()
        assert avg.after_step() == ["params", "state/exp_avg", "state/exp_avg_sq"]
    assert avg.state_periods == {"exp_avg": 1, "exp_avg_sq": 1}
    # default periods resolve to the same keys whatever parameter comes first
    fresh = DesLocAverager(opt, DesLocConfig(param_sync_every=1))
    fresh.after_step()
    assert fresh.state_periods == {"exp_avg": 3, "exp_avg_sq": 6}


def test_a_state_not_shaped_like_its_parameter_is_rejected_whichever_parameter_holds_it() -> None:
    class _Odd(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            out = super().step(closure)
            params = [p for g in self.param_groups for p in g["params"]]
            for p in params:
                self.state[p]["extra"] = torch.zeros_like(p)
            self.state[params[-1]]["extra"] = torch.zeros(3)  # only the last one is malformed
            return out

    model = _Scalars("012")
    opt = _Odd(model.parameters(), lr=0.1)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=1, state_sync_every={"extra": 1}))
    model(torch.randn(4)).backward()
    opt.step()
    with pytest.raises(ValueError, match="extra.*shape"):
        avg.after_step()


def _partial_state(rank: int, world: int) -> dict[str, Any]:
    """A branch used on rank 0 only: its AdamW state exists on 1 of 3 ranks."""
    torch.manual_seed(0)
    shared, branch = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.AdamW([*shared.parameters(), *branch.parameters()], lr=1e-2)
    sgd_branch = nn.Parameter(torch.zeros(4))
    sgd = torch.optim.SGD([sgd_branch, nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=1, state_sync_every={"exp_avg": 1, "exp_avg_sq": 1}), Communicator())
    sgd_avg = DesLocAverager(sgd, DesLocConfig(param_sync_every=1, state_sync_every={"momentum_buffer": 1}), Communicator())
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 4, generator=gen)
    out = shared(x)
    if rank == 0:
        out = branch(out)
        sgd_branch.grad = torch.full((4,), 2.0)
    out.pow(2).mean().backward()
    opt.step()
    local_sq = [opt.state[p]["exp_avg_sq"].clone() for p in branch.parameters()] if rank == 0 else []
    avg.after_step()
    sgd.step()
    sgd_avg.after_step()
    return {
        "local_sq": local_sq,
        "branch_sq": [opt.state[p].get("exp_avg_sq") for p in branch.parameters()],
        "branch_state_keys": [sorted(opt.state[p]) for p in branch.parameters()],
        "shared_sq": [opt.state[p]["exp_avg_sq"].clone() for p in shared.parameters()],
        "momentum": sgd.state[sgd_branch].get("momentum_buffer"),
        "params": [tensor_hash(p) for p in [*shared.parameters(), *branch.parameters()]],
    }


def test_a_state_held_by_some_ranks_is_averaged_over_those_ranks(tmp_path: Path) -> None:
    r0, r1, r2 = run_workers(_partial_state, 3, tmp_path)
    # rank 0 alone holds the branch's second moment: the mean over the holders is its own value (not a third of it)
    for mine in r0["branch_sq"]:
        assert mine is not None
    for mean, local in zip(r0["branch_sq"], r0["local_sq"]):
        torch.testing.assert_close(mean, local, rtol=1e-6, atol=0)
    # AdamW keeps a step counter with its moments: ranks that never stepped the branch keep no state for it
    # (moments without their step counter would break AdamW); their state starts at their first gradient
    assert r1["branch_state_keys"] == r2["branch_state_keys"] == [[], []]
    # SGD's momentum buffer is its whole state: ranks without one adopt the holders' mean
    for r in (r0, r1, r2):
        torch.testing.assert_close(r["momentum"], torch.full((4,), 2.0))
        assert r["params"] == r0["params"]
        for a, b in zip(r["shared_sq"], r0["shared_sq"]):
            assert torch.equal(a, b)


def _changing_set(rank: int, world: int, compress: bool) -> dict[str, Any]:
    """The trainable set changes mid-run: a param group is added, a layer is frozen and unfrozen."""
    from demo_lightning.algorithms import CodecConfig

    torch.manual_seed(0)
    a, b, c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
    c.requires_grad_(False)
    opt = torch.optim.SGD([*a.parameters(), *c.parameters()], lr=0.05)
    codec = CodecConfig(topk=64, dense_below=100, value_format="fp32")
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={}, compress_params=compress, codec=codec), Communicator())
    hashes = []
    for step in range(12):
        if step == 3:
            opt.add_param_group({"params": list(b.parameters())})  # a new group between two syncs
        if step == 5:
            a.weight.requires_grad_(False)  # frozen between two syncs: one last average
        if step == 7:
            c.requires_grad_(True)  # a frozen layer joins (identical everywhere until now)
        gen = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        c(b(a(torch.randn(8, 64, generator=gen)))).pow(2).mean().backward()
        opt.step()
        synced = avg.after_step()
        hashes.append((synced, [tensor_hash(p) for m in (a, b, c) for p in m.parameters()]))
    return {"hashes": hashes, "state": avg.state_dict()}


@pytest.mark.parametrize("compress", [False, True])
def test_replicas_stay_identical_when_the_trainable_set_changes(tmp_path: Path, compress: bool) -> None:
    r0, r1 = run_workers(_changing_set, 2, tmp_path, compress)
    for step, ((s0, h0), (s1, h1)) in enumerate(zip(r0["hashes"], r1["hashes"]), start=1):
        assert s0 == s1
        if s0:
            assert h0 == h1, step  # every tensor, the new group, the frozen and the joined ones included
        else:
            assert h0 != h1, step
    if compress:
        assert len(r0["state"]["anchor"]) == 2 + 2 + 2 - 1  # a.weight frozen; b joined, c joined


def _final_sync(rank: int, world: int, compress: bool, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=4, state_sync_every={}, compress_params=compress), Communicator(), model.buffers())
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        model(torch.randn(8, 64, generator=gen)).pow(2).mean().backward()
        opt.step()
        avg.after_step()
    before = [p.detach().clone() for p in [*model.parameters(), *avg.buffers]]
    ran = avg.final_sync()
    return {"before": before, "after": [p.detach().clone() for p in [*model.parameters(), *avg.buffers]], "ran": ran, "again": avg.final_sync()}


@pytest.mark.parametrize("compress", [False, True])
def test_final_sync_leaves_every_rank_on_the_exact_average(tmp_path: Path, compress: bool) -> None:
    r0, r1 = run_workers(_final_sync, 2, tmp_path, compress, 6)  # 2 local steps past the last sync
    assert r0["ran"] and r1["ran"] and not r0["again"] and not r1["again"]
    # the replicas differed (the Linear bias has next to no gradient through BatchNorm)
    assert sum(not torch.equal(x0, x1) for x0, x1 in zip(r0["before"], r1["before"])) >= 5
    for x0, x1, y0, y1 in zip(r0["before"], r1["before"], r0["after"], r1["after"]):
        assert torch.equal(y0, y1)
        torch.testing.assert_close(y0, (x0 + x1) / 2, rtol=0, atol=1e-7)
    r0, r1 = run_workers(_final_sync, 2, tmp_path, compress, 8)  # ended on a sync: nothing to do
    assert not r0["ran"] and not r1["ran"]
    for y0, y1, x0 in zip(r0["after"], r1["after"], r0["before"]):
        assert torch.equal(y0, y1) and torch.equal(y0, x0)


def _one_rank_freezes(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=2, state_sync_every={}), Communicator())
    try:
        for step in range(6):
            if step == 3 and rank == 1:
                model[0].weight.requires_grad_(False)  # on one rank only
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            avg.after_step()
    except RuntimeError as error:
        return f"step {step}: {error}"
    return "no error"


def test_a_trainable_set_changed_on_one_rank_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    for message in run_workers(_one_rank_freezes, 2, tmp_path, timeout=120, collective_timeout=30):
        assert message.startswith("step 3: ") and "the parameters and buffers to average differs" in message, message


def _residual_oracle(rank: int, world: int, syncs: int) -> dict[str, Any]:
    """Compressed parameter sync of one 128x128 weight (64x64 tiles, top-16, fp32 values), SGD steps between."""
    from demo_lightning.algorithms import CodecConfig

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(128, 128) * 0.1)
    opt = torch.optim.SGD([w], lr=0.1)
    config = DesLocConfig(param_sync_every=2, state_sync_every={}, compress_params=True, codec=CodecConfig(topk=16, value_format="fp32", dense_below=0, dense_vectors=False))
    avg = DesLocAverager(opt, config, Communicator())
    before_sync, residuals = [], []
    gen = torch.Generator().manual_seed(rank)
    for step in range(2 * syncs):
        w.grad = torch.randn(128, 128, generator=gen)
        opt.step()
        if step % 2 == 1:
            before_sync.append(w.detach().clone())
        avg.after_step()
        if step % 2 == 1:
            residuals.append(avg.state_dict()["residual"][0].clone())
    return {"x": before_sync, "e": residuals, "final": w.detach().clone()}


def _topk_sent(d: Any, k: int) -> Any:
    """What a worker sends for ``d`` (float64): per 64x64 tile the k largest-magnitude DCT coefficients, decoded."""
    import numpy as np
    import scipy.fft

    sent = np.zeros_like(d)
    for r in range(0, d.shape[0], 64):
        for c in range(0, d.shape[1], 64):
            coeffs = scipy.fft.dctn(d[r : r + 64, c : c + 64], norm="ortho").reshape(-1)
            keep = np.argsort(-np.abs(coeffs), kind="stable")[:k]
            sparse = np.zeros_like(coeffs)
            sparse[keep] = coeffs[keep]
            sent[r : r + 64, c : c + 64] = scipy.fft.idctn(sparse.reshape(64, 64), norm="ortho")
    return sent


def test_compressed_sync_residual_and_anchor_match_the_algorithm_written_out(tmp_path: Path) -> None:
    syncs = 4
    ranks = run_workers(_residual_oracle, 2, tmp_path, syncs)
    torch.manual_seed(0)
    anchor = (torch.randn(128, 128) * 0.1).double().numpy()
    residual = [anchor * 0, anchor * 0]
    for s in range(syncs):
        deltas = [ranks[r]["x"][s].double().numpy() - anchor + residual[r] for r in range(2)]
        sent = [_topk_sent(d, 16) for d in deltas]
        residual = [d - q for d, q in zip(deltas, sent)]
        anchor = anchor + (sent[0] + sent[1]) / 2
        for r in range(2):
            assert float(abs(residual[r]).max()) > 1e-3  # error feedback really holds something back
            torch.testing.assert_close(ranks[r]["e"][s].double(), torch.from_numpy(residual[r]), rtol=1e-4, atol=1e-5)
    for r in range(2):
        torch.testing.assert_close(ranks[r]["final"].double(), torch.from_numpy(anchor), rtol=1e-4, atol=1e-5)
