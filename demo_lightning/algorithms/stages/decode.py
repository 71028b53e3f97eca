"""Decode stage: every rank's contributions summed into the mean's spectrum, then one inverse transform.

Per family, the mean's coefficients live in a flat buffer laid out like the family's storage
(:mod:`~demo_lightning.algorithms.stages.plan`). It is zeroed, then every contribution is added at
its positions with ``index_add_``, in the order the transport yields them (rank order 0..W-1):
within one contribution the offsets are distinct, so the sum is deterministic and every replica
computes bitwise the same spectrum. One inverse transform per tensor, scaled by ``1 / W`` inside
its GEMM (no pass of its own), turns it into the mean.

Exactness: with identical contributions from ``W`` = 1, 2 or 4 workers the mean equals one
worker's bitwise: the rank-order sums are exact multiples (``(a + a) = 2a``; ``((2a + a) + a) = 4a``
for every float), scaling by a power of two is exact, and the inverse of ``W a`` is ``W`` times
the inverse of ``a``. For other ``W`` the rounded partial sums leave the result an ulp off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from demo_lightning.algorithms.stages.encode import Selected, Workspace
from demo_lightning.algorithms.stages.plan import ExchangePlan, TensorPlan
from demo_lightning.algorithms.stages.transport import Contribution
from demo_lightning.codec.transform import inverse_spectrum

__all__ = ["accumulate", "inverse", "zeroed_means"]


def zeroed_means(plan: ExchangePlan, workspace: Workspace) -> dict[object, Tensor]:
    """Every family's mean buffer (the workspace's family buffer), zeroed."""
    return {key: workspace.family(family).zero_() for key, family in plan.families.items()}


def accumulate(means: dict[object, Tensor], contributions: Iterable[Contribution], selected: dict[object, Selected]) -> None:
    """Add contributions into ``means`` at their positions (``None``: this worker's own positions)."""
    for c in contributions:
        family = c.run.family
        rows = c.run.rows
        offsets = selected[family.key].offsets[rows] if c.positions is None else family.offsets(c.positions, rows)
        means[family.key].index_add_(0, offsets.reshape(-1), c.values.reshape(-1))


def inverse(
    plan: ExchangePlan, means: dict[object, Tensor], workspace: Workspace, scale: float,
    write: Callable[[TensorPlan, Tensor], None],
) -> None:
    """``write(item, scale * T^-1(mean spectrum)[:R, :C])`` for every compressed tensor, in plan order
    (``T`` the plan's transform).

    The tensor handed to ``write`` is a view of a workspace buffer, valid only during the call."""
    transform = plan.config.transform
    for key, family in plan.families.items():
        flat = means[key]
        for item in family.members:
            layout = item.layout
            assert layout is not None
            out = inverse_spectrum(flat[item.span].view(item.matrix_shape), layout, workspace.scratch(item, second=True),
                                   workspace.scratch(item), scale, transform)
            write(item, out[: layout.rows, : layout.cols])
