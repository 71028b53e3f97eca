"""The strategies' typed options, declared once for both front ends (Trainer and Fabric).

The plumbing arguments (accelerator, precision plugin, ...) are the Trainer's classes or Fabric's,
whichever front end sets them; the Trainer's come first, as LightningCLI reads them.

:class:`DeMoOptions` and :class:`DesLocOptions` hold the ``__init__`` (every argument typed and
validated, so LightningCLI shows and checks them) and the registration under the names ``"demo"``
and ``"desloc"``; ``DeMoStrategy`` / ``DeMoFabricStrategy`` (and the DES-LOC pair) combine them with
their front end's base, which implements ``_init_communication``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union, get_args

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator as FabricAccelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision

from demo_lightning.algorithms import DeMoConfig
from demo_lightning.algorithms.config import CodecConfig, DenseFormat, ExchangeSelection, PositionFormatSetting
from demo_lightning.algorithms.demo import DEFAULT_CLIP_GRAD_NORM, Update
from demo_lightning.algorithms.desloc import DesLocConfig
from demo_lightning.algorithms.guard import NonFinitePolicy
from demo_lightning.codec import Selection, ValueFormat
from demo_lightning.codec.bases import Transform
from demo_lightning.strategies.runtime import HIERARCHIES, Hierarchy
from demo_lightning.validation import check_choice, is_number

__all__ = ["DeMoOptions", "DesLocOptions", "Hierarchy", "HIERARCHIES", "StartMethod", "as_timedelta", "check_backend", "check_start_method"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


def as_timedelta(timeout: Union[float, int, timedelta], name: str = "timeout") -> timedelta:
    """Seconds or a ``timedelta`` -> ``timedelta``; rejects non-positive values naming ``name``."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif is_number(timeout):
        seconds = float(timeout)
    else:
        raise ValueError(f"{name} must be seconds (a number) or a datetime.timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"{name} must be > 0 seconds, got {seconds}; collectives that exceed it raise on every rank")
    return timedelta(seconds=seconds)


def check_start_method(start_method: Any) -> None:
    check_choice(
        "start_method", start_method, get_args(StartMethod),
        "'popen', the default, re-runs the script for each local process; 'spawn' starts fresh interpreters, for where "
        "re-running the command line is wrong, e.g. pytest",
    )


def check_backend(backend: Any) -> None:
    """Reject a process-group backend torch does not know at construction (torch would fail at fit start)."""
    if backend is None:
        return
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    # torch also accepts per-device forms such as "cpu:gloo,cuda:nccl"
    parts = [p.split(":")[-1].strip().lower() for p in backend.split(",")] if isinstance(backend, str) else []
    if not parts or any(p not in known for p in parts):
        raise ValueError(
            f"process_group_backend must be one of {known} (or None to choose from the device: 'gloo' on CPU, 'nccl' on "
            f"GPU), got {backend!r}"
        )


class _Options:
    """The options' side of a strategy: its registry name; the front end's base (listed after the
    options class, see :mod:`demo_lightning.strategies.front`) builds the rest from the configs."""

    strategy_name: str = ""
    strategy_description: str = ""

    if TYPE_CHECKING:

        def _init_communication(self, demo: Optional[DeMoConfig], desloc: Optional[DesLocConfig], **settings: Any) -> None: ...


class DeMoOptions(_Options):
    """DeMo (arXiv 2411.19870): each worker keeps its own momentum and shares only its strongest
    DCT components, so each step moves a small fraction of DDP's bytes.

    Args:
        chunk: DCT tile side (2-D views in ``chunk`` x ``chunk`` tiles, 1-D in ``chunk``-long chunks).
        topk: coefficients kept per tile. If neither ``topk`` nor ``keep_ratio`` is given, set from the
            number of DeMo workers ``W`` (the ranks; the nodes under ``hierarchy="node"``) when the
            exchange is built: ``clamp(128 // W, 8, 64)`` for an all-gathered exchange (64 at 2 workers,
            32 at 4, 16 at 8: the bytes per worker do not grow with ``W`` up to 16), 64 for an
            all-reduced one (``"shared"``, low-pass float values).
        keep_ratio: fraction of each tile kept, in (0, 1]; give this or ``topk``, not both.
        decay: momentum decay in [0, 1).
        selection: ``"topk"`` (each worker's largest magnitudes, positions sent), ``"lowpass"`` (fixed
            lowest frequencies, no indices) or ``"shared"`` (ScaleCom's cyclic local top-k: one worker
            per step, in turn, picks the positions and broadcasts them, the values are all-reduced, so
            the bytes per worker do not grow with the number of workers; needs value_format "fp32",
            "bf16" or "fp16").
        transform: the orthonormal transform of every tile, ``K = B_r X B_c^T``, before the same
            selection and error feedback: ``"dct"`` (DCT-II, the paper's), ``"haar"`` (Haar wavelets,
            rows coarse to fine; for a tile side ``n = 2^L``: ``h_0 = 1/sqrt(n)``,
            ``h_{2^p+q}(t) = sqrt(2^p/n)`` on the first half of the ``q``-th of ``2^p`` equal segments,
            minus that on its second half, 0 elsewhere; other sides use the unbalanced Haar basis of the
            same halving) or ``"identity"`` (no transform: chunked top-k of the momentum itself, as
            SparseLoCo; no GEMM runs). ``"lowpass"`` keeps the coarsest Haar scales first, and is refused
            with ``"identity"`` unless ``keep_ratio=1.0``.
        value_format: wire format of the kept values: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``,
            ``"fp8_e5m2"`` (a byte a value, per-tile scale), ``"int8"``, ``"mixed"`` (the strongest
            ``fp16_share`` of each tile's values in fp16, the rest in int8), ``"sign"`` (a bit a value).
        fp16_share: with ``value_format="mixed"``: the share of each tile's kept values sent in fp16,
            in (0, 1).
        position_group_size: with ``selection="topk"``: tensors of the same shape (the same projection
            in consecutive blocks) share their positions in groups of this many, chosen per tile from
            the group's summed energy and sent once per group; each tensor still sends its own values
            (seed 000 §7). ``1``: every tensor sends its own positions.
        position_format: how top-k positions travel: ``"auto"`` (the default: ``"elias_fano"`` with
            ``selection="topk"`` unless ``value_format="mixed"``, else ``"packed"``), ``"packed"`` (12
            bits each in a 64 x 64 tile) or ``"elias_fano"`` (each tile's positions sorted and
            Elias-Fano coded: about 9 bits each at k 32, 8 at k 64; lossless, the same training on
            fewer bytes; not with ``value_format="mixed"``).
        update: ``"sign"`` (the paper's signum step; pair with ``torch.optim.SGD``), ``"raw"``
            (the shared direction as the gradient, for any optimizer such as AdamW) or
            ``"normalized"`` (the shared direction over its root mean square per tensor, for SGD; an
            ablation: it trained worse than the sign, README issue 18).
        compensation: momentum compensation ``lambda`` in [0, 1] (seed 000 §5.1, for small batches):
            each worker's momentum takes ``g_t + lambda (g_t - g_{t-1})``; costs one copy of the
            exchanged tensors' last gradient per worker (in checkpoints); ``0``: off.
        gradient_ema: ``beta_g`` in [0, 1): each worker feeds its momentum a moving average of its
            gradients, ``e <- beta_g e + (1 - beta_g) g``, so the components sent at every step carry
            Signum's momentum (with every coefficient kept: Signum on the mean gradient); costs one
            copy of the exchanged tensors per worker (in checkpoints); ``0``: off. An ablation: with
            top-k selection it trained worse the larger ``beta_g`` and stalled at 0.9 (README issue 18).
        early_steps: the first this many exchanges keep more coefficients per tile (the early
            phase, ``early_topk_factor``). ``None`` (the default): ``clamp(80 // W, 20, 40)``
            exchanges over ``W`` workers (40 at 2, 20 at 4) when neither ``topk`` nor ``keep_ratio``
            is given (40 with only ``early_topk_factor`` given), none with an explicit one; an integer: that many whatever the k (``topk=64,
            early_steps=40``: 256 a tile for 40 exchanges); ``0``: off. Chosen on issue 18's matrix:
            without it the 1.8 M and 6.4 M GPTs stalled at the unigram entropy at some seeds. The
            count is checkpointed.
        early_topk_factor: the early phase's multiple of the k (an integer >= 1; 1: off). ``None``
            (the default): 256 a tile for the default k at any ``W`` (at 4 workers 128 a tile still
            stalled), 4x an explicit strength.
        retain_sent: the share ``rho`` in [0, 1) of each sent component that stays in the sender's
            momentum (error feedback takes out ``(1 - rho)`` of it), so the components sent every step
            keep a momentum of their own; ``0`` (the default) is DeMo's error feedback. An issue 18
            ablation: at 4 workers it trained worse the larger ``rho`` (README).
        clip_grad_norm: the total L2 norm each worker clips its own gradient to before it enters the
            momentum (``torch.nn.utils.clip_grad_norm_``; ``None``: off). ``"auto"`` (the default):
            1.0, unless the Trainer clips (``gradient_clip_val`` set), whose clipping then runs
            alone, at the same point; under Fabric ``"auto"`` is 1.0 (pass ``None`` to clip only with
            ``fabric.clip_gradients``). Chosen on issue 18's matrix: at the same learning rate it
            lowered the default's validation loss in 44 of 46 cells and doubled its best rate on the
            0.44 M GPT at 4 workers (README).
        dense_below: tensors with fewer elements skip the codec and are all-reduced whole (0: compress
            all but the 1-D tensors under ``dense_vectors``).
        dense_vectors: 1-D tensors (norms, biases) skip the codec whatever their size (``False``: only
            under ``dense_below``).
        dense_format: their wire format: ``"bf16"`` (2 bytes an element; the rounding error stays in
            the sender's residual momentum) or ``"fp32"`` (4 bytes, exact).
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
        accelerator: set by the Trainer / Fabric.
        parallel_devices: set by the Trainer / Fabric.
        cluster_environment: set by the Trainer / Fabric (torchrun, SLURM, ... are detected).
        checkpoint_io: set by the Trainer / Fabric.
        precision_plugin: set by the Trainer / Fabric.
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
        transform: Transform = "dct",
        value_format: ValueFormat = "sign",
        fp16_share: float = 0.25,
        position_group_size: int = 1,
        position_format: PositionFormatSetting = "auto",
        update: Update = "sign",
        compensation: float = 0.0,
        early_steps: Optional[int] = None,
        early_topk_factor: Optional[int] = None,
        retain_sent: float = 0.0,
        gradient_ema: float = 0.0,
        clip_grad_norm: Union[float, None, Literal["auto"]] = "auto",
        dense_below: int = 1024,
        dense_vectors: bool = True,
        dense_format: DenseFormat = "bf16",
        bucket_cap_mb: float = 25.0,
        param_sync_every: Optional[int] = None,
        state_sync_every: Optional[dict[str, int]] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = 1800.0,
        start_method: StartMethod = "popen",
        nonfinite: NonFinitePolicy = "skip",
        hierarchy: Hierarchy = "flat",
        accelerator: Optional[Union[Accelerator, FabricAccelerator]] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Union[Precision, FabricPrecision]] = None,
    ) -> None:
        self._clip_follows_trainer = isinstance(clip_grad_norm, str) and clip_grad_norm == "auto"
        if isinstance(clip_grad_norm, str) and not self._clip_follows_trainer:
            raise ValueError(f"clip_grad_norm must be a positive number, None (off) or 'auto' (1.0 unless the Trainer "
                             f"sets gradient_clip_val), got {clip_grad_norm!r}")
        demo = DeMoConfig.of(
            clip_grad_norm=DEFAULT_CLIP_GRAD_NORM if self._clip_follows_trainer else clip_grad_norm,
            chunk=chunk, topk=topk, keep_ratio=keep_ratio, decay=decay, selection=selection, transform=transform,
            value_format=value_format, fp16_share=fp16_share, position_group_size=position_group_size,
            position_format=position_format, update=update,
            compensation=compensation, early_steps=early_steps, early_topk_factor=early_topk_factor, retain_sent=retain_sent,
            gradient_ema=gradient_ema,
            dense_below=dense_below, dense_vectors=dense_vectors, dense_format=dense_format, bucket_cap_mb=bucket_cap_mb,
        )
        desloc = DesLocConfig(
            param_sync_every=param_sync_every,
            state_sync_every={} if state_sync_every is None else state_sync_every,  # None: no state averaging
            sync_buffers=True,
            bucket_cap_mb=bucket_cap_mb,
        )
        self._init_communication(
            demo, desloc, process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
            nonfinite=nonfinite, hierarchy=hierarchy, accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
        )


class DesLocOptions(_Options):
    """DES-LOC (arXiv 2505.22549): every worker runs its own optimizer; parameters and each optimizer
    state are averaged across workers on their own periods (Local Adam when all periods are equal).

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
        transform: the codec's tile transform (with ``compress_params``): ``"dct"``, ``"haar"`` or
            ``"identity"``, as ``DeMoStrategy``'s (the Haar matrix is defined there).
        value_format: codec value format (with ``compress_params``), as ``DeMoStrategy``'s.
        fp16_share: with ``value_format="mixed"`` (and ``compress_params``): the share sent in fp16.
        position_format: with ``compress_params`` and ``selection="topk"``: ``"auto"`` (the
            default), ``"packed"`` or ``"elias_fano"`` positions, as ``DeMoStrategy``'s.
        dense_below: with ``compress_params``: tensors with fewer elements skip the codec and their
            change is averaged whole, as ``DeMoStrategy``'s.
        dense_vectors: with ``compress_params``: 1-D tensors skip the codec whatever their size, as
            ``DeMoStrategy``'s.
        dense_format: with ``compress_params``: how the changes of the tensors that skip the codec
            travel, ``"bf16"`` (the rounding error stays in the error feedback) or
            ``"fp32"``, as ``DeMoStrategy``'s.
        bucket_cap_mb: largest payload per collective in megabytes.
        final_sync: when training ends, average parameters and buffers once more on every rank, so
            the model saved, validated, tested or exported is the averaged one (each rank's own
            replica stays in checkpoints' per-rank state, so a resume continues bitwise). The
            Trainer does it at the end of ``fit``; under Fabric call ``fabric.strategy.final_sync()``.
        process_group_backend: ``"gloo"`` or ``"nccl"``; chosen from the device when ``None``.
        timeout: collective timeout in seconds (or a ``timedelta``).
        start_method: how Lightning starts local processes.
        nonfinite: what every rank does when the loss or a gradient is NaN/inf on any rank (agreed by a
            1-byte-per-rank all-gather every step): ``"skip"`` the step on every rank (nothing of
            ours changes; counted in ``guard/skipped_steps``) or ``"raise"`` ``FloatingPointError`` on
            every rank. Any other value raises ``ValueError``.
        accelerator: set by the Trainer / Fabric.
        parallel_devices: set by the Trainer / Fabric.
        cluster_environment: set by the Trainer / Fabric.
        checkpoint_io: set by the Trainer / Fabric.
        precision_plugin: set by the Trainer / Fabric.
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
        transform: Transform = "dct",
        value_format: ValueFormat = "sign",
        fp16_share: float = 0.25,
        position_format: PositionFormatSetting = "auto",
        dense_below: int = 1024,
        dense_vectors: bool = True,
        dense_format: DenseFormat = "bf16",
        bucket_cap_mb: float = 25.0,
        final_sync: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = 1800.0,
        start_method: StartMethod = "popen",
        nonfinite: NonFinitePolicy = "skip",
        accelerator: Optional[Union[Accelerator, FabricAccelerator]] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Union[Precision, FabricPrecision]] = None,
    ) -> None:
        if param_sync_every is None:  # DesLocConfig allows None (DeMo's optional re-sync); DES-LOC needs a period
            raise ValueError(
                "param_sync_every must be an integer period >= 1 for strategy='desloc' (optimizer steps between parameter "
                "averages), got None"
            )
        # the configs validate every setting, naming it
        codec = CodecConfig(
            chunk=chunk, topk=topk, keep_ratio=keep_ratio, selection=selection, transform=transform, value_format=value_format,
            fp16_share=fp16_share, position_format=position_format, dense_below=dense_below, dense_vectors=dense_vectors,
            dense_format=dense_format, bucket_cap_mb=bucket_cap_mb,
        )
        desloc = DesLocConfig(
            param_sync_every=param_sync_every, state_sync_every=state_sync_every, sync_buffers=sync_buffers,
            compress_params=compress_params, codec=codec, bucket_cap_mb=bucket_cap_mb, final_sync=final_sync,
        )
        self._init_communication(
            None, desloc, process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
            nonfinite=nonfinite, hierarchy="flat", accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
        )
