"""Momentum compensation (seed 000 §5.1, ``v + lambda (g_t - g_{t-1})``): ``DeMoConfig(compensation=lambda)``.

Oracle: an exchange with ``compensation=lambda`` fed the raw gradients must do exactly what an
exchange without it does when fed ``g_t + lambda (g_t - g_{t-1})`` (``g_1`` alone at the first step),
computed here in float64; its state carries the last gradients, so a save and load continues bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange

LAM = 0.3
SHAPES = [(48, 40), (64,), (100,)]  # compressed, dense (below dense_below), dense


def _params(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*shape, generator=gen)) for shape in SHAPES]


def _grads(steps: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(*shape, generator=gen) for shape in SHAPES] for _ in range(steps)]


def _exchange(params: list[nn.Parameter], lam: float) -> DeMoExchange:
    config = DeMoConfig(CodecConfig(chunk=16, topk=12, value_format="fp32", dense_below=80), update="raw", compensation=lam)
    return DeMoExchange(torch.optim.SGD(params, lr=0.1), config)


def _step(exchange: DeMoExchange, params: list[nn.Parameter], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    exchange.step()
    return [p.grad.clone() for p in params]


def test_compensation_feeds_the_momentum_g_plus_lambda_times_the_gradients_change() -> None:
    steps = _grads(5)
    a_params, b_params = _params(), _params()
    compensated, plain = _exchange(a_params, LAM), _exchange(b_params, 0.0)
    previous = None
    for t, grads in enumerate(steps):
        fed = grads if previous is None else [(g.double() + LAM * (g.double() - q.double())).float() for g, q in zip(grads, previous)]
        previous = grads
        got, want = _step(compensated, a_params, grads), _step(plain, b_params, fed)
        for i, (x, y) in enumerate(zip(got, want)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"step {t} tensor {i}: the shared update")
            torch.testing.assert_close(compensated.momentum(a_params[i]), plain.momentum(b_params[i]), rtol=1e-5, atol=1e-6)
    # negative control: lambda matters (the updates differ from uncompensated DeMo on the same gradients)
    raw_params = _params()
    raw = _exchange(raw_params, 0.0)
    last = [_step(raw, raw_params, grads) for grads in steps][-1]
    assert not torch.allclose(last[0], got[0])


def test_compensation_state_is_saved_and_a_resumed_exchange_continues_bitwise() -> None:
    steps = _grads(6)
    params = _params()
    whole = _exchange(params, LAM)
    reference = [_step(whole, params, grads) for grads in steps]

    first_params = _params()
    first = _exchange(first_params, LAM)
    for grads in steps[:3]:
        _step(first, first_params, grads)
    state = first.state_dict()
    assert set(state["previous_gradients"]) == {0, 1, 2}
    for i, g in state["previous_gradients"].items():
        assert torch.equal(g, steps[2][i])  # the last gradient, not the compensated one

    resumed_params = [nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = _exchange(resumed_params, LAM)
    resumed.load_state_dict(state)
    for t, grads in enumerate(steps[3:], start=3):
        for x, y in zip(_step(resumed, resumed_params, grads), reference[t]):
            assert torch.equal(x, y), t
    # without the saved gradients the next step differs (the state is what makes it bitwise)
    cleared_params = [nn.Parameter(p.detach().clone()) for p in first_params]
    cleared = _exchange(cleared_params, LAM)
    cleared.load_state_dict({k: v for k, v in state.items() if k != "previous_gradients"})
    assert not torch.equal(_step(cleared, cleared_params, steps[3])[0], reference[3][0])


def test_no_compensation_keeps_no_gradient_and_clear_state_drops_it() -> None:
    params = _params()
    plain = _exchange(params, 0.0)
    _step(plain, params, _grads(1)[0])
    assert "previous_gradients" not in plain.state_dict()
    compensated = _exchange(params, LAM)
    _step(compensated, params, _grads(1)[0])
    compensated.clear_state()
    assert "previous_gradients" not in compensated.state_dict()


def test_compensation_outside_zero_to_one_is_refused_naming_it() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="compensation"):
            DeMoConfig(compensation=bad)
