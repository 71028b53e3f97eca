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

from datetime import timedelta
from typing import Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision

from demo_lightning.algorithms.config import CodecConfig
from demo_lightning.codec import Selection, ValueFormat
from demo_lightning.algorithms.desloc import DesLocConfig
from demo_lightning.algorithms.guard import NonFinitePolicy
from demo_lightning.strategies.base import CommunicationStrategy, StartMethod

__all__ = ["DesLocStrategy"]


class DesLocStrategy(CommunicationStrategy):
    """DES-LOC: every worker runs its own optimizer; parameters and each optimizer state are
    averaged across workers on their own periods (Local Adam when all periods are equal).

    Args:
        param_sync_every: K_x, optimizer steps between parameter (and buffer) averages.
        state_sync_every: period per optimizer-state key, e.g. ``{"exp_avg": 48, "exp_avg_sq": 96}``;
            ``None`` applies the paper's ratios (first moments 3 K_x, second moments 6 K_x) to the
            keys the optimizer keeps; ``{}`` never averages states.
        sync_buffers: average floating-point module buffers (BatchNorm statistics) with the parameters.
        compress_params: send each parameter sync's change since the last sync through the DeMo
            codec (with error feedback) instead of the full parameters.
        chunk: codec tile side (with ``compress_params``).
        topk: codec coefficients per tile (with ``compress_params``; default 64).
        keep_ratio: codec fraction per tile (with ``compress_params``; exclusive with ``topk``).
        selection: ``"topk"`` (largest changes, positions sent) or ``"lowpass"`` (the lowest
            frequencies, no positions); with ``keep_ratio=1.0`` and ``value_format="sign"``,
            ``"lowpass"`` sends every coefficient at about one bit each (with ``compress_params``).
        value_format: codec value format (with ``compress_params``).
        bucket_cap_mb: largest payload per collective in megabytes.
        final_sync: when training ends, average parameters and buffers once more on every rank, so
            the model saved, validated, tested or exported is the averaged one (each rank's own
            replica stays in checkpoints' per-rank state, so a resume continues bitwise).
        process_group_backend: ``"gloo"`` or ``"nccl"``; chosen from the device when ``None``.
        timeout: collective timeout in seconds (or a ``timedelta``).
        start_method: how Lightning starts local processes.
        nonfinite: what every rank does when the loss or a gradient is NaN/inf on any rank (agreed by a
            1-byte-per-rank all-gather every step): ``"skip"`` the step on every rank (nothing of
            ours changes; counted in ``guard/skipped_steps``) or ``"raise"`` ``FloatingPointError`` on
            every rank. Any other value raises ``ValueError``.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
    """

    strategy_name = "desloc"
    strategy_description = "DES-LOC: local steps, parameters and optimizer states averaged on their own periods"

    def __init__(
        self,
        param_sync_every: int = 16,
        state_sync_every: Optional[dict[str, int]] = None,
        sync_buffers: bool = True,
        compress_params: bool = False,
        chunk: int = 64,
        topk: Optional[int] = None,
        keep_ratio: Optional[float] = None,
        selection: Selection = "topk",
        value_format: ValueFormat = "sign",
        bucket_cap_mb: float = 25.0,
        final_sync: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = 1800.0,
        start_method: StartMethod = "popen",
        nonfinite: NonFinitePolicy = "skip",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        if param_sync_every is None:  # DesLocConfig allows None (DeMo's optional re-sync); DES-LOC needs a period
            raise ValueError(
                "param_sync_every must be an integer period >= 1 for strategy='desloc' (optimizer steps between parameter "
                "averages), got None"
            )
        # the configs validate every setting, naming it
        codec = CodecConfig(
            chunk=chunk, topk=topk, keep_ratio=keep_ratio, selection=selection, value_format=value_format,
            bucket_cap_mb=bucket_cap_mb,
        )
        desloc = DesLocConfig(
            param_sync_every=param_sync_every, state_sync_every=state_sync_every, sync_buffers=sync_buffers,
            compress_params=compress_params, codec=codec, bucket_cap_mb=bucket_cap_mb, final_sync=final_sync,
        )
        super().__init__(
            None, desloc, process_group_backend, timeout, start_method,
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, nonfinite,
        )
