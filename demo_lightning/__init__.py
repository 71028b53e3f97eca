"""demo_lightning: communication-efficient distributed training for PyTorch Lightning.

``import demo_lightning`` registers the strategy names ``"demo"`` and ``"desloc"`` with the Trainer
and with Fabric, so that ``Trainer(strategy="demo", devices=N, num_nodes=M)`` (or
``Fabric(strategy="demo", ...)`` for a loop you write) trains with DeMo's compressed momentum
exchange (arXiv 2411.19870) in place of DDP's gradient all-reduce, and ``strategy="desloc"`` with
DES-LOC's desynchronised periodic averaging (arXiv 2505.22549).

The public surface, importable from here:

* strategies: :class:`DeMoStrategy`, :class:`DesLocStrategy` (Trainer), :class:`DeMoFabricStrategy`,
  :class:`DesLocFabricStrategy` (Fabric);
* configs: :class:`DeMoConfig`, :class:`CodecConfig`, :class:`DesLocConfig`, and per-tensor
  :class:`TensorSettings` / :class:`TensorCodec`;
* algorithms usable without Lightning: :class:`DeMoExchange`, :class:`DesLocAverager`,
  :class:`CompressedMean`, :class:`NonFiniteGuard`, and the step protocol
  (:class:`StepContext`, :class:`StepParticipant`, :func:`run_step`);
* communication: :class:`Communicator`, :class:`CollectiveWork`, :class:`CollectiveError`,
  :class:`ByteLedger`;
* callbacks: :class:`CommunicationMonitor`, :class:`AdaptiveKeepRatio`, :class:`AdaptiveSyncPeriods`, :class:`LayerPolicy`
  (with :class:`LayerRule` and :class:`Schedule`); the optimizers :class:`DecoupledMomentum` and :class:`Signum`
  (the sign rule on the exact gradient: DeMo's reference under DDP).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from demo_lightning.algorithms.compressed_mean import CompressedMean
from demo_lightning.algorithms.config import CodecConfig, TensorCodec
from demo_lightning.algorithms.demo import DeMoConfig, DeMoExchange, TensorSettings
from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig
from demo_lightning.algorithms.guard import NonFiniteGuard
from demo_lightning.algorithms.participants import StepContext, StepParticipant, run_step
from demo_lightning.callbacks import AdaptiveKeepRatio, AdaptiveSyncPeriods, CommunicationMonitor, LayerPolicy, LayerRule
from demo_lightning.comm import ByteLedger, CollectiveError, CollectiveWork, Communicator
from demo_lightning.optim import DecoupledMomentum, Signum
from demo_lightning.schedules import Schedule
from demo_lightning.strategies import DeMoFabricStrategy, DeMoStrategy, DesLocFabricStrategy, DesLocStrategy

__version__ = "0.1.0"

DeMoStrategy.register_strategies(StrategyRegistry)
DesLocStrategy.register_strategies(StrategyRegistry)
DeMoFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
DesLocFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "AdaptiveKeepRatio",
    "AdaptiveSyncPeriods",
    "ByteLedger",
    "CodecConfig",
    "CollectiveError",
    "CollectiveWork",
    "CommunicationMonitor",
    "Communicator",
    "CompressedMean",
    "DeMoConfig",
    "DeMoExchange",
    "DeMoFabricStrategy",
    "DeMoStrategy",
    "DecoupledMomentum",
    "DesLocAverager",
    "DesLocConfig",
    "DesLocFabricStrategy",
    "DesLocStrategy",
    "LayerPolicy",
    "LayerRule",
    "NonFiniteGuard",
    "Schedule",
    "Signum",
    "StepContext",
    "StepParticipant",
    "TensorCodec",
    "TensorSettings",
    "__version__",
    "run_step",
]
