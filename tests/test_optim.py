"""DecoupledMomentum: oracles (SGD, hand computation), checkpoints, convergence, DES-LOC and DeMo composition, bad input."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from demo_lightning.algorithms import DeMoConfig, DeMoExchange
from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig, periods_from_betas
from demo_lightning.comm import Communicator
from demo_lightning.optim import DecoupledMomentum

from dist_helpers import run_workers, tensor_hash

pytestmark = pytest.mark.timeout(240)

KEY = "momentum_buffer"


def _params(dtype: torch.dtype = torch.float64, seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(5, 3, generator=gen, dtype=dtype)), nn.Parameter(torch.randn(7, generator=gen, dtype=dtype))]


def _grads(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params]


# ---------------------------------------------------------------- oracles
def test_lam_zero_without_weight_decay_is_sgd_exactly_and_lam_positive_is_not() -> None:
    ref, ours, control = _params(), _params(), _params()
    sgd = torch.optim.SGD(ref, lr=0.07)
    plain = DecoupledMomentum(ours, lr=0.07, lam=0.0, beta=0.8)
    momentum = DecoupledMomentum(control, lr=0.07, lam=0.1, beta=0.8)
    for step in range(6):
        for group in (ref, ours, control):
            for p, g in zip(group, _grads(group, step)):
                p.grad = g
        sgd.step()
        plain.step()
        momentum.step()
        for a, b in zip(ref, ours):
            assert torch.equal(a, b), step  # bitwise: lam = 0 leaves exactly g
        if step > 0:  # negative control: the momentum term moves the parameters
            assert all(not torch.allclose(a, c, rtol=1e-6, atol=0) for a, c in zip(ref, control)), step
    assert all(KEY in plain.state[p] for p in ours)  # the momentum is kept even when it is not used


def _oracle(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, lr: float, beta: float, lam: float, eps: float, wd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule written out independently: returns (new p, new m)."""
    m_new = beta * m + (1 - beta) * g
    v = torch.sqrt((m_new**2).sum()) / torch.maximum(torch.sqrt((g**2).sum()), torch.tensor(eps, dtype=g.dtype))
    return p * (1 - lr * wd) - lr * (g + lam * v * m_new), m_new


