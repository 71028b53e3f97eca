"""``Trainer(strategy="demo")``: DeMo's compressed momentum exchange in place of DDP's all-reduce.

A thin Lightning layer over :class:`demo_lightning.algorithms.DeMoExchange`. It reuses
``DDPStrategy`` for launching, process groups, ranks and the distributed sampler, but never wraps
the model in ``DistributedDataParallel``: gradients are not all-reduced. Instead:

* at fit start, rank 0's parameters and buffers are broadcast (replicas start identical);
* once per optimizer step (after the closure, i.e. after the last micro-batch of gradient
  accumulation) every optimizer's exchange runs and writes the shared update into ``p.grad``;
  then Lightning's ``on_before_optimizer_step`` hooks, gradient clipping (of the shared update)
  and the optimizer's own step follow;
* checkpoints carry every rank's own momentum (gathered to rank 0) and each rank gets its own
  back on resume;
* traffic of each step is logged as ``comm/bytes_sent_per_step``, ``comm/bytes_received_per_step``
  and ``comm/ratio_vs_ddp`` (DDP's bytes / ours), and kept in :attr:`DeMoStrategy.ledger`.

Refused with ``ValueError``: fp16 mixed precision with a GradScaler (the scaled, possibly
non-finite gradients would enter the momentum; use ``precision="bf16-mixed"`` or ``"32-true"``),
LBFGS (it calls the closure several times per step) and sharded optimizers.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from demo_lightning.algorithms import DEMO_STATE_KEY, DeMoConfig, DeMoExchange, ExchangeStats, warn_if_stateful
from demo_lightning.comm import ByteLedger, Communicator

__all__ = ["DeMoStrategy"]

_CHECKPOINT_KEY = "demo_lightning"


def _as_timedelta(timeout: Union[float, int, timedelta], name: str = "timeout") -> timedelta:
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"{name} must be seconds (a number) or a datetime.timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"{name} must be > 0 seconds, got {seconds}; collectives that exceed it raise on every rank")
    return timedelta(seconds=seconds)


def _unwrap(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class DeMoStrategy(DDPStrategy):
    """DeMo (arXiv 2411.19870): each worker keeps its own momentum and shares only its strongest
    DCT components, so each step moves a small fraction of DDP's bytes.

    Args:
        chunk: DCT tile side (2-D views in ``chunk`` x ``chunk`` tiles, 1-D in ``chunk``-long chunks).
        topk: coefficients kept per tile; default 32 if neither ``topk`` nor ``keep_ratio`` is given.
        keep_ratio: fraction of each tile kept, in (0, 1]; give this or ``topk``, not both.
        decay: momentum decay in [0, 1).
        selection: ``"topk"`` (largest magnitudes) or ``"lowpass"`` (fixed lowest frequencies, no indices).
        value_format: wire format of the kept values: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"int8"``, ``"sign"``.
        update: ``"sign"`` (the paper's signum step; pair with ``torch.optim.SGD``) or ``"raw"``
            (the shared direction as the gradient, for any optimizer such as AdamW).
        dense_below: tensors with fewer elements are all-reduced densely in fp32 (0: compress all).
        bucket_cap_mb: largest payload per collective in megabytes.
        process_group_backend: ``"gloo"`` or ``"nccl"``; chosen from the device when ``None``.
        timeout: collective timeout in seconds (or a ``timedelta``); a peer that stops answering
            makes the others raise after this long.
        start_method: how Lightning starts local processes: ``"popen"``, ``"spawn"``, ``"fork"``, ``"forkserver"``.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer (torchrun, SLURM, ... are detected).
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
    """

    strategy_name = "demo"

    def __init__(
        self,
        chunk: int = 64,
        topk: Optional[int] = None,
        keep_ratio: Optional[float] = None,
        decay: float = 0.999,
        selection: Literal["topk", "lowpass"] = "topk",
        value_format: Literal["fp32", "bf16", "fp16", "int8", "sign"] = "bf16",
        update: Literal["sign", "raw"] = "sign",
        dense_below: int = 4096,
        bucket_cap_mb: float = 25.0,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = 1800.0,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        self.demo_config = DeMoConfig(
            chunk=chunk,
            topk=topk,
            keep_ratio=keep_ratio,
            decay=decay,
            selection=selection,
            value_format=value_format,
            update=update,
            dense_below=dense_below,
            bucket_cap_mb=bucket_cap_mb,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=_as_timedelta(timeout),
            start_method=start_method,
        )
        self.ledger = ByteLedger()
        self._communicator: Optional[Communicator] = None
        self._exchanges: dict[int, DeMoExchange] = {}

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="DeMo compressed momentum exchange instead of DDP's all-reduce"
            )

    # ------------------------------------------------------------------ public
    @property
    def communicator(self) -> Communicator:
        """Collectives of this strategy (created once the process group exists)."""
        if self._communicator is None:
            self._communicator = Communicator(ledger=self.ledger)
        return self._communicator

    @property
    def exchanges(self) -> list[DeMoExchange]:
        """One exchange per optimizer, in the Trainer's optimizer order."""
        return list(self._exchanges.values())

    @property
    def last_stats(self) -> Optional[ExchangeStats]:
        """Statistics of the most recent exchange (``None`` before the first step)."""
        stats = [e.stats for e in self._exchanges.values() if e.stats.steps > 0]
        return stats[-1] if stats else None

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Trainer) -> None:
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError(
                "DeMoStrategy does not support precision='16-mixed' (fp16 with a GradScaler): the exchange would fold "
                "scaled and possibly non-finite gradients into each worker's momentum. Use precision='bf16-mixed' "
                "or '32-true'."
            )
        self._communicator = None
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._attach_exchanges()

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: gradients are never all-reduced. Replicas start from rank 0.
        assert self.model is not None
        self.communicator.broadcast_tensors_(
            [*self.model.parameters(), *self.model.buffers()], tag="setup/broadcast_module", src=0
        )

    def _attach_exchanges(self) -> None:
        for exchange in self._exchanges.values():
            exchange.remove()
        self._exchanges = {}
        for optimizer in map(_unwrap, self.optimizers):
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ValueError(
                    "DeMoStrategy cannot drive LBFGS: it evaluates the closure several times per step, while the exchange "
                    "runs once per step. Use a first-order optimizer (SGD with update='sign', or AdamW with update='raw')."
                )
            if hasattr(optimizer, "consolidate_state_dict"):
                raise ValueError(
                    f"DeMoStrategy cannot use the sharded optimizer {type(optimizer).__name__}: every rank needs the full "
                    "optimizer state. Use the plain optimizer it wraps."
                )
            if self.demo_config.update == "sign":
                message = warn_if_stateful(optimizer)
                if message:
                    rank_zero_warn(message)
            self._exchanges[id(optimizer)] = DeMoExchange(optimizer, self.demo_config, self.communicator)

    @override
    def teardown(self) -> None:
        for exchange in self._exchanges.values():
            exchange.remove()
        super().teardown()

    # ------------------------------------------------------------------ step
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        exchange = self._exchanges.get(id(_unwrap(optimizer)))
        if exchange is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        closure_result = closure()  # forward + backward of the last micro-batch
        stats = exchange.step()
        try:
            output = super().optimizer_step(optimizer, lambda: closure_result, model, **kwargs)
        finally:
            exchange.restore_state()
        self._log_traffic(stats)
        return output

    def _log_traffic(self, stats: ExchangeStats) -> None:
        module = self.lightning_module
        if module is None or module._trainer is None:
            return
        module.log_dict(
            {
                "comm/bytes_sent_per_step": float(stats.sent_bytes),
                "comm/bytes_received_per_step": float(stats.received_bytes),
                "comm/ratio_vs_ddp": float(stats.ratio_vs_ddp),
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
            sync_dist=False,
        )

    # ------------------------------------------------------------------ checkpoints
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state dict, with every rank's own DeMo momentum (a collective: all ranks call it)."""
        state = super().optimizer_state(optimizer)
        exchange = self._exchanges.get(id(_unwrap(optimizer)))
        if exchange is None:
            return state
        local = exchange.local_state()
        shared = {index: {k: v for k, v in s.items() if k != DEMO_STATE_KEY} for index, s in state["state"].items()}
        gathered = self.communicator.all_gather_object(local, "checkpoint/demo_momentum")
        return {
            **state,
            "state": shared,
            _CHECKPOINT_KEY: {"world_size": self.communicator.world_size, "momentum_per_rank": gathered},
        }

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        optimizer_states = checkpoint["optimizer_states"]
        extras = [s.get(_CHECKPOINT_KEY) if isinstance(s, dict) else None for s in optimizer_states]
        stripped = [
            {k: v for k, v in s.items() if k != _CHECKPOINT_KEY} if isinstance(s, dict) else s for s in optimizer_states
        ]
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": stripped})
        world, rank = self.communicator.world_size, self.communicator.rank
        for optimizer, extra in zip(map(_unwrap, self.optimizers), extras):
            exchange = self._exchanges.get(id(optimizer))
            if exchange is None or extra is None:
                continue
            if extra["world_size"] != world:
                rank_zero_warn(
                    f"The checkpoint's DeMo momenta come from {extra['world_size']} workers, this run has {world}: "
                    "parameters and optimizer state are restored, the per-worker momenta restart from zero."
                )
                exchange.clear_state()
                continue
            exchange.load_local_state(extra["momentum_per_rank"][rank])
