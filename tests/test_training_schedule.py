"""The bundled models' learning-rate schedule: linear warm-up, cosine to ``min_lr_ratio`` of the peak, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from demo_lightning.models.gpt import GPTLightningModule
from demo_lightning.models.training import optimizer_with_schedule


def _rates(min_lr_ratio: float | None, warmup: int = 4, max_steps: int = 24, steps: int = 30) -> list[float]:
    p = nn.Parameter(torch.zeros(2))
    kwargs = {} if min_lr_ratio is None else {"min_lr_ratio": min_lr_ratio}
    out = optimizer_with_schedule([p], "sgd", lr=0.5, weight_decay=0.0, momentum=None, warmup_steps=warmup, max_steps=max_steps, **kwargs)
    opt, scheduler = out["optimizer"], out["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("ratio", [None, 0.0, 0.3])
def test_warmup_then_a_cosine_to_the_final_ratio_then_flat(ratio: float | None) -> None:
    final = 0.1 if ratio is None else ratio  # None: the default, 10 %
    rates = _rates(ratio)
    assert rates[:4] == pytest.approx([0.5 * (k + 1) / 4 for k in range(4)], rel=1e-15)
    for step in range(4, 30):
        progress = min(1.0, (step - 4) / 20)
        want = 0.5 * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress)))
        assert rates[step] == pytest.approx(want, rel=1e-12, abs=1e-15), step
    assert rates[24] == pytest.approx(0.5 * final, abs=1e-15) and rates[29] == rates[24]  # flat after max_steps


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_a_ratio_outside_zero_one_is_rejected_naming_it(bad: float) -> None:
    with pytest.raises(ValueError, match=r"min_lr_ratio must"):
        _rates(bad)
    with pytest.raises(ValueError, match=r"min_lr_ratio must"):
        GPTLightningModule(d_model=16, n_layer=1, n_head=2, min_lr_ratio=bad).configure_optimizers()


def test_a_model_saved_before_the_ratio_existed_keeps_the_ten_percent() -> None:
    model = GPTLightningModule(d_model=16, n_layer=1, n_head=2, lr=0.2, warmup_steps=1, max_steps=3)
    del model.hparams["min_lr_ratio"]  # the hyperparameters such a checkpoint restores
    out = model.configure_optimizers()
    opt, scheduler = out["optimizer"], out["lr_scheduler"]["scheduler"]
    for _ in range(3):
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02, rel=1e-12)


def test_adamw_takes_momentum_as_its_first_beta() -> None:
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    default = optimizer_with_schedule([p], "adamw", lr=0.1, weight_decay=0.0, momentum=None, warmup_steps=1, max_steps=10)
    assert default["optimizer"].param_groups[0]["betas"] == (0.9, 0.999)
    opt = optimizer_with_schedule([p], "adamw", lr=0.1, weight_decay=0.0, momentum=0.0, warmup_steps=1, max_steps=10)["optimizer"]
    g1, g2 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), torch.tensor([3.0, 1.0, -0.5], dtype=torch.float64)
    p.grad = g1.clone()
    opt.step()  # beta1 0: no first moment, the step is g over the root of Adam's bias-corrected second moment
    assert torch.allclose(p.detach(), -0.1 * g1 / (g1.abs() + 1e-8), rtol=1e-12, atol=0)
    before = p.detach().clone()
    p.grad = g2.clone()
    opt.step()
    v_hat = (0.999 * 0.001 * g1**2 + 0.001 * g2**2) / (1 - 0.999**2)
    assert torch.allclose(p.detach() - before, -0.1 * g2 / (v_hat.sqrt() + 1e-8), rtol=1e-10, atol=0)