def test_one_step_against_a_hand_computation_with_groups_overrides_and_eps_floor() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b, c = (nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64)) for shape in ((4, 6), (9,), (3, 3)))
    opt = DecoupledMomentum(
        [{"params": [a], "beta": 0.8, "lam": 0.3, "weight_decay": 0.05, "lr": 0.1}, {"params": [b, c], "eps": 0.5}],
        lr=0.2,
    )
    opt.set_param_options(b, beta=0.5)
    opt.set_param_options(b, lam=0.7)  # merges with the beta override
    assert opt.param_options[b] == {"beta": 0.5, "lam": 0.7}
    before = {p: p.detach().clone() for p in (a, b, c)}
    m0 = {p: torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in (a, b, c)}
    for p in (a, b, c):
        opt.state[p][KEY] = m0[p].clone()  # an existing momentum is consumed
    a.grad = torch.randn(a.shape, generator=gen, dtype=torch.float64)
    b.grad = 3.0 * torch.randn(b.shape, generator=gen, dtype=torch.float64)  # ||g|| > eps = 0.5
    c.grad = torch.zeros_like(c)  # ||g|| = 0 < eps: v = ||m|| / eps
    opt.step()
    settings = {
        a: (0.1, 0.8, 0.3, 1e-8, 0.05),  # the group's own values
        b: (0.2, 0.5, 0.7, 0.5, 0.0),  # overrides win over the group's defaults
        c: (0.2, 0.9, 0.1, 0.5, 0.0),  # the constructor's defaults, the group's eps
    }
    for p, (lr, beta, lam, eps, wd) in settings.items():
        want_p, want_m = _oracle(before[p], p.grad, m0[p], lr, beta, lam, eps, wd)
        torch.testing.assert_close(opt.state[p][KEY], want_m, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(p.detach(), want_p, rtol=1e-13, atol=1e-14)
    # the eps floor made c's step lam * ||m||^2 / eps * lr long (0.9 m0 is c's new momentum)
    step_c = torch.linalg.vector_norm(before[c] - c.detach())
    assert float(step_c) == pytest.approx(0.2 * 0.1 * float(torch.linalg.vector_norm(0.9 * m0[c])) ** 2 / 0.5, rel=1e-12)
    opt.clear_param_options(b)
    assert opt.param_options == {}


def test_half_precision_keeps_an_fp32_momentum_and_rounds_once() -> None:
    p = nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    opt = DecoupledMomentum([p], lr=0.05, lam=0.2, weight_decay=0.1)
    p32, m32 = p.detach().float(), torch.zeros(16, 8)
    for step in range(3):
        g = torch.randn(16, 8, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        p.grad = g
        opt.step()
        want_p, m32 = _oracle(p32, g.float(), m32, 0.05, 0.9, 0.2, 1e-8, 0.1)
        p32 = want_p.to(torch.bfloat16).float()  # the parameter is stored in bf16 after every step
        assert opt.state[p][KEY].dtype == torch.float32
        torch.testing.assert_close(opt.state[p][KEY], m32, rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), want_p.to(torch.bfloat16))


# ---------------------------------------------------------------- state
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_state_dict_round_trip_then_lockstep_is_bitwise(dtype: torch.dtype) -> None:
    params_a = _params(dtype)
    opt_a = DecoupledMomentum([{"params": params_a[:1], "beta": 0.7, "weight_decay": 0.02}, {"params": params_a[1:]}], lr=0.03, lam=0.15)
    opt_a.set_param_options(params_a[1], lam=0.4)
    for step in range(3):
        for p, g in zip(params_a, _grads(params_a, step)):
            p.grad = g
        opt_a.step()
    saved = opt_a.state_dict()
    assert "param_options" not in saved
    buffer = io.BytesIO()
    torch.save(saved, buffer)  # a real checkpoint: no tensors shared with A
    buffer.seek(0)

    params_b = [nn.Parameter(p.detach().clone()) for p in params_a]
    opt_b = DecoupledMomentum([{"params": params_b[:1]}, {"params": params_b[1:]}], lr=9.0, beta=0.1, lam=5.0)
    opt_b.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt_b.param_options == {}
    opt_b.set_param_options(params_b[1], lam=0.4)  # a policy re-applies overrides every step
    assert [g["beta"] for g in opt_b.param_groups] == [0.7, 0.9] and opt_b.param_groups[1]["lr"] == 0.03
    for p in params_b:
        assert opt_b.state[p][KEY].dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)

    params_c = [nn.Parameter(p.detach().clone()) for p in params_a]  # negative control: no state loaded
    opt_c = DecoupledMomentum([{"params": params_c[:1], "beta": 0.7, "weight_decay": 0.02}, {"params": params_c[1:]}], lr=0.03, lam=0.15)
    opt_c.set_param_options(params_c[1], lam=0.4)
    for step in range(3, 8):
        for params in (params_a, params_b, params_c):
            for p, g in zip(params, _grads(params, step)):
                p.grad = g
        opt_a.step()
        opt_b.step()
        opt_c.step()
        for pa, pb in zip(params_a, params_b):
            assert torch.equal(pa, pb), step
            assert torch.equal(opt_a.state[pa][KEY], opt_b.state[pb][KEY]), step
    assert any(not torch.equal(pa, pc) for pa, pc in zip(params_a, params_c))


def test_params_without_grad_keep_their_state_untouched() -> None:
    a, b = _params()
    opt = DecoupledMomentum([a, b], lr=0.1, weight_decay=0.5)
    a.grad = torch.randn(a.shape, dtype=torch.float64)
    opt.step()
    assert KEY in opt.state[a] and len(opt.state[b]) == 0  # b never had a gradient: no state at all
    b.grad = torch.randn(b.shape, dtype=torch.float64)
    opt.step()
    b_before, m_before = b.detach().clone(), opt.state[b][KEY].clone()
    a_before = a.detach().clone()
    b.grad = None
    for _ in range(3):
        opt.step()
    assert torch.equal(b, b_before) and torch.equal(opt.state[b][KEY], m_before)  # no decay, no momentum change
    assert not torch.equal(a, a_before)  # the other parameter did move


