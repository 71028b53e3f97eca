"""Each worker's gradient clipped before its momentum (issue 18): ``DeMoConfig.clip_grad_norm``, 1.0
by default; ``DeMoStrategy(clip_grad_norm="auto")`` leaves the clipping to the Trainer when its
``gradient_clip_val`` is set.

Oracles: the exchange with a clip does what one without it does fed the gradients scaled by
``min(1, max_norm / (||g|| + 1e-6))`` over all of them (computed here in float64), and a clip the
gradients stay under changes no bit; under Lightning the default is bit for bit the fit with
``gradient_clip_val=1.0`` (Lightning's own clipping at the same point), and a Trainer that sets
another value runs its clipping alone.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from demo_lightning import DeMoStrategy
from demo_lightning.algorithms import DeMoConfig

from exchange_inputs import Grads, assert_feeds, exchange_with, make_grads, make_params, step_with
from test_strategy import _Classifier, _loader, _trainer


def _clipped(max_norm: float) -> Any:
    def fed(grads: Grads) -> Grads:
        total = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        scale = min(1.0, max_norm / (float(total) + 1e-6))
        return [(g.double() * scale).float() for g in grads]

    return fed


def test_the_momentum_takes_the_gradient_clipped_to_the_total_norm() -> None:
    grads = make_grads(1)[0]
    assert float(torch.sqrt(sum(g.pow(2).sum() for g in grads))) > 10  # well above the clip: it acts
    assert_feeds({"clip_grad_norm": 2.0}, _clipped(2.0))


def test_a_gradient_under_the_clip_is_not_touched() -> None:
    grads = make_grads(3)
    a_params, b_params = make_params(), make_params()
    high, off = exchange_with(a_params, clip_grad_norm=1e6), exchange_with(b_params, clip_grad_norm=None)
    for g in grads:
        for x, y in zip(step_with(high, a_params, g), step_with(off, b_params, g)):
            assert torch.equal(x, y)


def test_the_default_clips_at_one_and_bad_values_name_the_argument() -> None:
    assert DeMoConfig().clip_grad_norm == 1.0
    assert DeMoStrategy().demo_config.clip_grad_norm == 1.0
    assert DeMoStrategy(clip_grad_norm=None).demo_config.clip_grad_norm is None
    assert DeMoStrategy(clip_grad_norm=0.5).demo_config.clip_grad_norm == 0.5
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="clip_grad_norm"):
            DeMoConfig(clip_grad_norm=bad)
        with pytest.raises(ValueError, match="clip_grad_norm"):
            DeMoStrategy(clip_grad_norm=bad)
    with pytest.raises(ValueError, match="clip_grad_norm.*'auto'"):
        DeMoStrategy(clip_grad_norm="on")  # type: ignore[arg-type]


def _fit(**kwargs: Any) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = _Classifier()
    trainer: pl.Trainer = _trainer(**kwargs)
    trainer.fit(model, _loader())
    return [p.detach().clone() for p in model.parameters()], trainer.strategy.exchanges[0].config.clip_grad_norm


@pytest.mark.usefixtures("isolated_process_group")
def test_under_lightning_the_default_is_the_trainers_clip_at_one_and_a_trainer_clip_runs_alone() -> None:
    default, default_clip = _fit(strategy=DeMoStrategy(dense_below=100))
    lightning_one, lightning_clip = _fit(strategy=DeMoStrategy(dense_below=100), gradient_clip_val=1.0)
    assert (default_clip, lightning_clip) == (1.0, None)  # the Trainer's clipping runs alone
    assert all(torch.equal(a, b) for a, b in zip(default, lightning_one))
    # the Trainer's value wins: at 100 nothing is clipped, as with the exchange's clip off
    lightning_hundred, hundred_clip = _fit(strategy=DeMoStrategy(dense_below=100), gradient_clip_val=100.0)
    off, _ = _fit(strategy=DeMoStrategy(dense_below=100, clip_grad_norm=None))
    assert hundred_clip is None
    assert all(torch.equal(a, b) for a, b in zip(lightning_hundred, off))
    assert not all(torch.equal(a, b) for a, b in zip(default, off)), "the clip at 1.0 changed nothing: this model's gradients stay under it"
    # an explicit value is kept beside the Trainer's (both clip)
    _, explicit = _fit(strategy=DeMoStrategy(dense_below=100, clip_grad_norm=0.5), gradient_clip_val=1.0)
    assert explicit == 0.5
