"""Shared Lightning glue of the communication-efficient strategies.

``DDPStrategy`` gives launching, process groups, ranks and the distributed sampler; this base
removes the ``DistributedDataParallel`` wrapper (no gradient all-reduce) and runs, per optimizer
step, an optional DeMo exchange (before the update) and optional DES-LOC averaging (after it).

Checkpoints: rank 0 writes Lightning's file (weights, rank 0's optimizer state, loops); every rank
writes its own state to its own shard beside it, ``<ckpt>.shards/rank<r>.pt`` (its DeMo momenta,
and with DES-LOC its parameters, buffers, full optimizer state and schedule position), so no rank
ever holds another rank's state and no collective runs while saving. The main file's optimizer
entries carry only the layout under ``"demo_lightning"`` (``{"layout": "shards", "world_size": W,
...}``; see :mod:`demo_lightning.strategies.shards`). On resume each rank reads only its own shard
(a missing or stale one raises :class:`~demo_lightning.strategies.shards.CheckpointShardError` on
every rank). A checkpoint from another world size restores the shared parts and restarts the
per-rank parts (warned): DeMo momenta from zero, the DES-LOC schedule from rank 0's shard.
Checkpoints of the earlier gathered layout (every rank's state in ``"per_rank"`` of the main file)
still load as before.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union, get_args

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from demo_lightning.algorithms import DEMO_STATE_KEY, DeMoConfig, DeMoExchange, warn_if_stateful
from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig
from demo_lightning.algorithms.guard import FIX, NonFiniteGuard, NonFinitePolicy, check_nonfinite_policy
from demo_lightning.algorithms.participants import StepContext, StepParticipant, run_step
from demo_lightning.comm import ByteLedger, Communicator, NodeGroups, NodeTopology, StepTraffic, build_node_groups, ddp_bytes_for, human_bytes
from demo_lightning.strategies.shards import (
    SHARD_FORMAT, SHARD_VERSION, SHARDS_LAYOUT, CheckpointShardError, ShardReader, remove_shard, shard_dir, write_shard,
)
from demo_lightning.validation import check_choice, is_number

__all__ = ["CommunicationStrategy", "as_timedelta"]

_CHECKPOINT_KEY = "demo_lightning"
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
Hierarchy = Literal["flat", "node"]
HIERARCHIES: tuple[str, ...] = get_args(Hierarchy)


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


def _check_start_method(start_method: Any) -> None:
    check_choice(
        "start_method", start_method, get_args(StartMethod),
        "'popen', the default, re-runs the script for each local process; 'spawn' starts fresh interpreters, for where "
        "re-running the command line is wrong, e.g. pytest",
    )


def _check_backend(backend: Any) -> None:
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


def _unwrap(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


PROGRESS_BAR_KEY = "comm/sent"


class _ProgressBarTraffic:
    """A progress bar's ``get_metrics``, plus this step's bytes sent as a human size.

    Lightning logs numbers only, so ``comm/bytes_sent_per_step`` is logged as a number (for
    TensorBoard and ``callback_metrics``) and kept off the bar; the text
    (``comm/sent=62.4 kB/step``, :func:`~demo_lightning.comm.ledger.human_bytes`) is added where
    Lightning builds the bar's items, :meth:`ProgressBar.get_metrics` (its documented override
    point), by wrapping that method on the trainer's bar instance. Works for any bar (tqdm, rich,
    a subclass: its own ``get_metrics`` runs first); adds nothing before the first optimizer step.
    """

    def __init__(self, get_metrics: Callable[[Trainer, LightningModule], dict[str, Any]], strategy: "CommunicationStrategy") -> None:
        self.get_metrics = get_metrics
        self.strategy = strategy

    def __call__(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = dict(self.get_metrics(trainer, pl_module))
        traffic = self.strategy.last_traffic
        if traffic is not None:
            items[PROGRESS_BAR_KEY] = f"{human_bytes(traffic.sent_bytes)}/step"
        return items

    @classmethod
    def install(cls, bar: ProgressBar, strategy: "CommunicationStrategy") -> None:
        """Wrap ``bar.get_metrics`` once; a later setup (another fit, a validate) re-points it at ``strategy``."""
        current = bar.get_metrics
        if isinstance(current, cls):
            current.strategy = strategy
        else:
            bar.get_metrics = cls(current, strategy)  # type: ignore[method-assign]


class CommunicationStrategy(DDPStrategy):
    """Base of ``DeMoStrategy`` and ``DesLocStrategy`` (not registered itself)."""

    strategy_name: str = ""
    strategy_description: str = ""

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        # DDPStrategy's own would re-register the ddp* names; register only this class's name, once
        if cls.strategy_name and cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description)

    def __init__(
        self,
        demo_config: Optional[DeMoConfig],
        desloc_config: Optional[DesLocConfig],
        process_group_backend: Optional[str],
        timeout: Union[float, timedelta],
        start_method: StartMethod,
        accelerator: Optional[Accelerator],
        parallel_devices: Optional[list[torch.device]],
        cluster_environment: Optional[ClusterEnvironment],
        checkpoint_io: Optional[CheckpointIO],
        precision_plugin: Optional[Precision],
        nonfinite: NonFinitePolicy = "skip",
        hierarchy: Hierarchy = "flat",
    ) -> None:
        self.nonfinite: NonFinitePolicy = check_nonfinite_policy(nonfinite)
        check_choice("hierarchy", hierarchy, HIERARCHIES)
        self.hierarchy: Hierarchy = hierarchy
        _check_start_method(start_method)
        _check_backend(process_group_backend)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=as_timedelta(timeout),
            start_method=start_method,
        )
        self.demo_config = demo_config
        self.desloc_config = desloc_config if desloc_config is not None and desloc_config.enabled else None
        self.ledger = ByteLedger()
        self.last_traffic: Optional[StepTraffic] = None
        self._communicator: Optional[Communicator] = None
        self._topology: Optional[NodeTopology] = None
        self.node_groups: Optional[NodeGroups] = None
        """The intra- and inter-node groups under ``hierarchy="node"`` (``None``: flat)."""
        self._exchanges: dict[int, DeMoExchange] = {}
        self._averagers: dict[int, DesLocAverager] = {}
        self._participants: dict[int, list[StepParticipant]] = {}
        self.skipped_steps = 0  # optimizer steps skipped for non-finite values (checkpointed)
        self.last_step_skipped = False
        self._warned_skip = False

    # ------------------------------------------------------------------ public
    @property
    def communicator(self) -> Communicator:
        """Collectives of this strategy (created once the process group exists)."""
        if self._communicator is None:
            self._communicator = Communicator(ledger=self.ledger, timeout=self._timeout, device=self.root_device, topology=self._topology)
        return self._communicator

    @property
    def topology(self) -> NodeTopology:
        """Which ranks share a node (agreed across ranks when the process group was set up)."""
        return self._topology if self._topology is not None else NodeTopology.single_node(self.world_size)

    @property
    def exchanges(self) -> list[DeMoExchange]:
        """One DeMo exchange per optimizer (empty without DeMo)."""
        return list(self._exchanges.values())

    @property
    def averagers(self) -> list[DesLocAverager]:
        """One DES-LOC averager per optimizer (empty when no period is set)."""
        return list(self._averagers.values())

    # ------------------------------------------------------------------ setup
    @override
    def setup_distributed(self) -> None:
        """DDP's process group, destroyed at interpreter exit whatever its backend.

        Lightning registers the destruction for NCCL only. A gloo group left to interpreter
        finalisation can abort the process after training finished (``terminate called without an
        active exception``, SIGABRT): its worker threads still hold work objects when the
        interpreter tears down. A group the user created before the Trainer is the user's to destroy.
        """
        created = not dist.is_initialized()
        super().setup_distributed()
        if created and dist.is_initialized():
            atexit.register(_destroy_dist_connection)  # a no-op if the group is already gone
        self._topology = self._agree_topology()
        self._communicator = None
        if self.hierarchy == "node" and self.node_groups is None:
            topology = self._topology
            if topology.num_nodes < 2 or topology.ranks_per_node < 2:
                rank_zero_warn(
                    f"hierarchy='node' needs several nodes of several processes, this run has {topology.num_nodes} node(s) "
                    f"of {topology.ranks_per_node} process(es): running flat (every rank a DeMo worker)"
                )
            else:
                self.node_groups = build_node_groups(topology)

    def _agree_topology(self) -> NodeTopology:
        """The job's nodes from Lightning's cluster environment, checked on every rank (one all-gather).

        Raises ``ValueError`` on every rank if the nodes run different numbers of processes, or if
        ranks are not numbered node-major (``global_rank == node_rank * devices + local_rank``).
        """
        world = self.world_size
        if not (dist.is_available() and dist.is_initialized()) or world == 1:
            return NodeTopology.single_node(world)
        mine = torch.tensor([self.global_rank, self.node_rank, self.local_rank, self.num_processes], dtype=torch.int64, device=self.root_device)
        # recorded below, once its link class is known
        gathered = Communicator(timeout=self._timeout, device=self.root_device).all_gather_bytes(
            mine.view(torch.uint8), "setup/topology", per_step=False
        ).wait()
        topology = NodeTopology.from_ranks([g.view(torch.int64).cpu().tolist() for g in gathered])
        every = range(world)
        self.ledger.record("all_gather", "setup/topology", mine.numel() * mine.element_size(), world, per_step=False,
                           rank=self.global_rank, link=topology.link_of(every), inter_share=topology.inter_share(every, self.global_rank))
        return topology

    @override
    def setup(self, trainer: Trainer) -> None:
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError(
                f"{type(self).__name__} does not support precision='16-mixed' (fp16 with a GradScaler): the scaled and "
                "possibly non-finite gradients would enter each worker's local state. Use precision='bf16-mixed' or "
                "'32-true'."
            )
        self._communicator = None
        super().setup(trainer)
        if trainer.progress_bar_callback is not None:
            _ProgressBarTraffic.install(trainer.progress_bar_callback, self)
        if trainer.state.fn == TrainerFn.FITTING:
            self._attach()

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: gradients are never all-reduced. Replicas start from rank 0.
        assert self.model is not None
        self.communicator.broadcast_tensors_([*self.model.parameters(), *self.model.buffers()], "setup/broadcast_module")

    def _attach(self) -> None:
        self._detach()
        assert self.model is not None
        for position, optimizer in enumerate(map(_unwrap, self.optimizers)):
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ValueError(
                    f"{type(self).__name__} cannot drive LBFGS: it evaluates the closure several times per step. "
                    "Use a first-order optimizer (SGD, AdamW, ...)."
                )
            if hasattr(optimizer, "consolidate_state_dict"):
                raise ValueError(
                    f"{type(self).__name__} cannot use the sharded optimizer {type(optimizer).__name__}: every rank "
                    "keeps its full optimizer state. Use the plain optimizer it wraps."
                )
            if self.demo_config is not None:
                if self.demo_config.update == "sign":
                    message = warn_if_stateful(optimizer)
                    if message:
                        rank_zero_warn(message)
                self._exchanges[id(optimizer)] = DeMoExchange(optimizer, self.demo_config, self.communicator, self.node_groups)
            if self.desloc_config is not None:
                buffers = list(self.model.buffers()) if position == 0 else []
                self._averagers[id(optimizer)] = DesLocAverager(optimizer, self.desloc_config, self.communicator, buffers)
            self._participants[id(optimizer)] = self._build_participants(optimizer)

    def _build_participants(self, optimizer: Optimizer) -> list[StepParticipant]:
        """``[guard, (local clipping), (averager), (exchange)]``: see :meth:`optimizer_step`."""
        exchange, averager = self._exchanges.get(id(optimizer)), self._averagers.get(id(optimizer))
        if exchange is None and averager is None:
            return []
        def params() -> list[Tensor]:  # read at every step: a param group added later is checked too
            return [p for g in optimizer.param_groups for p in g["params"]]

        participants: list[StepParticipant] = [NonFiniteGuard(params, self.communicator, self.nonfinite, exchange)]
        if exchange is not None:
            participants.append(_LocalClipping(self, optimizer))
        if averager is not None:
            if exchange is not None:
                averager.add_state_source(DEMO_STATE_KEY, exchange.averaged_state, group=exchange.group)
            participants.append(averager)
        if exchange is not None:
            participants.append(exchange)
        return participants

    def _detach(self) -> None:
        for exchange in self._exchanges.values():
            exchange.remove()
        self._exchanges, self._averagers, self._participants = {}, {}, {}

    @override
    def on_train_end(self) -> None:
        """DES-LOC's final sync: every rank ends on the averaged parameters and buffers (``final_sync``).

        Not for an optimizer that a DeMo exchange drives: its replicas are identical at every step.
        """
        super().on_train_end()
        if self.desloc_config is not None and self.desloc_config.final_sync:
            for key, averager in self._averagers.items():
                if key not in self._exchanges:
                    averager.final_sync()

    @override
    def teardown(self) -> None:
        for exchange in self._exchanges.values():
            exchange.remove()
        if self.node_groups is not None:
            self.node_groups.destroy()
            self.node_groups = None
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
        """Closure, guard, local clipping, exchange (DeMo), Lightning's hooks and the update, averaging (DES-LOC).

        Every rank runs the same collectives in the same order on every path: the guard's
        all-gather always; then either nothing more (a skipped step, a raise on every rank) or the
        exchange and the averaging.

        Gradient clipping: under DeMo, Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm``
        (through ``configure_gradient_clipping``) clips each worker's own gradient before it enters
        the momentum, and Lightning's usual clipping after ``on_before_optimizer_step`` (which would
        clip the shared update) is switched off; DES-LOC's ``clip_grad_norm`` runs at the same point.
        Under DES-LOC alone Lightning clips the local gradient as usual.

        Plan agreement: under DeMo the guard's all-gather also carries every rank's 8-byte plan
        digest (trainable tensors and their codec settings, :meth:`DeMoExchange.plan_digest`); if
        any differs, every rank runs the detailed check and raises the same ``RuntimeError`` before
        any data moves.

        Non-finite guard: after the closure (the loss it returns, ``None`` counting as finite, and
        every ``p.grad`` of ``optimizer``) all ranks agree, through one 1-byte-per-rank all-gather
        (9 bytes with the digest) run at every step, whether any rank saw a NaN or inf. If one did:

        * ``nonfinite="raise"``: every rank raises ``FloatingPointError`` naming the step, the ranks
          and the fix; nothing was updated.
        * ``nonfinite="skip"``: every rank drops its gradients (``p.grad = None``) and returns
          without the exchange, Lightning's ``on_before_optimizer_step`` hooks and clipping,
          ``optimizer.step()`` or DES-LOC averaging: parameters, optimizer state, DeMo residuals and
          the DES-LOC schedule position are unchanged on every rank. :attr:`skipped_steps` counts
          it (logged as ``guard/skipped_steps``, saved in checkpoints), :attr:`last_step_skipped` is
          set, rank 0 warns the first time. Lightning still counts the step: ``trainer.global_step``
          advances (Lightning 2.6 increments it after this method returns: the automatic loop's
          ``optim_progress`` after the ``optimizer_step`` hook, ``LightningOptimizer._on_after_step``
          under manual optimization) and step-interval LR schedulers step, as with the skipped steps
          of its own fp16 GradScaler; our counters (exchange steps, DES-LOC schedule) do not.

        Only the last micro-batch's loss is checked under gradient accumulation; a non-finite loss
        in an earlier micro-batch shows through the accumulated gradients.
        """
        raw = _unwrap(optimizer)
        participants = self._participants.get(id(raw))
        if not participants:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        exchange = self._exchanges.get(id(raw))
        closure_result = closure()  # forward + backward of the last micro-batch
        params = [p for g in raw.param_groups for p in g["params"]]
        step = StepContext(loss=closure_result, step=self._global_step())

        def update() -> Any:
            with _without_lightning_clipping(self.precision_plugin) if exchange is not None else nullcontext():
                return super(CommunicationStrategy, self).optimizer_step(optimizer, lambda: closure_result, model, **kwargs)

        self.ledger.begin_step()
        try:
            output = run_step(participants, update, step)
        finally:
            ddp = ddp_bytes_for([p for p in params if p.requires_grad], self.communicator.world_size)
            self.last_traffic = self.ledger.end_step(ddp, self.topology.ddp_inter_node_bytes(ddp))
        self.last_step_skipped = step.skip
        if step.skip:
            output = closure_result
            self.skipped_steps += 1
            if not self._warned_skip:
                self._warned_skip = True
                guard = participants[0]
                assert isinstance(guard, NonFiniteGuard) and guard.last_flags is not None
                rank_zero_warn(
                    f"{guard.last_flags.summary(self._global_step())}. Skipped this optimizer step on every rank "
                    "(nonfinite='skip'): parameters, optimizer state and exchange state are unchanged. Further skips "
                    f"are counted in guard/skipped_steps without a warning. If they recur: {FIX}; "
                    "nonfinite='raise' stops training instead."
                )
        self._log_traffic(self.last_traffic)
        self._log_guard()
        return output

    def _clip_local_gradients(self, optimizer: Optimizer, model: Optional[Union[LightningModule, Module]]) -> None:
        """Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm`` (through the module's
        ``configure_gradient_clipping`` hook) applied to this worker's own gradient, before the exchange."""
        module = model if isinstance(model, LightningModule) else self.lightning_module
        if module is None or module._trainer is None:
            return
        trainer = module.trainer
        self.precision_plugin._clip_gradients(
            module, optimizer, trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
        )

    def _global_step(self) -> Optional[int]:
        module = self.lightning_module
        return None if module is None or module._trainer is None else module._trainer.global_step

    def _log_guard(self) -> None:
        """Log the cumulative count of skipped steps (the same on every rank)."""
        module = self.lightning_module
        if module is None or module._trainer is None:
            return
        module.log_dict(
            {"guard/skipped_steps": float(self.skipped_steps)},
            on_step=True, on_epoch=False, batch_size=1, sync_dist=False,
        )

    def _log_traffic(self, traffic: StepTraffic) -> None:
        """Log this step's bytes and the ratio to DDP over all steps so far (periodic syncs make a
        single step's ratio swing between infinity and a fraction).

        The logged values are numbers (for TensorBoard and ``callback_metrics``); the progress bar
        shows this step's bytes sent as a human size instead (``comm/sent=62.4 kB/step``, added by
        :class:`_ProgressBarTraffic`, which :meth:`setup` installs)."""
        module = self.lightning_module
        if module is None or module._trainer is None:
            return
        options: dict[str, Any] = dict(on_step=True, on_epoch=False, batch_size=1, sync_dist=False)
        module.log_dict(
            {
                "comm/bytes_sent_per_step": float(traffic.sent_bytes),
                "comm/bytes_received_per_step": float(traffic.received_bytes),
                "comm/inter_node_bytes_per_step": float(traffic.inter_node_bytes),
                "comm/intra_node_bytes_per_step": float(traffic.intra_node_bytes),
                "comm/ratio_vs_ddp": float(self.ledger.cumulative_ratio_vs_ddp),
            },
            **options,
        )

    # ------------------------------------------------------------------ checkpoints
    _checkpoint_path: Optional[str] = None
    """The file :meth:`load_checkpoint` read last; :meth:`load_optimizer_state_dict` reads its shards."""

    def _local_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's own part of ``optimizer``'s training state."""
        local: dict[str, Any] = {}
        exchange, averager = self._exchanges.get(id(optimizer)), self._averagers.get(id(optimizer))
        if exchange is not None:
            local["demo_exchange"] = exchange.state_dict()
        if averager is not None:
            local["optimizer"] = optimizer.state_dict()
            local["desloc"] = averager.state_dict()
            replica, buffers = averager.local_replica()  # this rank's own, also right after the final sync
            local["params"] = [p.clone() for p in replica]
            local["buffers"] = [b.clone() for b in buffers]
        return local

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state dict plus, for an optimizer with per-rank state, the layout record
        ``{"layout": "shards", "version", "world_size", "skipped_steps"}`` under ``"demo_lightning"``.

        No per-rank data and no collective: each rank's own state goes to its own shard file in
        :meth:`save_checkpoint` (rank 0's dict is the one written to the main file).
        """
        optimizer = _unwrap(optimizer)
        state = super().optimizer_state(optimizer)
        if id(optimizer) not in self._exchanges and id(optimizer) not in self._averagers:
            return state
        return {
            **state,
            _CHECKPOINT_KEY: {
                "layout": SHARDS_LAYOUT,
                "version": SHARD_VERSION,
                "world_size": self.communicator.world_size,
                "skipped_steps": self.skipped_steps,
            },
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Every rank writes its own shard ``<filepath>.shards/rank<r>.pt``, then rank 0 writes the main file.

        Lightning calls this on every rank (``Trainer.save_checkpoint``, then a barrier); it runs no
        collective. A shard holds this rank's entry (:meth:`_local_state`) for every optimizer whose
        checkpoint entry carries this strategy's record (none when ``weights_only``: no shard is then
        written), stamped with the rank, world size, global step and epoch of the main file; the main
        file's records name the shard directory (layout: :mod:`demo_lightning.strategies.shards`).

        Failure: the shard is written atomically (temporary file, then rename), so a save killed
        midway leaves the previous shard (or none) under the final name; an error writing it (disk
        full, no permission) propagates on this rank before rank 0 writes the main file.
        """
        states = list(checkpoint.get("optimizer_states") or [])
        entries = [
            self._local_state(_unwrap(optimizer)) if (_record(state) or {}).get("layout") == SHARDS_LAYOUT else None
            for optimizer, state in zip(self.optimizers, states)
        ]
        if any(entry is not None for entry in entries):
            name = os.path.basename(shard_dir(filepath))
            named = [{**s, _CHECKPOINT_KEY: {**s[_CHECKPOINT_KEY], "shards": name}} if e is not None else s for s, e in zip(states, entries)]
            checkpoint = {**checkpoint, "optimizer_states": named + states[len(named):]}
            shard = {
                "format": SHARD_FORMAT, "version": SHARD_VERSION, "rank": self.global_rank, "world_size": self.world_size,
                "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"), "optimizers": entries,
            }
            write_shard(filepath, self.global_rank, shard)
            del shard, entries
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 removes the main file (Lightning's); every rank removes its own shard of it, and the
        rank that removes the last one the then empty ``<filepath>.shards`` directory.

        ``ModelCheckpoint`` (``save_top_k``) calls this on every rank, without a barrier; no rank
        touches another rank's shard, so the ranks do not race. Nothing else is removed: a file the
        user put in the directory keeps it, and so do the shards of a rank that does not call this.
        """
        super().remove_checkpoint(filepath)
        remove_shard(filepath, self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's load of the main file (every rank reads it), remembering its path: the shards
        beside it are read by :meth:`load_optimizer_state_dict`, i.e. only when training state is restored
        (``fit``), not for ``validate`` / ``test`` / ``predict``."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._checkpoint_path = os.fspath(checkpoint_path)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore the optimizers from the main file, then each rank's own state.

        * Shards (this layout): at the saving world size each rank reads only its own shard
          ``<ckpt>.shards/rank<r>.pt`` and gets its state back bitwise. At another world size (warned
          once) parameters and rank 0's optimizer state come from the main file, DeMo momenta restart
          from zero (no shard is read), and under DES-LOC every rank reads rank 0's shard for the
          schedule position (and, with compressed sync, rank 0's anchor and residual).
        * Gathered (``"per_rank"`` in the main file, written before shards): as before, each rank takes
          entry ``rank`` at the saving world size, rank 0's schedule otherwise.

        Raises:
            CheckpointShardError: on every rank (one small all-gather agrees on it), if a shard a rank
                needs is missing, unreadable or from another save, naming the rank, the file and the fix
                (copy the ``.shards`` directory beside the checkpoint, or resume with only the weights).
                Never a silent restart from zero at the saving world size.
            ValueError: the saved per-worker parameters or buffers do not fit this model.
        """
        optimizer_states = checkpoint["optimizer_states"]
        extras = [_record(s) for s in optimizer_states]
        stripped = [{k: v for k, v in s.items() if k != _CHECKPOINT_KEY} if isinstance(s, dict) else s for s in optimizer_states]
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": stripped})
        world, rank = self.communicator.world_size, self.communicator.rank
        sources, problem = self._per_rank_sources(checkpoint, extras, world, rank)
        if any(extra is not None and extra.get("layout") == SHARDS_LAYOUT for extra in extras):
            problems = [p for p in self.communicator.all_gather_object(problem, "checkpoint/shards") if p]
            if problems:
                raise CheckpointShardError("\n".join(problems))
        elif problem is not None:
            raise CheckpointShardError(problem)
        other: Optional[int] = None
        for optimizer, extra, (mine, rank0) in zip(map(_unwrap, self.optimizers), extras, sources):
            if extra is None:
                continue
            self.skipped_steps = int(extra.get("skipped_steps", self.skipped_steps))
            if mine is None:
                other = int(extra["world_size"])
            self._restore_local(optimizer, mine, rank0)
        if other is not None:
            rank_zero_warn(
                f"The checkpoint's per-worker state comes from {other} workers, this run has {world}: parameters and rank 0's "
                "optimizer state are restored; DeMo momenta restart from zero and the DES-LOC schedule from rank 0's position."
            )

    def _per_rank_sources(
        self, checkpoint: Mapping[str, Any], extras: list[Optional[dict[str, Any]]], world: int, rank: int
    ) -> tuple[list[tuple[Optional[dict[str, Any]], dict[str, Any]]], Optional[str]]:
        """Per optimizer ``(this rank's saved entry or None, rank 0's entry or {})``, or the problem that
        prevents reading them (a :class:`CheckpointShardError`'s message). Reads files, no collective."""
        sources: list[tuple[Optional[dict[str, Any]], dict[str, Any]]] = []
        reader: Optional[ShardReader] = None
        try:
            for position, (optimizer, extra) in enumerate(zip(map(_unwrap, self.optimizers), extras)):
                if extra is None:
                    sources.append((None, {}))
                    continue
                saved_world = int(extra["world_size"])
                if extra.get("layout") != SHARDS_LAYOUT:  # gathered: every rank's state in the main file
                    per_rank = extra["per_rank"]
                    sources.append((per_rank[rank] if saved_world == world else None, per_rank[0]))
                    continue
                if self._checkpoint_path is None:
                    raise CheckpointShardError(
                        f"rank {rank}: the checkpoint keeps each rank's state in shard files beside it, but its path is not "
                        "known: load it through the strategy's load_checkpoint(path) (as Trainer.fit(ckpt_path=...) does)"
                    )
                reader = reader if reader is not None else ShardReader(self._checkpoint_path, extra, checkpoint)
                if saved_world == world:
                    mine = reader.entry(rank, position, rank)
                    sources.append((mine, mine))
                elif id(optimizer) in self._averagers:  # another world size: rank 0's DES-LOC schedule
                    why = f" (saved by {saved_world} ranks, this run has {world}: every rank takes rank 0's DES-LOC schedule)"
                    sources.append((None, reader.entry(0, position, rank, why)))
                else:  # another world size, no DES-LOC: DeMo momenta restart from zero, no shard needed
                    sources.append((None, {}))
        except CheckpointShardError as error:
            return [], str(error)
        return sources, None

    def _restore_local(self, optimizer: Optimizer, mine: Optional[dict[str, Any]], rank0: dict[str, Any]) -> None:
        exchange, averager = self._exchanges.get(id(optimizer)), self._averagers.get(id(optimizer))
        if averager is not None and "desloc" in rank0:
            source = mine if mine is not None else rank0
            if mine is not None:
                optimizer.load_state_dict(mine["optimizer"])
                with torch.no_grad():
                    _copy_all(averager.parameters(), mine["params"], "parameters")
                    _copy_all(averager.buffers, mine["buffers"], "buffers")
            averager.load_state_dict(source["desloc"])
        if exchange is not None:
            if mine is not None and "demo_exchange" in mine:
                exchange.load_state_dict(mine["demo_exchange"])
            elif mine is not None and "demo_momentum" in mine:  # layout version 1: parameter-shaped momenta by index
                exchange.load_state_dict(mine["demo_momentum"])
            else:
                exchange.clear_state()


class _LocalClipping:
    """Step participant: Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm`` on this
    worker's own gradient, before the exchange (see :meth:`CommunicationStrategy.optimizer_step`)."""

    def __init__(self, strategy: "CommunicationStrategy", optimizer: Optimizer) -> None:
        self.strategy, self.optimizer = strategy, optimizer

    def before_update(self, step: StepContext) -> None:
        self.strategy._clip_local_gradients(self.optimizer, None)

    def after_update(self, step: StepContext) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        return None


@contextmanager
def _without_lightning_clipping(plugin: Precision) -> Iterator[None]:
    """Within the block, the precision plugin's gradient clipping (run after ``on_before_optimizer_step``)
    does nothing: under DeMo ``p.grad`` then holds the shared update, already made from clipped gradients."""
    plugin._clip_gradients = _no_clipping  # type: ignore[method-assign]
    try:
        yield
    finally:
        del plugin._clip_gradients


def _no_clipping(*args: Any, **kwargs: Any) -> None:
    return None


def _record(state: Any) -> Optional[dict[str, Any]]:
    """The ``"demo_lightning"`` record of one checkpoint optimizer entry (``None``: none)."""
    record = state.get(_CHECKPOINT_KEY) if isinstance(state, Mapping) else None
    return record if isinstance(record, dict) else None


def _copy_all(targets: list[Tensor], sources: list[Tensor], what: str) -> None:
    wrong = [(i, tuple(s.shape), tuple(t.shape)) for i, (t, s) in enumerate(zip(targets, sources)) if t.shape != s.shape]
    if len(targets) != len(sources) or wrong:
        detail = (
            f"{len(sources)} saved, {len(targets)} here" if len(targets) != len(sources)
            else f"{what[:-1]} {wrong[0][0]} (in the optimizer's order) has shape {wrong[0][1]} in the checkpoint, {wrong[0][2]} here"
        )
        raise ValueError(
            f"the checkpoint's per-worker {what} do not match this model ({detail}): it comes from a different model or "
            "one with other frozen layers (requires_grad=False); resume with the model and frozen layers that wrote it, "
            "or load only its weights (without ckpt_path)"
        )
    for t, s in zip(targets, sources):
        t.copy_(s)