# ---------------------------------------------------------------- convergence
def _rosenbrock_loss(xy: torch.Tensor) -> torch.Tensor:
    x, y = xy
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def test_rosenbrock_converges() -> None:
    xy = nn.Parameter(torch.tensor([-1.5, 2.0], dtype=torch.float64))
    opt = DecoupledMomentum([xy], lr=1.5e-3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _rosenbrock_loss(xy)
        loss.backward()
        return loss.detach()

    first = float(opt.step(closure))
    for _ in range(5999):
        last = float(opt.step(closure))
    assert first == pytest.approx(12.5) and last < 1e-3  # step returns the closure's loss
    assert float(torch.dist(xy.detach(), torch.tensor([1.0, 1.0], dtype=torch.float64))) < 0.05


def test_periods_from_betas_and_default_period_for_momentum_buffer() -> None:
    assert periods_from_betas(4, DecoupledMomentum([nn.Parameter(torch.zeros(1))], lr=0.1, beta=0.99)) == {KEY: 69}
    assert periods_from_betas(16, DecoupledMomentum([nn.Parameter(torch.zeros(1))], lr=0.1)) == {KEY: 16}
    assert periods_from_betas(16, DecoupledMomentum([nn.Parameter(torch.zeros(1))], lr=0.1, beta=0.0)) == {}
    p = nn.Parameter(torch.zeros(3))
    opt = DecoupledMomentum([p], lr=0.1)
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=5))
    p.grad = torch.ones(3)
    opt.step()
    avg.after_step()
    assert avg.state_periods == {KEY: 15}  # a first moment: 3 K_x by default


def _rosenbrock_desloc(rank: int, world: int, k_x: int, steps: int, watch: int) -> dict[str, Any]:
    xy = nn.Parameter(torch.tensor([-1.5, 2.0]))
    opt = DecoupledMomentum([xy], lr=1.5e-3, lam=0.5)
    anneal = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 if t < 0.7 * steps else 0.02)  # below the noise floor at the end
    avg = DesLocAverager(opt, DesLocConfig(param_sync_every=k_x), Communicator())  # default state periods
    gen = torch.Generator().manual_seed(rank)
    trace = []
    for step in range(steps):
        x, y = xy.detach()
        exact = torch.stack([-2 * (1 - x) - 400 * x * (y - x * x), 200 * (y - x * x)])  # Rosenbrock's gradient
        xy.grad = exact + torch.randn(2, generator=gen)  # each worker's own gradient noise
        opt.step()
        synced = avg.after_step()
        anneal.step()
        if step < watch:
            trace.append({"synced": synced, "params": tensor_hash(xy), "momentum": tensor_hash(opt.state[xy][KEY])})
    avg.sync_now(["params"])
    return {
        "distance": float(torch.dist(xy.detach(), torch.tensor([1.0, 1.0]))),
        "periods": avg.state_periods,
        "trace": trace,
        "syncs": dict(avg.stats.syncs),
    }


def test_rosenbrock_with_noisy_workers_under_desloc_averages_momentum_on_its_period(tmp_path: Path) -> None:
    k_x, steps, watch = 4, 6000, 40
    r0, r1 = run_workers(_rosenbrock_desloc, 2, tmp_path, k_x, steps, watch, timeout=200)
    k_m = 3 * k_x
    assert r0["periods"] == r1["periods"] == {KEY: k_m}
    assert r0["syncs"][f"state/{KEY}"] == steps // k_m
    for t, (a, b) in enumerate(zip(r0["trace"], r1["trace"]), start=1):
        assert a["synced"] == b["synced"] == (["params"] if t % k_x == 0 else []) + ([f"state/{KEY}"] if t % k_m == 0 else [])
        assert (a["params"] == b["params"]) == (t % k_x == 0), t  # equal right after a sync, different between
        assert (a["momentum"] == b["momentum"]) == (t % k_m == 0), t  # also at parameter-only syncs: differ
    # from 2.69 away; one noise-free worker ends 0.02 away, one noisy worker alone about 0.075
    assert max(r0["distance"], r1["distance"]) < 0.15, (r0["distance"], r1["distance"])
    assert r0["distance"] == r1["distance"]


# ---------------------------------------------------------------- DeMo, update="raw"
def _demo_raw(rank: int, world: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 4))  # 8192 weights: through the codec
    opt = DecoupledMomentum(model.parameters(), lr=0.05, lam=0.2, weight_decay=0.01)
    opt.set_param_options(model[0].weight, beta=0.95, lam=0.05)
    exchange = DeMoExchange(opt, DeMoConfig.of(update="raw"), Communicator())
    initial = [p.detach().clone() for p in model.parameters()]
    steps_out = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        model(torch.randn(16, 64, generator=gen)).pow(2).mean().backward()
        local = [tensor_hash(p.grad) for p in model.parameters()]
        exchange.step()
        shared = [p.grad.clone() for p in model.parameters()]
        opt.step()
        if step == 0:  # momentum starts at zero: after one step it is (1 - beta) Q
            betas = [0.95, 0.9, 0.9, 0.9]
            first_ok = all(
                torch.allclose(opt.state[p][KEY], (1 - beta) * q, rtol=1e-6, atol=0)
                for p, q, beta in zip(model.parameters(), shared, betas)
            )
        steps_out.append({
            "local_grads": local,
            "shared": [tensor_hash(q) for q in shared],
            "params": [tensor_hash(p) for p in model.parameters()],
            "momentum": [tensor_hash(opt.state[p][KEY]) for p in model.parameters()],
            "demo_momentum": [tensor_hash(exchange.momentum(p)) for p in model.parameters()],
        })
    moved = all(not torch.equal(a, p) for a, p in zip(initial, model.parameters()))
    return {"steps": steps_out, "first_ok": first_ok, "moved": moved}


