"""Momentum compensation (seed 000 §5.1, ``v + lambda (g_t - g_{t-1})``): ``DeMoConfig(compensation=lambda)``.

Oracle: an exchange with ``compensation=lambda`` fed the raw gradients must do exactly what an
exchange without it does when fed ``g_t + lambda (g_t - g_{t-1})`` (``g_1`` alone at the first step),
computed here in float64; its state carries the last gradients, so a save and load continues bitwise.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from demo_lightning.algorithms import DeMoConfig

from exchange_inputs import Grads, assert_feeds, assert_off_keeps_nothing, assert_resumes_bitwise, make_grads

LAM = 0.3
SETTING = {"compensation": LAM}


def test_compensation_feeds_the_momentum_g_plus_lambda_times_the_gradients_change() -> None:
    previous: Optional[Grads] = None

    def fed(grads: Grads) -> Grads:
        nonlocal previous
        out = grads if previous is None else [(g.double() + LAM * (g.double() - q.double())).float() for g, q in zip(grads, previous)]
        previous = grads
        return out

    assert_feeds(SETTING, fed)


def test_compensation_state_is_saved_and_a_resumed_exchange_continues_bitwise() -> None:
    state = assert_resumes_bitwise(SETTING, "previous_gradients")
    for i, g in state["previous_gradients"].items():
        assert torch.equal(g, make_grads(3)[2][i])  # the last gradient, not the compensated one


def test_no_compensation_keeps_no_gradient_and_clear_state_drops_it() -> None:
    assert_off_keeps_nothing(SETTING, "previous_gradients")


def test_compensation_outside_zero_to_one_is_refused_naming_it() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="compensation"):
            DeMoConfig(compensation=bad)
