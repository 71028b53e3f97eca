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

from demo_lightning.algorithms import DeMoConfig, DeMoExchange
from demo_lightning.comm import Communicator
from demo_lightning.optim import Signum
from demo_lightning.strategies import DeMoStrategy

from dist_helpers import run_workers
from exchange_inputs import (SHAPES, Grads, assert_feeds, assert_off_keeps_nothing, assert_resumes_bitwise, exchange_with,
                             make_grads, make_params, step_with, unclipped_of)

BETA = 0.9
SETTING = {"gradient_ema": BETA}


def test_the_momentum_takes_the_moving_average_of_the_gradients() -> None:
    average = [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]

    def fed(grads: Grads) -> Grads:
        nonlocal average
        average = [BETA * e + (1 - BETA) * g.double() for e, g in zip(average, grads)]
        return [e.float() for e in average]

    assert_feeds(SETTING, fed)


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
    exchange = DeMoExchange(opt, unclipped_of(**WHOLE, gradient_ema=beta), Communicator())
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
    state = assert_resumes_bitwise(SETTING, "gradient_averages")
    # a checkpoint from another model is refused, naming what did not fit
    wrong = dict(state, gradient_averages={0: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="gradient average for parameter 0 has shape"):
        exchange_with(make_params(), **SETTING).load_state_dict(wrong)


def test_a_tensor_without_a_gradient_keeps_its_average() -> None:
    params = make_params()
    exchange = exchange_with(params, **SETTING)
    grads = make_grads(2)
    step_with(exchange, params, grads[0])
    before = exchange.state_dict()["gradient_averages"][0]
    torch.testing.assert_close(before, (1 - BETA) * grads[0][0])
    for p, g in zip(params, grads[1]):
        p.grad = g.clone()
    params[0].grad = None
    exchange.step()
    assert torch.equal(exchange.state_dict()["gradient_averages"][0], before)


def test_off_keeps_no_average_and_clear_state_drops_them() -> None:
    assert_off_keeps_nothing(SETTING, "gradient_averages")


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), "0.9"])
def test_gradient_ema_outside_zero_to_one_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match="gradient_ema"):
        DeMoConfig(gradient_ema=bad)
    with pytest.raises(ValueError, match="gradient_ema"):
        DeMoStrategy(gradient_ema=bad)


def test_the_strategy_hands_it_to_the_exchange() -> None:
    assert DeMoStrategy(gradient_ema=0.9).runtime.demo_config.gradient_ema == 0.9
