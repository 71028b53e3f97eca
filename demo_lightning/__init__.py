"""demo_lightning: communication-efficient distributed training for PyTorch Lightning.

``import demo_lightning`` registers the strategy name ``"demo"``, so that
``Trainer(strategy="demo", devices=N, num_nodes=M)`` trains with DeMo's compressed momentum
exchange (arXiv 2411.19870) in place of DDP's gradient all-reduce.
"""

from lightning.pytorch.strategies import StrategyRegistry

from demo_lightning.algorithms import DeMoConfig, DeMoExchange
from demo_lightning.comm import ByteLedger, Communicator
from demo_lightning.strategies import DeMoStrategy

__version__ = "0.1.0"

DeMoStrategy.register_strategies(StrategyRegistry)

__all__ = ["ByteLedger", "Communicator", "DeMoConfig", "DeMoExchange", "DeMoStrategy", "__version__"]
