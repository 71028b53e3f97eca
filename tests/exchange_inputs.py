"""Oracles shared by the settings that change what each worker's momentum is fed
(``compensation``, ``gradient_ema``, ``clip_grad_norm``): parameters and gradients (a compressed tensor whose sides do
not tile exactly, and two dense ones), an exchange with one setting, and the checks that such a
setting does what the plain exchange does on the transformed gradients and that its state resumes
bitwise."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange

SHAPES = [(48, 40), (64,), (100,)]  # compressed (chunk 16), dense (below dense_below=80), dense (1-D)
Grads = list[torch.Tensor]


def make_params(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*shape, generator=gen)) for shape in SHAPES]


def make_grads(steps: int) -> list[Grads]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(*shape, generator=gen) for shape in SHAPES] for _ in range(steps)]


def exchange_with(params: list[nn.Parameter], **setting: Any) -> DeMoExchange:
    """An exchange over ``params`` (fp32 values, the raw update, no clipping unless ``setting`` gives
    ``clip_grad_norm``) with ``setting`` (e.g. ``compensation=0.3``)."""
    setting = {"clip_grad_norm": None, **setting}
    config = DeMoConfig(CodecConfig(chunk=16, topk=12, value_format="fp32", dense_below=80), update="raw", **setting)
    return DeMoExchange(torch.optim.SGD(params, lr=0.1), config)


def step_with(exchange: DeMoExchange, params: list[nn.Parameter], grads: Grads) -> Grads:
    """Set the gradients, run one exchange, return the updates it wrote (copies)."""
    for p, g in zip(params, grads):
        p.grad = g.clone()
    exchange.step()
    return [p.grad.clone() for p in params]


def assert_feeds(setting: dict[str, Any], fed: Callable[[Grads], Grads], steps: int = 5) -> None:
    """An exchange with ``setting`` fed each step's gradients does what a plain one does fed
    ``fed(gradients)`` (called once per step, in order, so it may keep its own history): the same
    updates and momenta. Negative control: the plain exchange on the gradients themselves differs."""
    grads = make_grads(steps)
    a_params, b_params = make_params(), make_params()
    with_setting, plain = exchange_with(a_params, **setting), exchange_with(b_params)
    for t, g in enumerate(grads):
        got, want = step_with(with_setting, a_params, g), step_with(plain, b_params, fed(g))
        for i, (x, y) in enumerate(zip(got, want)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"step {t} tensor {i}: the shared update")
            torch.testing.assert_close(with_setting.momentum(a_params[i]), plain.momentum(b_params[i]), rtol=1e-5, atol=1e-6)
    raw_params = make_params()
    raw = exchange_with(raw_params)
    last = [step_with(raw, raw_params, g) for g in grads][-1]
    assert not torch.allclose(last[0], got[0], rtol=1e-3, atol=1e-4), "the setting changed nothing"


def assert_resumes_bitwise(setting: dict[str, Any], key: str, steps: int = 6) -> dict[str, Any]:
    """Three exchanges, ``state_dict``, a fresh exchange loads it and continues bitwise as one that
    never stopped; without ``key`` in the state the next step differs (it is what makes it bitwise).
    Returns the saved state (after 3 of ``steps`` exchanges) for further checks."""
    grads = make_grads(steps)
    params = make_params()
    whole = exchange_with(params, **setting)
    reference = [step_with(whole, params, g) for g in grads]

    first_params = make_params()
    first = exchange_with(first_params, **setting)
    for g in grads[:3]:
        step_with(first, first_params, g)
    state = first.state_dict()
    assert set(state[key]) == set(range(len(SHAPES)))

    resumed_params = [nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = exchange_with(resumed_params, **setting)
    resumed.load_state_dict(state)
    for t, g in enumerate(grads[3:], start=3):
        for x, y in zip(step_with(resumed, resumed_params, g), reference[t]):
            assert torch.equal(x, y), t
    cleared_params = [nn.Parameter(p.detach().clone()) for p in first_params]
    cleared = exchange_with(cleared_params, **setting)
    cleared.load_state_dict({k: v for k, v in state.items() if k != key})
    assert not torch.equal(step_with(cleared, cleared_params, grads[3])[0], reference[3][0])
    return state


def assert_off_keeps_nothing(setting: dict[str, Any], key: str) -> None:
    """Without the setting the state has no ``key``; with it, ``clear_state`` drops it."""
    params = make_params()
    plain = exchange_with(params)
    step_with(plain, params, make_grads(1)[0])
    assert key not in plain.state_dict()
    on = exchange_with(params, **setting)
    step_with(on, params, make_grads(1)[0])
    assert key in on.state_dict()
    on.clear_state()
    assert key not in on.state_dict()


def unclipped(*args: Any, **settings: Any) -> DeMoConfig:
    """``DeMoConfig(*args, **settings)`` without the default clipping (``clip_grad_norm=None``): for the
    oracles of the exchange's math on the gradient it is given (the clip has its own, test_default_clip.py)."""
    return DeMoConfig(*args, **{"clip_grad_norm": None, **settings})


def unclipped_of(**settings: Any) -> DeMoConfig:
    """``DeMoConfig.of(**settings)`` without the default clipping (see :func:`unclipped`)."""
    return DeMoConfig.of(**{"clip_grad_norm": None, **settings})
