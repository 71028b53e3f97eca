"""One process's DeMo / DES-LOC training state, shared by the Trainer and the Fabric strategies.

:class:`CommunicationRuntime` is what both front ends delegate to, so the logic exists once:

* **process group** (:meth:`~CommunicationRuntime.connect`, right after the default group exists):
  the nodes agreed across ranks (one all-gather), the intra-/inter-node groups under
  ``hierarchy="node"``, the :class:`~demo_lightning.comm.Communicator` and its byte ledger, and the
  group's destruction at interpreter exit;
* **optimizers** (:meth:`~CommunicationRuntime.attach`): per optimizer a DeMo exchange and/or a
  DES-LOC averager, and the step participants ``[guard, (before-update hook), (averager),
  (exchange)]``;
* **the step** (:meth:`~CommunicationRuntime.step`): the participants around the optimizer's own
  update, inside one ledger window, with the non-finite skip accounting;
* **per-rank state** for checkpoints: the layout record of the main file, this rank's own entry for
  its shard, and the restore from shards (:mod:`demo_lightning.strategies.shards`).

It knows neither the Trainer nor Fabric: the front ends pass ranks, the device, the optimizers, the
update and the checkpoint's stamp. Collectives (all through the communicator): the topology
all-gather at :meth:`connect`, the participants' every step, and one small all-gather on restore
from shards; every rank runs the same ones in the same order.
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, get_args

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from demo_lightning.algorithms import DEMO_STATE_KEY, DeMoConfig, DeMoExchange, ExchangeStats, warn_if_stateful
from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig
from demo_lightning.algorithms.guard import FIX, NonFiniteGuard, NonFinitePolicy, check_nonfinite_policy
from demo_lightning.algorithms.participants import StepContext, StepParticipant, run_step
from demo_lightning.comm import ByteLedger, Communicator, NodeGroups, NodeTopology, StepTraffic, build_node_groups, ddp_bytes_for
from demo_lightning.strategies.shards import SHARD_FORMAT, SHARD_VERSION, SHARDS_LAYOUT, CheckpointShardError, ShardReader, write_shard
from demo_lightning.validation import check_choice

__all__ = ["CHECKPOINT_KEY", "HIERARCHIES", "CommunicationRuntime", "Hierarchy", "record_of", "strip_record"]

CHECKPOINT_KEY = "demo_lightning"
"""Key of our layout record inside a checkpoint's optimizer state dict."""
Hierarchy = Literal["flat", "node"]
HIERARCHIES: tuple[str, ...] = get_args(Hierarchy)


def record_of(state: Any) -> Optional[dict[str, Any]]:
    """The ``"demo_lightning"`` record of one checkpoint optimizer entry (``None``: none)."""
    record = state.get(CHECKPOINT_KEY) if isinstance(state, Mapping) else None
    return record if isinstance(record, dict) else None


def strip_record(state: Any) -> Any:
    """``state`` without its ``"demo_lightning"`` record (what ``Optimizer.load_state_dict`` takes)."""
    return {k: v for k, v in state.items() if k != CHECKPOINT_KEY} if isinstance(state, dict) else state


class _BeforeUpdate:
    """Step participant: a front end's hook on this worker's own gradients before the exchange
    (the Trainer's ``gradient_clip_val``)."""

    def __init__(self, hook: Callable[[Optimizer], None], optimizer: Optimizer) -> None:
        self.hook, self.optimizer = hook, optimizer

    def before_update(self, step: StepContext) -> None:
        self.hook(self.optimizer)

    def after_update(self, step: StepContext) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        return None


