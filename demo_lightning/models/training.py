"""The optimizer and learning-rate schedule the bundled models share."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from demo_lightning.validation import check_number

__all__ = ["OPTIMIZERS", "OptimizerName", "optimizer_with_schedule"]

OptimizerName = Literal["sgd", "adamw", "decoupled", "signum"]
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw", "decoupled", "signum")


def optimizer_with_schedule(
    parameters: Iterable[Tensor],
    optimizer: str,
    lr: float,
    weight_decay: float,
    momentum: Optional[float],
    warmup_steps: int,
    max_steps: int,
    min_lr_ratio: float = 0.1,
) -> dict[str, Any]:
    """``configure_optimizers``'s return value: the optimizer with a linear warm-up over
    ``warmup_steps`` then a cosine decay to ``min_lr_ratio`` times ``lr`` (10 % by default) at
    ``max_steps``, and that rate after it (stepped per optimizer step).

    ``optimizer``: ``"sgd"`` (``momentum``, 0 when ``None``: the pairing for DeMo's sign update),
    ``"adamw"``, ``"decoupled"`` (:class:`demo_lightning.optim.DecoupledMomentum`, beta 0.9, lambda 0.1,
    which a :class:`~demo_lightning.callbacks.LayerPolicy` can set per layer), or ``"signum"``
    (:class:`demo_lightning.optim.Signum`, its beta ``momentum``, 0.9 when ``None``: the sign rule on
    the exact gradient, DeMo's reference under DDP). ``adamw`` takes ``momentum`` as its first beta (0.9 when
    ``None``; 0 with ``DeMoStrategy(update="raw")`` makes it RMSprop on the decoded mean, whose residual is
    already a momentum); ``decoupled`` ignores it.
    """
    check_number("min_lr_ratio", min_lr_ratio, 0.0, 1.0, hint="the final rate over the peak: 0.1 decays to 10 %")
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            parameters, lr=lr, weight_decay=weight_decay, momentum=0.0 if momentum is None else momentum
        )
    elif optimizer == "adamw":
        beta1 = 0.9 if momentum is None else momentum
        opt = torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, betas=(beta1, 0.999))
    elif optimizer == "decoupled":
        from demo_lightning.optim import DecoupledMomentum

        opt = DecoupledMomentum(parameters, lr=lr, weight_decay=weight_decay)
    elif optimizer == "signum":
        from demo_lightning.optim import Signum

        opt = Signum(parameters, lr=lr, beta=0.9 if momentum is None else momentum, weight_decay=weight_decay)
    else:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
