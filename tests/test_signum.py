"""Signum: oracles (hand computation, signSGD), precision and checkpoints, convergence, the bundled models' name, bad input."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import torch
from torch import nn

from demo_lightning.algorithms.desloc import periods_from_betas
from demo_lightning.models.training import optimizer_with_schedule
from demo_lightning.optim import Signum

KEY = "momentum_buffer"


def _params(dtype: torch.dtype = torch.float64) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(5, 3, generator=gen, dtype=dtype)), nn.Parameter(torch.randn(7, generator=gen, dtype=dtype))]


def _grads(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params]


def test_steps_against_a_hand_computation_with_groups_and_a_zero_coordinate() -> None:
    a, b = _params()
    opt = Signum([{"params": [a], "beta": 0.5, "weight_decay": 0.1}, {"params": [b], "lr": 0.3}], lr=0.02)
    p_ref = {a: a.detach().clone(), b: b.detach().clone()}
    m_ref = {a: torch.zeros_like(a), b: torch.zeros_like(b)}
    settings = {a: (0.02, 0.5, 0.1), b: (0.3, 0.9, 0.0)}  # (lr, beta, weight decay): a's group, then b's with defaults
    for step in range(4):
        for p, g in zip((a, b), _grads([a, b], step)):
            p.grad = g
        b.grad[3] = 0.0 if step == 0 else b.grad[3]  # a zero momentum coordinate at step 0: sign 0, it stays put
        opt.step()
        for p, (lr, beta, wd) in settings.items():
            m_ref[p] = beta * m_ref[p] + (1 - beta) * p.grad
            signs = torch.where(m_ref[p] > 0, 1.0, torch.where(m_ref[p] < 0, -1.0, 0.0)).to(torch.float64)
            p_ref[p] = p_ref[p] * (1 - lr * wd) - lr * signs
            torch.testing.assert_close(opt.state[p][KEY], m_ref[p], rtol=1e-15, atol=0)
            torch.testing.assert_close(p.detach(), p_ref[p], rtol=1e-15, atol=1e-16)
        if step == 0:
            assert float(b.detach()[3]) == float(_params()[1].detach()[3])  # unmoved: no decay in b's group
    assert (a.detach() - _params()[0].detach()).abs().max() > 0.05  # a moved (negative control on the oracle)


def test_beta_zero_is_sign_sgd_bitwise() -> None:
    ours, ref = _params(), _params()
    opt = Signum(ours, lr=0.05, beta=0.0)
    for step in range(3):
        grads = _grads(ours, step)
        for p, g in zip(ours, grads):
            p.grad = g
        opt.step()
        with torch.no_grad():
            for p, g in zip(ref, grads):
                p.sub_(0.05 * torch.sign(g))
        assert all(torch.equal(x, y) for x, y in zip(ours, ref)), step


def test_half_precision_keeps_an_fp32_momentum_through_a_checkpoint_then_lockstep_is_bitwise() -> None:
    params_a = _params(torch.bfloat16)
    opt_a = Signum(params_a, lr=0.01, beta=0.95)
    for step in range(3):
        for p, g in zip(params_a, _grads(params_a, step)):
            p.grad = g
        opt_a.step()
    assert all(opt_a.state[p][KEY].dtype == torch.float32 for p in params_a)
    buffer = io.BytesIO()
    torch.save(opt_a.state_dict(), buffer)
    buffer.seek(0)
    params_b = [nn.Parameter(p.detach().clone()) for p in params_a]
    opt_b = Signum(params_b, lr=9.0, beta=0.1)
    opt_b.load_state_dict(torch.load(buffer, weights_only=True))
    for pa, pb in zip(params_a, params_b):
        assert opt_b.state[pb][KEY].dtype == torch.float32  # torch's own load would have rounded it to bf16
        assert torch.equal(opt_a.state[pa][KEY], opt_b.state[pb][KEY])
    assert opt_b.param_groups[0]["lr"] == 0.01 and opt_b.param_groups[0]["beta"] == 0.95
    params_c = [nn.Parameter(p.detach().clone()) for p in params_a]  # negative control: a fresh momentum
    opt_c = Signum(params_c, lr=0.01, beta=0.95)
    for step in range(3, 8):
        for params in (params_a, params_b, params_c):
            for p, g in zip(params, _grads(params, step)):
                p.grad = g
        for opt in (opt_a, opt_b, opt_c):
            opt.step()
        assert all(torch.equal(pa, pb) for pa, pb in zip(params_a, params_b)), step
    assert any(not torch.equal(pa, pc) for pa, pc in zip(params_a, params_c))


def test_params_without_grad_are_untouched() -> None:
    a, b = _params()
    opt = Signum([a, b], lr=0.1, weight_decay=0.5)
    b_before = b.detach().clone()
    a.grad = torch.ones_like(a)
    opt.step()
    assert KEY in opt.state[a] and len(opt.state[b]) == 0 and torch.equal(b, b_before)


@pytest.mark.parametrize(("beta", "max_error"), [(0.0, 0.01), (0.9, 0.03)])
def test_a_quadratic_converges_to_within_a_few_steps(beta: float, max_error: float) -> None:
    """Steps of a constant 0.01 from up to 1.0 away: signSGD ends oscillating within one step of the
    minimum, the momentum overshoots by a few steps."""
    target = torch.linspace(-1.0, 1.0, 50, dtype=torch.float64)
    x = nn.Parameter(torch.zeros(50, dtype=torch.float64))
    opt = Signum([x], lr=0.01, beta=beta)
    for _ in range(400):
        opt.zero_grad()
        ((x - target) ** 2).sum().backward()
        opt.step()
    error = (x.detach() - target).abs()
    assert float(error.max()) <= max_error + 1e-12 and float(error.mean()) < 0.011


def test_the_bundled_models_name_and_desloc_period() -> None:
    p = nn.Parameter(torch.zeros(3))
    default = optimizer_with_schedule([p], "signum", lr=0.1, weight_decay=0.0, momentum=None, warmup_steps=1, max_steps=10)["optimizer"]
    assert isinstance(default, Signum) and default.param_groups[0]["beta"] == 0.9
    chosen = optimizer_with_schedule([p], "signum", lr=0.1, weight_decay=0.0, momentum=0.99, warmup_steps=1, max_steps=10)["optimizer"]
    assert chosen.param_groups[0]["beta"] == 0.99
    sgd = optimizer_with_schedule([p], "sgd", lr=0.1, weight_decay=0.0, momentum=None, warmup_steps=1, max_steps=10)["optimizer"]
    assert sgd.param_groups[0]["momentum"] == 0.0  # None keeps plain SGD for DeMo's sign update
    assert periods_from_betas(4, chosen) == {KEY: 69}  # DES-LOC averages its momentum on beta's half-life


def _scheduler_wrote(key: str, value: float) -> Any:
    def act(opt: Signum) -> None:
        opt.param_groups[0][key] = value
        opt.param_groups[0]["params"][0].grad = torch.ones(3)
        opt.step()

    return act


@pytest.mark.parametrize(
    ("kwargs", "act", "message"),
    [
        ({"lr": 0.0}, None, "lr must lie in (0, inf), got 0.0"),
        ({"beta": 1.0}, None, "beta must lie in [0, 1), got 1.0"),
        ({"weight_decay": -0.1}, None, "weight_decay must lie in [0, inf), got -0.1"),
        ({}, lambda opt: opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "beta": -0.5}), "beta must lie in [0, 1), got -0.5"),
        ({}, _scheduler_wrote("beta", 1.5), "beta must lie in [0, 1), got 1.5"),
    ],
)
def test_bad_input_is_rejected_naming_it(kwargs: dict[str, Any], act: Any, message: str) -> None:
    p = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=re.escape(message)):
        opt = Signum([p], **{"lr": 0.1, **kwargs})
        assert act is not None, "the constructor accepted a bad value"
        act(opt)
    if act is not None:
        assert len(opt.param_groups) == 1  # a rejected group is not kept
