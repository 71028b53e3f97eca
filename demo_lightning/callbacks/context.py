"""What the callbacks read from a running Trainer: our strategy's exchanges, names, step position."""

from __future__ import annotations

import math
from typing import Optional

from lightning.pytorch import LightningModule, Trainer
from torch import Tensor

from demo_lightning.algorithms import DeMoExchange
from demo_lightning.comm import Communicator

__all__ = ["applied_steps", "communicator_of", "exchanges_of", "named_trainable", "total_steps"]


def exchanges_of(trainer: Trainer) -> list[DeMoExchange]:
    """The DeMo exchanges of the Trainer's strategy (empty for other strategies)."""
    return list(getattr(trainer.strategy, "exchanges", []))


def communicator_of(trainer: Trainer) -> Optional[Communicator]:
    """The strategy's :class:`Communicator` (``None`` for strategies that are not ours)."""
    return getattr(trainer.strategy, "communicator", None) if hasattr(trainer.strategy, "ledger") else None


def named_trainable(pl_module: LightningModule) -> dict[Tensor, str]:
    """``{parameter: qualified name}`` for every trainable parameter (shared tensors keep their first name)."""
    out: dict[Tensor, str] = {}
    for name, p in pl_module.named_parameters():
        if p.requires_grad and p not in out:
            out[p] = name
    return out


def applied_steps(trainer: Trainer) -> int:
    """Optimizer steps applied so far: ``global_step`` less the steps the non-finite guard skipped,
    so a skipped step never moves a schedule."""
    return int(trainer.global_step) - int(getattr(trainer.strategy, "skipped_steps", 0))


def total_steps(trainer: Trainer) -> Optional[int]:
    """The run's optimizer steps when Lightning can tell (``max_steps`` or epochs x batches)."""
    try:
        total = trainer.estimated_stepping_batches
    except Exception:  # noqa: BLE001 - before the data is known Lightning raises
        return None
    return None if total is None or math.isinf(total) else int(total)