class CommunicationRuntime:
    """Per-process state and step of DeMo / DES-LOC training, for any front end.

    Args:
        demo_config: the DeMo exchange's settings (``None``: no exchange).
        desloc_config: DES-LOC averaging's settings (``None`` or not enabled: no averaging).
        nonfinite: ``"skip"`` or ``"raise"`` on a NaN/inf loss or gradient on any rank.
        hierarchy: ``"flat"`` or ``"node"`` (see ``DeMoStrategy``).
        timeout: collective timeout; a peer that stops answering makes the others raise after it.

    Raises:
        ValueError: ``nonfinite`` or ``hierarchy`` is not one of its choices.
    """

    def __init__(
        self,
        demo_config: Optional[DeMoConfig],
        desloc_config: Optional[DesLocConfig],
        nonfinite: NonFinitePolicy,
        hierarchy: Hierarchy,
        timeout: timedelta,
    ) -> None:
        self.nonfinite: NonFinitePolicy = check_nonfinite_policy(nonfinite)
        check_choice("hierarchy", hierarchy, HIERARCHIES)
        self.hierarchy: Hierarchy = hierarchy
        self.demo_config = demo_config
        self.desloc_config = desloc_config if desloc_config is not None and desloc_config.enabled else None
        self.timeout = timeout
        self.device = torch.device("cpu")
        self.ledger = ByteLedger()
        self.last_traffic: Optional[StepTraffic] = None
        self.node_groups: Optional[NodeGroups] = None
        """The intra- and inter-node groups under ``hierarchy="node"`` (``None``: flat)."""
        self.skipped_steps = 0  # optimizer steps skipped for non-finite values (checkpointed)
        self.last_step_skipped = False
        self.steps = 0
        """Optimizer steps run through :meth:`step` by this process (skipped ones included)."""
        self._communicator: Optional[Communicator] = None
        self._topology: Optional[NodeTopology] = None
        self._exchanges: dict[int, DeMoExchange] = {}
        self._averagers: dict[int, DesLocAverager] = {}
        self._participants: dict[int, list[StepParticipant]] = {}
        self._warned_skip = False

    # ------------------------------------------------------------------ process group
    @property
    def communicator(self) -> Communicator:
        """Collectives of this run (created on first use, on :attr:`device`, with the agreed topology)."""
        if self._communicator is None:
            self._communicator = Communicator(ledger=self.ledger, timeout=self.timeout, device=self.device, topology=self._topology)
        return self._communicator

    def reset_communicator(self, device: torch.device) -> None:
        """Use ``device`` from now on (a new communicator on next use; the ledger is kept)."""
        self.device = device
        self._communicator = None

    @property
    def topology(self) -> NodeTopology:
        """Which ranks share a node (agreed in :meth:`connect`; one node before it)."""
        return self._topology if self._topology is not None else NodeTopology.single_node(self.communicator.world_size)

    def connect(self, *, created_group: bool, device: torch.device, global_rank: int, node_rank: int, local_rank: int,
                num_processes: int) -> None:
        """Right after the default process group exists: agree the nodes, build the hierarchy's groups.

        A group this front end created (``created_group``) is destroyed at interpreter exit whatever
        its backend: a gloo group left to interpreter finalisation can abort the process after
        training finished (``terminate called without an active exception``, SIGABRT). A group the
        user created is the user's to destroy.

        Raises ``ValueError`` on every rank if the nodes run different numbers of processes, or if
        ranks are not numbered node-major. Under ``hierarchy="node"`` one node, or one process per
        node, warns and runs flat.
        """
        if created_group and dist.is_initialized():
            atexit.register(_destroy_dist_connection)  # a no-op if the group is already gone
        self.device = device
        self._topology = self._agree_topology(global_rank, node_rank, local_rank, num_processes)
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

    def _agree_topology(self, global_rank: int, node_rank: int, local_rank: int, num_processes: int) -> NodeTopology:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return NodeTopology.single_node(dist.get_world_size() if dist.is_initialized() else 1)
        world = dist.get_world_size()
        mine = torch.tensor([global_rank, node_rank, local_rank, num_processes], dtype=torch.int64, device=self.device)
        # recorded below, once its link class is known
        gathered = Communicator(timeout=self.timeout, device=self.device).all_gather_bytes(
            mine.view(torch.uint8), "setup/topology", per_step=False
        ).wait()
        topology = NodeTopology.from_ranks([g.view(torch.int64).cpu().tolist() for g in gathered])
        every = range(world)
        self.ledger.record("all_gather", "setup/topology", mine.numel() * mine.element_size(), world, per_step=False,
                           rank=global_rank, link=topology.link_of(every), inter_share=topology.inter_share(every, global_rank))
        return topology

    # ------------------------------------------------------------------ optimizers
    @property
    def exchanges(self) -> list[DeMoExchange]:
        """One DeMo exchange per attached optimizer (empty without DeMo)."""
        return list(self._exchanges.values())

    @property
    def averagers(self) -> list[DesLocAverager]:
        """One DES-LOC averager per attached optimizer (empty when no period is set)."""
        return list(self._averagers.values())

    def follow_parameters(self) -> None:
        """Every exchange's and averager's state to its parameters' current devices, their scratch
        buffers dropped (:meth:`DeMoExchange.follow_parameters`); no collective runs."""
        for exchange in self._exchanges.values():
            exchange.follow_parameters()
        for averager in self._averagers.values():
            averager.follow_parameters()

    @property
    def last_stats(self) -> Optional[ExchangeStats]:
        """Statistics of the most recent exchange (``None`` before the first step)."""
        stats = [e.stats for e in self._exchanges.values() if e.stats.steps > 0]
        return stats[-1] if stats else None

    def manages(self, optimizer: Optimizer) -> bool:
        """Whether :meth:`step` drives ``optimizer`` (it has an exchange or an averager)."""
        return bool(self._participants.get(id(optimizer)))

    def exchange_of(self, optimizer: Optimizer) -> Optional[DeMoExchange]:
        return self._exchanges.get(id(optimizer))

    def averager_of(self, optimizer: Optimizer) -> Optional[DesLocAverager]:
        return self._averagers.get(id(optimizer))

    def attach(self, optimizer: Optimizer, buffers: list[Tensor], owner: str,
               before_update: Optional[Callable[[Optimizer], None]] = None,
               names: Optional[Mapping[Tensor, str]] = None, front_end_clips: bool = False) -> None:
        """Drive ``optimizer``: a DeMo exchange and/or a DES-LOC averager (averaging ``buffers`` with
        the parameters), and their step participants. ``names``: the parameters' qualified names
        (position groups join the same role across blocks, :meth:`DeMoExchange.set_parameter_names`).

        ``before_update`` runs on this worker's own gradients before the exchange (under DeMo only).
        ``front_end_clips``: it clips them (the Trainer's ``gradient_clip_val``), so the exchange's
        own ``clip_grad_norm`` stays off.

        Raises:
            ValueError: ``optimizer`` is LBFGS (it evaluates the closure several times per step) or
                a sharded optimizer (every rank keeps its full state here); ``owner`` names the caller.
        """
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                f"{owner} cannot drive LBFGS: it evaluates the closure several times per step. "
                "Use a first-order optimizer (SGD, AdamW, ...)."
            )
        if hasattr(optimizer, "consolidate_state_dict"):
            raise ValueError(
                f"{owner} cannot use the sharded optimizer {type(optimizer).__name__}: every rank "
                "keeps its full optimizer state. Use the plain optimizer it wraps."
            )
        self.release(optimizer)
        if self.demo_config is not None:
            if self.demo_config.update in ("sign", "normalized"):
                message = warn_if_stateful(optimizer)
                if message:
                    rank_zero_warn(message)
            config = replace(self.demo_config, clip_grad_norm=None) if front_end_clips else self.demo_config
            exchange = self._exchanges[id(optimizer)] = DeMoExchange(optimizer, config, self.communicator, self.node_groups)
            if names:
                exchange.set_parameter_names(names)
        if self.desloc_config is not None:
            self._averagers[id(optimizer)] = DesLocAverager(optimizer, self.desloc_config, self.communicator, buffers)
        self._participants[id(optimizer)] = self.build_participants(optimizer, before_update)

    def build_participants(self, optimizer: Optimizer, before_update: Optional[Callable[[Optimizer], None]] = None) -> list[StepParticipant]:
        """``[guard, (before_update), (averager), (exchange)]`` for ``optimizer``; see :meth:`step`."""
        exchange, averager = self._exchanges.get(id(optimizer)), self._averagers.get(id(optimizer))
        if exchange is None and averager is None:
            return []

        def params() -> list[Tensor]:  # read at every step: a param group added later is checked too
            return [p for g in optimizer.param_groups for p in g["params"]]

        participants: list[StepParticipant] = [NonFiniteGuard(params, self.communicator, self.nonfinite, exchange)]
        if exchange is not None and before_update is not None:
            participants.append(_BeforeUpdate(before_update, optimizer))
        if averager is not None:
            if exchange is not None:
                averager.add_state_source(DEMO_STATE_KEY, exchange.averaged_state, group=exchange.group)
            participants.append(averager)
        if exchange is not None:
            participants.append(exchange)
        return participants

    def release(self, optimizer: Optimizer) -> None:
        """Stop driving ``optimizer`` (its exchange's hooks removed); a no-op if not attached."""
        exchange = self._exchanges.pop(id(optimizer), None)
        if exchange is not None:
            exchange.remove()
        self._averagers.pop(id(optimizer), None)
        self._participants.pop(id(optimizer), None)

    def detach(self) -> None:
        """Stop driving every optimizer."""
        for exchange in self._exchanges.values():
            exchange.remove()
        self._exchanges, self._averagers, self._participants = {}, {}, {}

    def close(self) -> None:
        """End of training: exchanges' hooks removed, the hierarchy's groups destroyed (collective on
        their members). The default group stays (its creator destroys it)."""
        for exchange in self._exchanges.values():
            exchange.remove()
        if self.node_groups is not None:
            self.node_groups.destroy()
            self.node_groups = None

    # ------------------------------------------------------------------ the step
    def step(self, optimizer: Optimizer, update: Callable[[], Any], loss: Any = None, global_step: Optional[int] = None) -> Any:
        """One optimizer step of ``optimizer`` with its participants; returns ``update()``'s value, or
        ``loss`` when the step is skipped.

        Order on every rank: the guard's all-gather (non-finite flags, and under DeMo the plan
        digest), then (unless every rank skips or raises) the before-update hook, the averager's and
        the exchange's ``before_update`` (the exchange writes the shared update into ``p.grad``),
        ``update()`` (the optimizer's own step), and their ``after_update`` (DES-LOC's averaging).
        Every collective falls in one ledger window, closed even when a participant raises;
        :attr:`last_traffic` holds its bytes against DDP's for the same trainable parameters.

        Non-finite values (``loss`` or any ``p.grad``) on any rank: ``"raise"`` raises
        ``FloatingPointError`` on every rank; ``"skip"`` drops the gradients and changes nothing of
        ours on any rank, counted in :attr:`skipped_steps` (warned once).
        """
        participants = self._participants[id(optimizer)]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        context = StepContext(loss=loss, step=global_step if global_step is not None else self.steps)
        self.ledger.begin_step()
        try:
            output = run_step(participants, update, context)
        finally:
            ddp = ddp_bytes_for([p for p in params if p.requires_grad], self.communicator.world_size)
            self.last_traffic = self.ledger.end_step(ddp, self.topology.ddp_inter_node_bytes(ddp))
            self.steps += 1
        self.last_step_skipped = context.skip
        if context.skip:
            output = loss
            self.skipped_steps += 1
            if not self._warned_skip:
                self._warned_skip = True
                guard = participants[0]
                assert isinstance(guard, NonFiniteGuard) and guard.last_flags is not None
                rank_zero_warn(
                    f"{guard.last_flags.summary(context.step)}. Skipped this optimizer step on every rank "
                    "(nonfinite='skip'): parameters, optimizer state and exchange state are unchanged. Further skips "
                    f"are counted in guard/skipped_steps without a warning. If they recur: {FIX}; "
                    "nonfinite='raise' stops training instead."
                )
        return output

    def final_sync(self) -> None:
        """DES-LOC's final average of parameters and buffers, on every rank (when ``final_sync`` is set).

        Not for an optimizer that a DeMo exchange drives: its replicas are identical at every step.
        """
        if self.desloc_config is not None and self.desloc_config.final_sync:
            for key, averager in self._averagers.items():
                if key not in self._exchanges:
                    averager.final_sync()

    def metrics(self) -> dict[str, float]:
        """The last step's traffic and the guard's count, as the strategies log them (empty before a step):
        ``comm/bytes_sent_per_step``, ``comm/bytes_received_per_step``, ``comm/inter_node_bytes_per_step``,
        ``comm/intra_node_bytes_per_step``, ``comm/ratio_vs_ddp`` (cumulative: DDP's bytes / ours) and
        ``guard/skipped_steps``."""
        traffic = self.last_traffic
        if traffic is None:
            return {}
        return {
            "comm/bytes_sent_per_step": float(traffic.sent_bytes),
            "comm/bytes_received_per_step": float(traffic.received_bytes),
            "comm/inter_node_bytes_per_step": float(traffic.inter_node_bytes),
            "comm/intra_node_bytes_per_step": float(traffic.intra_node_bytes),
            "comm/ratio_vs_ddp": float(self.ledger.cumulative_ratio_vs_ddp),
            "guard/skipped_steps": float(self.skipped_steps),
        }

    # ------------------------------------------------------------------ checkpoints
    def record(self, optimizer: Optimizer) -> Optional[dict[str, Any]]:
        """The main file's layout record for ``optimizer`` (``None``: nothing per rank to save)."""
        if id(optimizer) not in self._exchanges and id(optimizer) not in self._averagers:
            return None
        return {"layout": SHARDS_LAYOUT, "version": SHARD_VERSION, "world_size": self.communicator.world_size,
                "skipped_steps": self.skipped_steps}

    def local_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's own part of ``optimizer``'s training state (for its shard)."""
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

    def write_shard(self, filepath: Any, entries: list[Optional[dict[str, Any]]], stamp: Mapping[str, Any]) -> None:
        """Write this rank's shard of the checkpoint ``filepath`` (atomically; no collective).

        ``entries`` per optimizer position (``None``: none); ``stamp`` ties the shard to the main file
        (the Trainer's ``global_step`` and ``epoch``), checked on load.
        """
        rank = self.communicator.rank
        shard = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "rank": rank, "world_size": self.communicator.world_size,
                 **stamp, "optimizers": entries}
        write_shard(filepath, rank, shard)

    def restore(self, checkpoint_path: Optional[str], optimizers: list[Optimizer], records: list[Optional[dict[str, Any]]],
                stamp: Mapping[str, Any], positions: Optional[list[int]] = None) -> None:
        """Each rank's own state back, after the optimizers' own state dicts were loaded.

        ``records[i]`` is ``optimizers[i]``'s layout record (``None``: nothing of ours saved for it);
        its state is entry ``positions[i]`` of the shards (default ``i``).

        * Shards: at the saving world size each rank reads only its own shard and gets its state back
          bitwise. At another world size (warned once) DeMo momenta restart from zero (no shard is
          read), and under DES-LOC every rank reads rank 0's shard for the schedule position.
        * Gathered (``"per_rank"`` in the record, the earliest layout): entry ``rank`` at the saving
          world size, rank 0's otherwise.

        Raises:
            CheckpointShardError: on every rank (one small all-gather agrees on it), if a shard a rank
                needs is missing, unreadable or from another save, naming the rank, the file and the fix.
            ValueError: the saved per-worker parameters or buffers do not fit this model.
        """
        world, rank = self.communicator.world_size, self.communicator.rank
        positions = list(range(len(optimizers))) if positions is None else positions
        sources, problem = self._sources(checkpoint_path, optimizers, records, positions, stamp, world, rank)
        if any(record is not None and record.get("layout") == SHARDS_LAYOUT for record in records):
            problems = [p for p in self.communicator.all_gather_object(problem, "checkpoint/shards") if p]
            if problems:
                raise CheckpointShardError("\n".join(problems))
        elif problem is not None:
            raise CheckpointShardError(problem)
        other: Optional[int] = None
        for optimizer, record, (mine, rank0) in zip(optimizers, records, sources):
            if record is None:
                continue
            self.skipped_steps = int(record.get("skipped_steps", self.skipped_steps))
            if mine is None:
                other = int(record["world_size"])
            self._restore_local(optimizer, mine, rank0)
        if other is not None:
            rank_zero_warn(
                f"The checkpoint's per-worker state comes from {other} workers, this run has {world}: parameters and rank 0's "
                "optimizer state are restored; DeMo momenta restart from zero and the DES-LOC schedule from rank 0's position."
            )

    def _sources(
        self, checkpoint_path: Optional[str], optimizers: list[Optimizer], records: list[Optional[dict[str, Any]]],
        positions: list[int], stamp: Mapping[str, Any], world: int, rank: int,
    ) -> tuple[list[tuple[Optional[dict[str, Any]], dict[str, Any]]], Optional[str]]:
        """Per optimizer ``(this rank's saved entry or None, rank 0's entry or {})``, or the problem that
        prevents reading them (a :class:`CheckpointShardError`'s message). Reads files, no collective."""
        sources: list[tuple[Optional[dict[str, Any]], dict[str, Any]]] = []
        reader: Optional[ShardReader] = None
        try:
            for position, optimizer, record in zip(positions, optimizers, records):
                if record is None:
                    sources.append((None, {}))
                    continue
                saved_world = int(record["world_size"])
                if record.get("layout") != SHARDS_LAYOUT:  # gathered: every rank's state in the main file
                    per_rank = record["per_rank"]
                    sources.append((per_rank[rank] if saved_world == world else None, per_rank[0]))
                    continue
                if checkpoint_path is None:
                    raise CheckpointShardError(
                        f"rank {rank}: the checkpoint keeps each rank's state in shard files beside it, but its path is not "
                        "known: load it through the strategy's load_checkpoint(path) (as Trainer.fit(ckpt_path=...) and "
                        "fabric.load(path, state) do)"
                    )
                reader = reader if reader is not None else ShardReader(checkpoint_path, record, stamp)
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
