"""What the Trainer's and Fabric's strategies share: construction, registration and the runtime's view.

:class:`CommunicationFront` is mixed into ``CommunicationStrategy`` (Trainer) and
``FabricCommunicationStrategy`` (Fabric) ahead of their DDP base. It builds the
:class:`~demo_lightning.strategies.runtime.CommunicationRuntime` from the options' configs, checks
the launch settings, registers the class under its ``strategy_name``, and exposes the runtime's
state as the strategy's own attributes (``ledger``, ``exchanges``, ``skipped_steps``, ...). Each front
end implements only :meth:`CommunicationFront._init_parallel` (its DDP base's ``__init__``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

from lightning.fabric.strategies import _StrategyRegistry

from demo_lightning.algorithms import DeMoConfig, DeMoExchange, ExchangeStats
from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig
from demo_lightning.algorithms.guard import NonFinitePolicy
from demo_lightning.comm import ByteLedger, Communicator, NodeGroups, NodeTopology, StepTraffic
from demo_lightning.strategies.options import StartMethod, as_timedelta, check_backend, check_start_method
from demo_lightning.strategies.runtime import CommunicationRuntime, Hierarchy

__all__ = ["CommunicationFront"]


class CommunicationFront:
    """Mixin of both front ends' strategy bases (see the module docstring)."""

    strategy_name: str = ""
    strategy_description: str = ""
    runtime: CommunicationRuntime
    """This process's exchanges, averagers, ledger, topology and per-rank state."""
    _clip_follows_trainer: bool = False
    """DeMo's ``clip_grad_norm="auto"``: the exchange's own clip steps aside when the Trainer clips
    (``gradient_clip_val``); set by ``DeMoOptions``."""

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        # DDPStrategy's own would re-register the ddp* names; register only this class's name, once
        if cls.strategy_name and cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description)

    def _init_communication(
        self,
        demo: Optional[DeMoConfig],
        desloc: Optional[DesLocConfig],
        *,
        process_group_backend: Optional[str],
        timeout: Union[float, timedelta],
        start_method: StartMethod,
        nonfinite: NonFinitePolicy,
        hierarchy: Hierarchy,
        **plumbing: Any,
    ) -> None:
        """Called by the options' ``__init__``: the runtime, the checks, then the DDP base with
        ``plumbing`` (accelerator, parallel devices, cluster environment, checkpoint IO, precision).

        Raises ``ValueError`` naming the argument for an unknown ``nonfinite``, ``hierarchy``,
        ``start_method`` or ``process_group_backend``, or a non-positive ``timeout``.
        """
        self.runtime = CommunicationRuntime(demo, desloc, nonfinite, hierarchy, as_timedelta(timeout))
        check_start_method(start_method)
        check_backend(process_group_backend)
        self._init_parallel(process_group_backend=process_group_backend, timeout=self.runtime.timeout,
                            start_method=start_method, **plumbing)

    def _init_parallel(self, **settings: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _init_parallel (its DDP base's __init__)")

    def _refuse_fp16_with_scaler(self, has_scaler: bool) -> None:
        """``precision="16-mixed"`` (fp16 with a GradScaler) is refused by both front ends."""
        if has_scaler:
            raise ValueError(
                f"{type(self).__name__} does not support precision='16-mixed' (fp16 with a GradScaler): the scaled and "
                "possibly non-finite gradients would enter each worker's local state. Use precision='bf16-mixed' or "
                "'32-true'."
            )

    # ------------------------------------------------------------------ the runtime's state
    @property
    def demo_config(self) -> Optional[DeMoConfig]:
        return self.runtime.demo_config

    @property
    def desloc_config(self) -> Optional[DesLocConfig]:
        return self.runtime.desloc_config

    @property
    def nonfinite(self) -> NonFinitePolicy:
        return self.runtime.nonfinite

    @property
    def hierarchy(self) -> Hierarchy:
        return self.runtime.hierarchy

    @property
    def ledger(self) -> ByteLedger:
        """Every collective of this run, by tag and link (see :class:`~demo_lightning.comm.ByteLedger`)."""
        return self.runtime.ledger

    @property
    def last_traffic(self) -> Optional[StepTraffic]:
        """The last optimizer step's bytes (``None`` before the first)."""
        return self.runtime.last_traffic

    @property
    def communicator(self) -> Communicator:
        """Collectives of this strategy (created once the process group exists)."""
        return self.runtime.communicator

    @property
    def topology(self) -> NodeTopology:
        """Which ranks share a node (agreed across ranks when the process group was set up)."""
        return self.runtime.topology

    @property
    def node_groups(self) -> Optional[NodeGroups]:
        """The intra- and inter-node groups under ``hierarchy="node"`` (``None``: flat)."""
        return self.runtime.node_groups

    @property
    def exchanges(self) -> list[DeMoExchange]:
        """One DeMo exchange per optimizer (empty without DeMo)."""
        return self.runtime.exchanges

    @property
    def averagers(self) -> list[DesLocAverager]:
        """One DES-LOC averager per optimizer (empty when no period is set)."""
        return self.runtime.averagers

    @property
    def last_stats(self) -> Optional[ExchangeStats]:
        """Statistics of the most recent exchange (``None`` before the first step)."""
        return self.runtime.last_stats

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite values on any rank (checkpointed)."""
        return self.runtime.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped on every rank (``nonfinite="skip"``)."""
        return self.runtime.last_step_skipped

    def metrics(self) -> dict[str, float]:
        """The last step's traffic and skip count as the strategies log them (:meth:`CommunicationRuntime.metrics`)."""
        return self.runtime.metrics()
