"""A worker's own gradient clipped before its communication step: DeMo's momentum
(``DeMoConfig.clip_grad_norm``) and DES-LOC's local step (``DesLocConfig.clip_grad_norm``).

Pure tensor code, no communication: each worker clips what it computed, as Lightning's
``gradient_clip_val`` does, and the replicas' agreement comes from the exchange or the averaging
that follows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["clip_gradients"]


def clip_gradients(params: Iterable[Tensor], max_norm: float) -> None:
    """Scale the gradients ``params`` hold down to total L2 norm ``max_norm`` when larger:
    ``torch.nn.utils.clip_grad_norm_`` over them in their order, the call and order of Lightning's
    ``gradient_clip_val`` (the optimizer's ``param_groups``), so the same clip gives the same bits.

    Parameters without a gradient are skipped. A non-finite norm raises nothing and makes every
    gradient non-finite; the non-finite guard, which runs before, skips or raises on such steps.
    """
    held = [p for p in params if p.grad is not None]
    if held:
        torch.nn.utils.clip_grad_norm_(held, max_norm)
