"""``Fabric(strategy="demo")`` and ``Fabric(strategy="desloc")``: the same algorithms for a loop you write.

For users of Lightning Fabric, who write their own training loop. ``import demo_lightning``
registers both names in Fabric's strategy registry; the options are those of ``DeMoStrategy`` and
``DesLocStrategy`` (declared once, :mod:`demo_lightning.strategies.options`), and the per-process
state and step are the same :class:`~demo_lightning.strategies.runtime.CommunicationRuntime` the
Trainer's strategies use: no second copy of the logic. What each Fabric call does here:

* ``fabric.launch()``: processes and the process group as Fabric's DDP (popen, spawn, torchrun,
  SLURM), then the runtime agrees the nodes (and builds the hierarchy's groups);
* ``fabric.setup(model, optimizer)``: no ``DistributedDataParallel`` wrapper (backward never
  all-reduces); rank 0's parameters and buffers are broadcast, and each optimizer gets its DeMo
  exchange and/or DES-LOC averager (which averages the buffers of the module owning its
  parameters). ``fabric.setup_module`` then ``fabric.setup_optimizers`` works too, and so does a
  second ``fabric.setup`` for another model: the optimizers set up before stay driven;
* ``optimizer.step()``: the guard, the exchange (which writes the shared update into ``p.grad``),
  the optimizer's own step, DES-LOC's averaging; the traffic goes to ``fabric.strategy.ledger``, and
  ``fabric.log_dict(fabric.strategy.metrics())`` logs it as the Trainer's strategies do;
* ``fabric.clip_gradients(...)`` before ``optimizer.step()`` clips this worker's own gradient, before
  it enters the momentum (the shared update is never clipped); a NaN/inf norm does not raise on the
  one rank (``error_if_nonfinite`` is not used): the guard then skips or raises on every rank.
  ``DeMoStrategy``'s own ``clip_grad_norm`` (``"auto"``: 1.0 here, since Fabric cannot tell whether
  you clip) runs after it, inside the exchange: pass ``clip_grad_norm=None`` to clip only yourself;
* ``fabric.no_backward_sync(model, enabled=...)`` (gradient accumulation): backward never
  synchronises here, so it is a no-op; the exchange runs once per ``optimizer.step()``;
* ``fabric.save(path, state)``: rank 0 writes ``path`` (the model, rank 0's optimizer state, the rest
  of ``state``); every rank writes its own state to ``<path>.shards/rank<r>.pt`` (DeMo momenta; under
  DES-LOC its parameters, buffers, optimizer state and schedule). ``fabric.load(path, state)``: every
  rank reads ``path`` and its own shard, and continues bitwise. A shard missing or from another save
  raises :class:`~demo_lightning.strategies.shards.CheckpointShardError` on every rank;
* the end of training under DES-LOC: ``fabric.strategy.final_sync()`` averages the replicas once
  more (the Trainer does this at the end of ``fit``). Fabric calls no teardown: the process group
  this strategy created (and the hierarchy's groups in it) is destroyed at interpreter exit.

Refused with ``ValueError``: ``precision="16-mixed"`` (fp16 with a GradScaler), LBFGS and sharded
optimizers.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional, Union

import torch.distributed as dist
from lightning.fabric.plugins import Precision
from lightning.fabric.plugins.precision.amp import MixedPrecision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH, Optimizable, _Stateful
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from demo_lightning.strategies.front import CommunicationFront
from demo_lightning.strategies.options import DeMoOptions, DesLocOptions
from demo_lightning.strategies.runtime import CHECKPOINT_KEY, record_of, strip_record
from demo_lightning.strategies.shards import SHARDS_LAYOUT, shard_dir_name

__all__ = ["DeMoFabricStrategy", "DesLocFabricStrategy", "FabricCommunicationStrategy"]


class _NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: nothing to block, backward never synchronises under these strategies."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class FabricCommunicationStrategy(CommunicationFront, DDPStrategy):
    """Base of ``DeMoFabricStrategy`` and ``DesLocFabricStrategy`` (not registered itself)."""

    @override
    def _init_parallel(self, *, precision_plugin: Optional[Precision] = None, **settings: Any) -> None:
        DDPStrategy.__init__(self, precision=precision_plugin, **settings)
        self._backward_sync_control = _NoBackwardSync()
        self._modules: list[Module] = []  # every module set up so far, for the buffers DES-LOC averages
        self._buffers_owned: set[int] = set()  # modules whose buffers an averager already averages
        self._saves = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "FabricCommunicationStrategy is the base of DeMoFabricStrategy and DesLocFabricStrategy, not a strategy "
            "itself: construct one of those, or pass Fabric(strategy='demo') / 'desloc'"
        )

    def final_sync(self) -> None:
        """DES-LOC's last average of parameters and buffers on every rank (with ``final_sync=True``):
        call it once after the training loop, on every rank, so the model you save or evaluate is the
        averaged one. A no-op for optimizers a DeMo exchange drives (their replicas never differ)."""
        self.runtime.final_sync()

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        self._refuse_fp16_with_scaler(isinstance(self.precision, MixedPrecision) and self.precision.scaler is not None)
        super().setup_environment()

    @override
    def _setup_distributed(self) -> None:
        created = not dist.is_initialized()
        super()._setup_distributed()
        self.runtime.connect(created_group=created, device=self.root_device, global_rank=self.global_rank,
                             node_rank=self.node_rank, local_rank=self.local_rank, num_processes=self.num_processes)

    @override
    def setup_module(self, module: Module) -> Module:
        """No ``DistributedDataParallel`` wrapper: rank 0's parameters and buffers are broadcast, so the
        replicas start identical; the module is returned as it is."""
        self.communicator.broadcast_tensors_([*module.parameters(), *module.buffers()], "setup/broadcast_module")
        if all(m is not module for m in self._modules):
            self._modules.append(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Attach the exchange and/or the averager to ``optimizer`` (again, if it was attached before).

        DES-LOC averages the floating-point buffers (``sync_buffers``) of the set-up module that owns
        the optimizer's parameters, through the first optimizer attached for that module (a second
        optimizer of the same module does not average them again). An optimizer whose parameters
        belong to no set-up module gets no buffers (warned under DES-LOC with ``sync_buffers``): set
        the module up first (``fabric.setup(model, optimizer)`` does).
        """
        self.runtime.attach(optimizer, self._buffers_for(optimizer), type(self).__name__,
                            names={p: n for m in self._modules for n, p in m.named_parameters()})
        return optimizer

    def _buffers_for(self, optimizer: Optimizer) -> list[Tensor]:
        config = self.runtime.desloc_config
        if config is None or not config.sync_buffers:
            return []
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owner = next((m for m in reversed(self._modules) if any(id(p) in params for p in m.parameters())), None)
        if owner is None:
            if params:
                rank_zero_warn(
                    f"{type(self).__name__}: the optimizer's parameters belong to no module set up with Fabric, so DES-LOC "
                    "averages no module buffers for it (BatchNorm statistics stay per rank): call fabric.setup(model, "
                    "optimizer), or fabric.setup_module(model) before fabric.setup_optimizers(optimizer)"
                )
            return []
        if id(owner) in self._buffers_owned:
            return []
        self._buffers_owned.add(id(owner))
        return list(owner.buffers())

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[Module, list[Optimizer], Optional[Any]]:
        """:meth:`setup_module`, then :meth:`setup_optimizer` for each optimizer. A second
        ``fabric.setup`` (another model, e.g. a GAN's discriminator) adds to what is driven: the
        optimizers set up before keep their exchanges."""
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """``fabric.clip_gradients(max_norm=...)`` on this worker's own gradient, never raising on a
        NaN/inf norm: that would stop this rank alone while the others wait in the next step's guard.
        The guard decides instead, on every rank together (``nonfinite="skip"`` or ``"raise"``), so
        ``error_if_nonfinite`` is not used."""
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type=norm_type, error_if_nonfinite=False)

    @override
    def teardown(self) -> None:
        self.runtime.close()
        super().teardown()

    # ------------------------------------------------------------------ step
    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The runtime's step around the precision plugin's ``optimizer.step()`` (see
        :meth:`CommunicationRuntime.step`): every rank runs the guard's all-gather, then the exchange
        and the averaging, or skips (``nonfinite="skip"``) or raises on every rank.

        A ``closure`` (``optimizer.step(closure)``) runs first, once: its loss is checked with the
        gradients, and the optimizer's step gets its result.
        """
        if not isinstance(optimizer, Optimizer) or not self.runtime.manages(optimizer):
            return super().optimizer_step(optimizer, **kwargs)
        closure: Optional[Callable[[], Any]] = kwargs.pop("closure", None)
        loss = closure() if closure is not None else None

        def update() -> Any:
            if closure is not None:
                return self.precision.optimizer_step(optimizer, closure=lambda: loss, **kwargs)
            return self.precision.optimizer_step(optimizer, **kwargs)

        return self.runtime.step(optimizer, update, loss)

    # ------------------------------------------------------------------ checkpoints
    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:  # type: ignore[override]
        """The optimizer's state dict plus, for one these strategies drive, the layout record under
        ``"demo_lightning"`` (its state per rank is in the shards)."""
        state = super().get_optimizer_state(optimizer)
        record = self.runtime.record(optimizer)
        return state if record is None else {**state, CHECKPOINT_KEY: record}

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Union[Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Every rank writes its shard ``<path>.shards/rank<r>.pt``, then rank 0 writes ``path``.

        Called on every rank by ``fabric.save`` (which then waits at a barrier); runs no collective. The
        shard holds this rank's state of every optimizer in ``state`` that these strategies drive, and
        the stamp ``{"optimizer_step", "save"}`` (equal on every rank) that ties it to ``path``; each
        optimizer's record in ``path`` names its entry in the shards. Failure: as the Trainer's
        (:meth:`~demo_lightning.strategies.CommunicationStrategy.save_checkpoint`): the shard is
        written atomically, and an error writing it raises on this rank.
        """
        converted = self._convert_stateful_objects_in_state(state, filter=(filter or {}))
        keys = [k for k, obj in state.items() if isinstance(obj, Optimizer) and (record_of(converted.get(k)) or {}).get("layout") == SHARDS_LAYOUT]
        if keys:
            self._saves += 1
            stamp = {"optimizer_step": self.runtime.steps, "save": self._saves}
            name = shard_dir_name(path)
            for entry, key in enumerate(keys):
                converted[key] = {**converted[key], CHECKPOINT_KEY: {**converted[key][CHECKPOINT_KEY], "shards": name, "entry": entry, "stamp": stamp}}
            self.runtime.write_shard(path, [self.runtime.local_state(state[k]) for k in keys], stamp)  # type: ignore[arg-type]
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint=converted, path=path, storage_options=storage_options)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Union[Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Fabric's load (every rank reads ``path``), then each rank's own state from its shard.

        With a ``state`` dict, modules, optimizers (without our record) and other stateful objects
        are restored in place as Fabric's DDP does; then each driven optimizer's per-rank state comes
        from the shards (:meth:`CommunicationRuntime.restore`: bitwise at the saving world size;
        another world size restarts the momenta, warned). The strategy's step and save counts
        continue from the checkpoint. Without ``state`` the file is returned as it is.

        Raises:
            CheckpointShardError: on every rank, if a rank's shard is missing, unreadable or from
                another save (the message names the file and the fix).
        """
        if not isinstance(state, dict) or not state:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
        optimizers: list[Optimizer] = []
        records: list[Optional[dict[str, Any]]] = []
        for name, obj in state.copy().items():
            if name not in checkpoint:
                continue
            if isinstance(obj, Module):
                self.load_module_state_dict(module=obj, state_dict=checkpoint.pop(name), strict=strict)
            elif isinstance(obj, Optimizer):
                saved = checkpoint.pop(name)
                obj.load_state_dict(strip_record(saved))
                if self.runtime.manages(obj) and record_of(saved) is not None:
                    optimizers.append(obj)
                    records.append(record_of(saved))
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(checkpoint.pop(name))
            else:
                state[name] = checkpoint.pop(name)
        if optimizers:
            stamps = [r.get("stamp", {}) for r in records if r is not None]
            stamp = stamps[0] if stamps else {}
            positions = [int((r or {}).get("entry", i)) for i, r in enumerate(records)]
            self.runtime.restore(str(path), optimizers, records, stamp, positions)
            if "optimizer_step" in stamp:
                self.runtime.steps = int(stamp["optimizer_step"])
                self._saves = int(stamp["save"])
        return checkpoint


class DeMoFabricStrategy(DeMoOptions, FabricCommunicationStrategy):
    __doc__ = DeMoOptions.__doc__


class DesLocFabricStrategy(DesLocOptions, FabricCommunicationStrategy):
    __doc__ = DesLocOptions.__doc__
