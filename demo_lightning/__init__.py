"""demo_lightning: communication-efficient distributed training for PyTorch Lightning.

``import demo_lightning`` registers the strategy names ``"demo"`` and ``"desloc"``, so that
``Trainer(strategy="demo", devices=N, num_nodes=M)`` trains with DeMo's compressed momentum
exchange (arXiv 2411.19870) in place of DDP's gradient all-reduce, and ``strategy="desloc"`` with
DES-LOC's desynchronised periodic averaging (arXiv 2505.22549).
"""

from lightning.pytorch.strategies import StrategyRegistry

from demo_lightning.algorithms import DeMoConfig, DeMoExchange
from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig
from demo_lightning.comm import ByteLedger, Communicator
from demo_lightning.strategies import DeMoStrategy, DesLocStrategy

__version__ = "0.1.0"

DeMoStrategy.register_strategies(StrategyRegistry)
DesLocStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "ByteLedger",
    "Communicator",
    "DeMoConfig",
    "DeMoExchange",
    "DeMoStrategy",
    "DesLocAverager",
    "DesLocConfig",
    "DesLocStrategy",
    "__version__",
]
