"""``Trainer(strategy="demo")``: DeMo's compressed momentum exchange in place of DDP's all-reduce.

A thin Lightning layer over :class:`demo_lightning.algorithms.DeMoExchange` (see
:mod:`demo_lightning.strategies.base` for what all our strategies share):

* at fit start, rank 0's parameters and buffers are broadcast (replicas start identical);
* once per optimizer step (after the closure, i.e. after the last micro-batch of gradient
  accumulation) Lightning's gradient clipping (``gradient_clip_val``) is applied to each worker's
  own gradient, then every optimizer's exchange runs and writes the shared update into ``p.grad``;
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

from datetime import timedelta
from typing import Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision

from demo_lightning.algorithms import DeMoConfig, ExchangeStats
from demo_lightning.algorithms.demo import Update
from demo_lightning.algorithms.config import ExchangeSelection
from demo_lightning.codec import ValueFormat
from demo_lightning.algorithms.desloc import DesLocConfig
from demo_lightning.algorithms.guard import NonFinitePolicy
from demo_lightning.strategies.base import CommunicationStrategy, Hierarchy, StartMethod

__all__ = ["DeMoStrategy"]


class DeMoStrategy(CommunicationStrategy):
    """DeMo (arXiv 2411.19870): each worker keeps its own momentum and shares only its strongest
    DCT components, so each step moves a small fraction of DDP's bytes.

    Args:
        chunk: DCT tile side (2-D views in ``chunk`` x ``chunk`` tiles, 1-D in ``chunk``-long chunks).
        topk: coefficients kept per tile; default 64 if neither ``topk`` nor ``keep_ratio`` is given.
        keep_ratio: fraction of each tile kept, in (0, 1]; give this or ``topk``, not both.
        decay: momentum decay in [0, 1).
        selection: ``"topk"`` (each worker's largest magnitudes, positions sent), ``"lowpass"`` (fixed
            lowest frequencies, no indices) or ``"shared"`` (ScaleCom's cyclic local top-k: one worker
            per step, in turn, picks the positions and broadcasts them, the values are all-reduced, so
            the bytes per worker do not grow with the number of workers; needs value_format "fp32",
            "bf16" or "fp16").
        value_format: wire format of the kept values: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"int8"``, ``"sign"``.
        update: ``"sign"`` (the paper's signum step; pair with ``torch.optim.SGD``) or ``"raw"``
            (the shared direction as the gradient, for any optimizer such as AdamW).
        dense_below: tensors with fewer elements are all-reduced densely in fp32 (0: compress all).
        bucket_cap_mb: largest payload per collective in megabytes.
        param_sync_every: DES-LOC parameter re-sync period in optimizer steps (``None``: off).
        state_sync_every: DES-LOC periods per optimizer-state key, e.g. ``{"demo_momentum": 64}``
            averages the DeMo residuals every 64 steps (``None``: off).
        process_group_backend: ``"gloo"`` or ``"nccl"``; chosen from the device when ``None``.
        timeout: collective timeout in seconds (or a ``timedelta``); a peer that stops answering
            makes the others raise after this long.
        start_method: how Lightning starts local processes: ``"popen"``, ``"spawn"``, ``"fork"``, ``"forkserver"``.
        nonfinite: what every rank does when the loss or a gradient is NaN/inf on any rank (agreed by a
            1-byte-per-rank all-gather every step): ``"skip"`` the step on every rank (nothing of
            ours changes; counted in ``guard/skipped_steps``) or ``"raise"`` ``FloatingPointError`` on
            every rank. Any other value raises ``ValueError``.
        hierarchy: ``"flat"``: every rank is a DeMo worker (an all-gather over all ranks);
            ``"node"``: the ranks of a node average their gradients densely over the fast intra-node
            link, and DeMo runs between nodes only, each local rank exchanging its share of the
            tensors with the same local rank of the other nodes, so the inter-node link carries each
            node's payload once (see :class:`~demo_lightning.algorithms.DeMoExchange`). The process
            groups come from the cluster environment (torchrun, SLURM); one node, or one process
            per node, warns and runs flat; nodes of different sizes raise ``ValueError``.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer (torchrun, SLURM, ... are detected).
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
    """

    strategy_name = "demo"
    strategy_description = "DeMo compressed momentum exchange instead of DDP's all-reduce"

    def __init__(
        self,
        chunk: int = 64,
        topk: Optional[int] = None,
        keep_ratio: Optional[float] = None,
        decay: float = 0.99,
        selection: ExchangeSelection = "topk",
        value_format: ValueFormat = "sign",
        update: Update = "sign",
        dense_below: int = 4096,
        bucket_cap_mb: float = 25.0,
        param_sync_every: Optional[int] = None,
        state_sync_every: Optional[dict[str, int]] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = 1800.0,
        start_method: StartMethod = "popen",
        nonfinite: NonFinitePolicy = "skip",
        hierarchy: Hierarchy = "flat",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        demo = DeMoConfig.of(
            chunk=chunk, topk=topk, keep_ratio=keep_ratio, decay=decay, selection=selection,
            value_format=value_format, update=update, dense_below=dense_below, bucket_cap_mb=bucket_cap_mb,
        )
        desloc = DesLocConfig(
            param_sync_every=param_sync_every,
            state_sync_every={} if state_sync_every is None else state_sync_every,  # None: no state averaging
            sync_buffers=True,
            bucket_cap_mb=bucket_cap_mb,
        )
        super().__init__(
            demo, desloc, process_group_backend, timeout, start_method,
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, nonfinite,
            hierarchy=hierarchy,
        )

    @property
    def last_stats(self) -> Optional[ExchangeStats]:
        """Statistics of the most recent exchange (``None`` before the first step)."""
        stats = [e.stats for e in self._exchanges.values() if e.stats.steps > 0]
        return stats[-1] if stats else None
