"""``DeMoConfig.retain_sent = rho``: error feedback takes ``(1 - rho)`` of each sent component out of
the sender's momentum and keeps ``rho`` of it.

Oracle (one worker, so the decoded mean is what it sent; ``update="raw"`` writes it into ``p.grad``;
fp32 or 1-bit values; shapes that tile exactly, so the parameter-shaped momentum is the inverse transform of
the coefficients with nothing cropped; float64 parameters): every step, for compressed and dense
tensors alike, ``m_after = decay * m_before + g - (1 - rho) * p.grad``, computed here in float64.
With ``rho = 0`` this is DeMo's error feedback; the negative control shows ``rho`` changes the run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange

from exchange_inputs import unclipped

DECAY = 0.9
SHAPES = [(64, 96), (32, 32), (48,), (200,)]  # compressed (tiles exactly), compressed, dense vector, dense vector


def _run(rho: float, value_format: str = "fp32", dense_format: str = "fp32", steps: int = 4) -> list[list[torch.Tensor]]:
    """Runs ``steps`` exchanges; asserts the oracle at each; returns every step's updates."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(*s, generator=gen, dtype=torch.float64)) for s in SHAPES]
    codec = CodecConfig(chunk=32, topk=6, value_format=value_format, dense_format=dense_format)  # type: ignore[arg-type]
    exchange = DeMoExchange(torch.optim.SGD(params, lr=0.1), unclipped(codec, decay=DECAY, update="raw", retain_sent=rho))
    before = [torch.zeros_like(p) for p in params]
    updates = []
    for step in range(steps):
        grads = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        exchange.step()
        for i, (p, g, m) in enumerate(zip(params, grads, before)):
            want = DECAY * m + g - (1.0 - rho) * p.grad
            got = exchange.momentum(p)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=f"step {step} tensor {i}: m <- decay m + g - (1 - rho) sent")
            before[i] = got
        updates.append([p.grad.clone() for p in params])
    return updates


@pytest.mark.parametrize("value_format,dense_format", [("fp32", "fp32"), ("sign", "bf16")])
@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_error_feedback_keeps_rho_of_what_was_sent(rho: float, value_format: str, dense_format: str) -> None:
    """1-bit values and bf16 dense tensors too: ``p.grad`` is what was sent after rounding, so what the
    rounding lost stays in the momentum whole and only the sent share is kept at ``rho``."""
    _run(rho, value_format, dense_format)


def test_a_component_sent_every_step_carries_a_momentum_of_decay_times_rho() -> None:
    """A dense tensor is sent whole every step: with a constant gradient its update converges to
    ``g / (1 - decay * rho)`` (DeMo's own, rho 0: ``g`` itself, no momentum)."""
    for rho in (0.0, 0.5):
        param = nn.Parameter(torch.zeros(8, dtype=torch.float64))
        codec = CodecConfig(dense_format="fp32")
        exchange = DeMoExchange(torch.optim.SGD([param], lr=0.1), unclipped(codec, decay=DECAY, update="raw", retain_sent=rho))
        g = torch.linspace(-1, 1, 8, dtype=torch.float64)
        for _ in range(200):
            param.grad = g.clone()
            exchange.step()
        torch.testing.assert_close(param.grad, g / (1 - DECAY * rho), rtol=1e-9, atol=1e-12)


def test_retain_sent_changes_the_run() -> None:
    plain, kept = _run(0.0), _run(0.5)
    assert not torch.allclose(plain[-1][0], kept[-1][0])  # negative control: rho matters


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2, float("nan"), True, "0.5"])
def test_retain_sent_outside_zero_to_one_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match="retain_sent"):
        DeMoConfig(retain_sent=bad)  # type: ignore[arg-type]
