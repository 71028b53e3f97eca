"""``Trainer(strategy="desloc")``: local optimizer steps, DES-LOC averaging on independent periods.

A thin Lightning layer over :class:`demo_lightning.algorithms.desloc.DesLocAverager` (paper:
arXiv 2505.22549). No gradient is ever all-reduced: each worker steps its own optimizer on its
own gradients; after each step, parameters (and floating-point buffers) are averaged every
``param_sync_every`` steps and each optimizer-state key on its own period. Between syncs the
replicas differ, so checkpoints hold every rank's parameters and optimizer state, and resume
restores each rank's own copy and the schedule position.

Gradient clipping before the local step, as the paper assumes: ``Trainer(gradient_clip_val=...)``.
"""

from __future__ import annotations

from demo_lightning.strategies.base import CommunicationStrategy
from demo_lightning.strategies.options import DesLocOptions

__all__ = ["DesLocStrategy"]


class DesLocStrategy(DesLocOptions, CommunicationStrategy):
    __doc__ = DesLocOptions.__doc__
