"""Gradient smoothing (issue 18): ``DeMoConfig(gradient_ema=beta)`` feeds each worker's momentum
``e <- beta e + (1 - beta) g`` instead of ``g``.

Oracles: an exchange with ``gradient_ema=beta`` fed the raw gradients does exactly what one
without it does when fed the moving average (computed here in float64); with every coefficient
kept, fp32 values and the sign update, DeMo over two gloo ranks with different data is
``Signum(beta)`` on the ranks' mean gradient (computed here in one process); its state carries the
averages, so a save and load continues bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange
from demo_lightning.comm import Communicator
from demo_lightning.optim import Signum
from demo_lightning.strategies import DeMoStrategy

from dist_helpers import run_workers

BETA = 0.9
SHAPES = [(48, 40), (64,), (100,)]  # compressed, dense (below dense_below), dense


def _params(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*shape, generator=gen)) for shape in SHAPES]


def _grads(steps: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(*shape, generator=gen) for shape in SHAPES] for _ in range(steps)]


def _exchange(params: list[nn.Parameter], beta: float) -> DeMoExchange:
    config = DeMoConfig(CodecConfig(chunk=16, topk=12, value_format="fp32", dense_below=80), update="raw", gradient_ema=beta)
    return DeMoExchange(torch.optim.SGD(params, lr=0.1), config)


def _step(exchange: DeMoExchange, params: list[nn.Parameter], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    exchange.step()
    return [p.grad.clone() for p in params]


def test_the_momentum_takes_the_moving_average_of_the_gradients() -> None:
    steps = _grads(5)
    a_params, b_params = _params(), _params()
    smoothed, plain = _exchange(a_params, BETA), _exchange(b_params, 0.0)
    average = [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]
    for t, grads in enumerate(steps):
        average = [BETA * e + (1 - BETA) * g.double() for e, g in zip(average, grads)]
        got, want = _step(smoothed, a_params, grads), _step(plain, b_params, [e.float() for e in average])
        for i, (x, y) in enumerate(zip(got, want)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"step {t} tensor {i}: the shared update")
            torch.testing.assert_close(smoothed.momentum(a_params[i]), plain.momentum(b_params[i]), rtol=1e-5, atol=1e-6)
    # negative control: beta matters (the updates differ from DeMo fed the gradients themselves)
    raw_params = _params()
    raw = _exchange(raw_params, 0.0)
    last = [_step(raw, raw_params, grads) for grads in steps][-1]
    assert not torch.allclose(last[0], got[0], rtol=1e-3, atol=1e-4)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 70), nn.Tanh(), nn.Linear(70, 3)).double()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 40, generator=gen, dtype=torch.float64), torch.randn(16, 3, generator=gen, dtype=torch.float64)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).mean()


LR, STEPS = 0.01, 6
WHOLE = {"keep_ratio": 1.0, "value_format": "fp32", "dense_below": 0, "dense_vectors": False, "decay": 0.99}


def _demo_worker(rank: int, world: int, beta: float) -> list[torch.Tensor]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    exchange = DeMoExchange(opt, DeMoConfig.of(**WHOLE, gradient_ema=beta), Communicator())
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, _batch(step, rank)).backward()
        exchange.step()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _signum_on_the_mean_gradient(world: int, beta: float) -> list[torch.Tensor]:
    model = _net()
    opt = Signum(model.parameters(), lr=LR, beta=beta)
    for step in range(STEPS):
        grads = []
        for rank in range(world):
            model.zero_grad()
            _loss(model, _batch(step, rank)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(180)
def test_with_every_coefficient_kept_two_ranks_are_signum_on_the_mean_gradient(tmp_path: Path) -> None:
    ranks = run_workers(_demo_worker, 2, tmp_path, BETA)
    want = _signum_on_the_mean_gradient(2, BETA)
    for got in ranks:
        for x, y in zip(got, want):
            # every step moves each coordinate by exactly +-lr in both; the transform's rounding (fp32 on
            # the wire) can only flip the sign of a mean gradient within ~1e-7 of zero, which this data has not
            torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
    # negative control: DeMo as published (beta 0) is signSGD here, not Signum
    published = run_workers(_demo_worker, 2, tmp_path / "published", 0.0)[0]
    assert any(not torch.allclose(x, y, atol=LR / 2) for x, y in zip(published, want))
    assert all(torch.allclose(x, y, rtol=0, atol=1e-12) for x, y in zip(published, _signum_on_the_mean_gradient(2, 0.0)))


def test_the_averages_are_saved_and_a_resumed_exchange_continues_bitwise() -> None:
    steps = _grads(6)
    params = _params()
    whole = _exchange(params, BETA)
    reference = [_step(whole, params, grads) for grads in steps]

    first_params = _params()
    first = _exchange(first_params, BETA)
    for grads in steps[:3]:
        _step(first, first_params, grads)
    state = first.state_dict()
    assert set(state["gradient_averages"]) == {0, 1, 2}

    resumed_params = [nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = _exchange(resumed_params, BETA)
    resumed.load_state_dict(state)
    for t, grads in enumerate(steps[3:], start=3):
        for x, y in zip(_step(resumed, resumed_params, grads), reference[t]):
            assert torch.equal(x, y), t
    # without the saved averages the next step differs (the state is what makes it bitwise)
    cleared_params = [nn.Parameter(p.detach().clone()) for p in first_params]
    cleared = _exchange(cleared_params, BETA)
    cleared.load_state_dict({k: v for k, v in state.items() if k != "gradient_averages"})
    assert not torch.equal(_step(cleared, cleared_params, steps[3])[0], reference[3][0])
    # a checkpoint from another model is refused, naming what did not fit
    wrong = dict(state, gradient_averages={0: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="gradient average for parameter 0 has shape"):
        _exchange(_params(), BETA).load_state_dict(wrong)


def test_a_tensor_without_a_gradient_keeps_its_average() -> None:
    params = _params()
    exchange = _exchange(params, BETA)
    grads = _grads(2)
    _step(exchange, params, grads[0])
    before = exchange.state_dict()["gradient_averages"][0]
    torch.testing.assert_close(before, (1 - BETA) * grads[0][0])
    for p, g in zip(params, grads[1]):
        p.grad = g.clone()
    params[0].grad = None
    exchange.step()
    assert torch.equal(exchange.state_dict()["gradient_averages"][0], before)


def test_off_keeps_no_average_and_clear_state_drops_them() -> None:
    params = _params()
    plain = _exchange(params, 0.0)
    _step(plain, params, _grads(1)[0])
    assert "gradient_averages" not in plain.state_dict()
    smoothed = _exchange(params, BETA)
    _step(smoothed, params, _grads(1)[0])
    smoothed.clear_state()
    assert "gradient_averages" not in smoothed.state_dict()


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), "0.9"])
def test_gradient_ema_outside_zero_to_one_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match="gradient_ema"):
        DeMoConfig(gradient_ema=bad)
    with pytest.raises(ValueError, match="gradient_ema"):
        DeMoStrategy(gradient_ema=bad)


def test_the_strategy_hands_it_to_the_exchange() -> None:
    assert DeMoStrategy(gradient_ema=0.9).runtime.demo_config.gradient_ema == 0.9
