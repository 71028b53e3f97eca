"""``Trainer(strategy="demo")``: DeMo's compressed momentum exchange in place of DDP's all-reduce.

A thin Lightning layer over :class:`demo_lightning.algorithms.DeMoExchange` (see
:mod:`demo_lightning.strategies.base` for what all our strategies share):

* at fit start, rank 0's parameters and buffers are broadcast (replicas start identical);
* once per optimizer step (after the closure, i.e. after the last micro-batch of gradient
  accumulation) each worker's own gradient is clipped: by Lightning (``gradient_clip_val``) when
  the Trainer sets it, else by the exchange at norm 1.0 (``clip_grad_norm="auto"``, issue 18); then
  every optimizer's exchange runs and writes the shared update into ``p.grad``;
  then Lightning's ``on_before_optimizer_step`` hooks and the optimizer's own step follow (the
  shared update itself is never clipped: under ``update="sign"`` every parameter moves by ``lr``);
* optionally (off by default) DES-LOC averaging of parameters and of optimizer-state keys (for
  example the DeMo residual ``demo_momentum``) on their own periods, after the step;
* checkpoints carry every rank's own momentum; each rank gets its own back on resume;
* traffic of each step is logged as ``comm/bytes_sent_per_step``, ``comm/bytes_received_per_step``
  and ``comm/ratio_vs_ddp`` (DDP's bytes / ours), and kept in :attr:`DeMoStrategy.ledger`.

Refused with ``ValueError``: fp16 mixed precision with a GradScaler (use ``"bf16-mixed"`` or
``"32-true"``), LBFGS and sharded optimizers.
"""

from __future__ import annotations

from demo_lightning.strategies.base import CommunicationStrategy
from demo_lightning.strategies.options import DeMoOptions

__all__ = ["DeMoStrategy"]


class DeMoStrategy(DeMoOptions, CommunicationStrategy):
    __doc__ = DeMoOptions.__doc__
