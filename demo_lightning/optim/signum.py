"""Signum: the sign of a momentum, the uncompressed counterpart of DeMo's sign update.

Source: Bernstein, Wang, Azizzadenesheli and Anandkumar, "signSGD: Compressed Optimisation for
Non-Convex Problems" (arXiv 1802.04434), section 3, "Signum". Per parameter tensor ``p`` with
gradient ``g``, at every step::

    m <- beta * m + (1 - beta) * g            # optimizer.state[p]["momentum_buffer"], zeros at first
    p <- p * (1 - lr * weight_decay)          # decoupled weight decay, as AdamW (before the update)
    p <- p - lr * sign(m)

``beta = 0`` is signSGD, ``p -= lr * sign(g)``. A coordinate whose momentum is exactly zero does
not move (``sign(0) = 0``), as under DeMo's sign update.

Why it is here: under ``Trainer(strategy="ddp")`` every worker holds the exact mean gradient, so
DDP + Signum is DeMo's update rule (a sign step of a momentum, SGD's learning rate) without the
codec. It separates what the sign rule costs from what DeMo's compression costs (the benchmarks'
``ddp-signum`` rows, issue 18). Under ``Trainer(strategy="desloc")`` its ``momentum_buffer`` is a
first moment and is averaged on the period DES-LOC gives that key (``3 K_x`` by default). Under
``Trainer(strategy="demo")`` pair it only with ``update="raw"``: the default sign update already
takes a sign, and a second momentum on top of it is rarely what anyone means.

Precision: the momentum is kept in fp32 for fp16/bf16 parameters (in the parameter's dtype
otherwise); the sign is exact in any dtype, so the update is ``lr`` times -1, 0 or 1 in the
parameter's dtype.

Failure behaviour:

* Invalid hyperparameters raise ``ValueError`` naming the argument, the value and the valid range,
  at construction, in ``add_param_group`` and at :meth:`Signum.step` for values a scheduler wrote
  into ``param_groups`` later. Sparse gradients raise ``RuntimeError``.
* Parameters whose ``grad`` is ``None`` are skipped: no weight decay, their momentum is untouched.
* A non-finite gradient makes the momentum non-finite; ``sign(nan)`` is ``nan``, so the parameter
  becomes NaN too (as with ``torch.optim.SGD``): clip or skip such steps upstream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT
from typing_extensions import override

from demo_lightning.optim._precision import load_state_dict_keeping_fp32, momentum_dtype
from demo_lightning.validation import check_number

__all__ = ["Signum", "signum_update"]

STATE_KEY = "momentum_buffer"

# (low, high, low_open, high_open) of each option
_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "lr": (0.0, math.inf, True, True),
    "beta": (0.0, 1.0, False, True),
    "weight_decay": (0.0, math.inf, False, True),
}


def _check_group(group: Mapping[str, Any]) -> None:
    for name, (low, high, low_open, high_open) in _RANGES.items():
        check_number(name, group[name], low, high, low_open=low_open, high_open=high_open)


@torch.no_grad()
def signum_update(param: Tensor, grad: Tensor, momentum: Tensor, *, lr: float, beta: float, weight_decay: float) -> None:
    """One Signum update of one tensor, in place on ``param`` and ``momentum`` (the module docstring's rule)."""
    momentum.mul_(beta).add_(grad.to(momentum.dtype), alpha=1.0 - beta)
    if weight_decay != 0:
        param.mul_(1.0 - lr * weight_decay)
    param.add_(torch.sign(momentum).to(param.dtype), alpha=-lr)


class Signum(Optimizer):
    """Sign of the momentum: ``m = beta m + (1 - beta) g``, ``p -= lr * sign(m)`` (arXiv 1802.04434).

    Args:
        params: parameters or parameter groups (groups may set any of the options below).
        lr: learning rate, > 0 (required): the length of every coordinate's step.
        beta: momentum decay, in [0, 1); 0 is signSGD.
        weight_decay: decoupled weight decay, >= 0 (``p *= 1 - lr * weight_decay`` before the update).
    """

    def __init__(self, params: ParamsT, lr: float, beta: float = 0.9, weight_decay: float = 0.0) -> None:
        defaults = {"lr": lr, "beta": beta, "weight_decay": weight_decay}
        _check_group(defaults)
        super().__init__(params, defaults)

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its options are validated after the defaults are filled in."""
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s, but fp16/bf16 parameters keep their momentum in fp32."""
        load_state_dict_keeping_fp32(self, state_dict, STATE_KEY)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Union[float, Tensor]]] = None) -> Optional[Union[float, Tensor]]:  # type: ignore[override]
        """Update every parameter that has a gradient; returns the closure's loss (``None`` without one)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_group(group)  # schedules may have rewritten it
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Signum does not support sparse gradients")
                dtype = momentum_dtype(p.dtype)
                state = self.state[p]
                buf = state.get(STATE_KEY)
                if buf is None:
                    buf = state[STATE_KEY] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                elif buf.dtype != dtype or buf.device != p.device:
                    buf = state[STATE_KEY] = buf.to(device=p.device, dtype=dtype)
                signum_update(p, p.grad, buf, lr=group["lr"], beta=group["beta"], weight_decay=group["weight_decay"])
        return loss