def test_under_demo_raw_replicas_stay_bitwise_equal(tmp_path: Path) -> None:
    r0, r1 = run_workers(_demo_raw, 2, tmp_path, 5, timeout=200)
    for t, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        assert a["local_grads"] != b["local_grads"], t  # negative control: the ranks' data differ
        assert a["demo_momentum"] != b["demo_momentum"], t  # ... and so do their DeMo residuals
        assert a["shared"] == b["shared"], t
        assert a["params"] == b["params"], t
        assert a["momentum"] == b["momentum"], t
    assert r0["first_ok"] and r1["first_ok"] and r0["moved"]


# ---------------------------------------------------------------- bad input
def _foreign(opt: DecoupledMomentum) -> None:
    opt.set_param_options(torch.zeros(2), lam=0.1)


def _scheduler_wrote(key: str, value: float) -> Callable[[DecoupledMomentum], None]:
    def act(opt: DecoupledMomentum) -> None:
        opt.param_groups[0][key] = value
        opt.param_groups[0]["params"][0].grad = torch.ones(3)
        opt.step()

    return act


BAD_INPUT = [
    ({"lr": 0.0}, None, "lr must lie in (0, inf), got 0.0"),
    ({"lr": -0.1}, None, "lr must lie in (0, inf), got -0.1"),
    ({"lr": math.inf}, None, "lr must lie in (0, inf), got inf"),
    ({"lr": math.nan}, None, "lr must be a real number in (0, inf), got nan"),
    ({"lr": "fast"}, None, "lr must be a real number in (0, inf), got 'fast'"),
    ({"beta": 1.5}, None, "beta must lie in [0, 1), got 1.5"),
    ({"beta": 1.0}, None, "beta must lie in [0, 1), got 1.0"),
    ({"beta": -0.1}, None, "beta must lie in [0, 1), got -0.1"),
    ({"lam": -0.1}, None, "lam must lie in [0, inf), got -0.1"),
    ({"lam": True}, None, "lam must be a real number in [0, inf), got True"),
    ({"eps": 0.0}, None, "eps must lie in (0, inf), got 0.0"),
    ({"eps": -1e-8}, None, "eps must lie in (0, inf), got -1e-08"),
    ({"weight_decay": -0.01}, None, "weight_decay must lie in [0, inf), got -0.01"),
    ({"group": {"beta": 2.0}}, None, "beta must lie in [0, 1), got 2.0"),
    ({}, lambda opt: opt.set_param_options(opt.param_groups[0]["params"][0], beta=1.0), "beta must lie in [0, 1), got 1.0"),
    ({}, lambda opt: opt.set_param_options(opt.param_groups[0]["params"][0], lam=-2.0), "lam must lie in [0, inf), got -2.0"),
    ({}, _foreign, "param (a tensor of shape (2,)) is not a parameter of this optimizer"),
    ({}, _scheduler_wrote("lr", -1.0), "lr must lie in (0, inf), got -1.0"),
    ({}, _scheduler_wrote("beta", 1.0), "beta must lie in [0, 1), got 1.0"),
]


@pytest.mark.parametrize(("kwargs", "act", "message"), BAD_INPUT, ids=[m.split(" ")[0] + f"-{i}" for i, (_, _, m) in enumerate(BAD_INPUT)])
def test_bad_input_is_rejected_naming_it(kwargs: dict[str, Any], act: Callable[[DecoupledMomentum], None] | None, message: str) -> None:
    kwargs = dict(kwargs)
    p = nn.Parameter(torch.zeros(3))
    group = kwargs.pop("group", None)
    params: Any = [{"params": [p], **group}] if group is not None else [p]
    with pytest.raises(ValueError, match=re.escape(message)):
        opt = DecoupledMomentum(params, **{"lr": 0.1, **kwargs})
        assert act is not None, "the constructor accepted a bad value"
        act(opt)
    if act is not None:
        assert opt.param_options == {}  # a rejected override is not stored
