"""Lightning strategies (thin layers over :mod:`demo_lightning.algorithms`), for the Trainer and for Fabric."""

from demo_lightning.strategies.base import CommunicationStrategy
from demo_lightning.strategies.demo import DeMoStrategy
from demo_lightning.strategies.desloc import DesLocStrategy
from demo_lightning.strategies.fabric import DeMoFabricStrategy, DesLocFabricStrategy, FabricCommunicationStrategy
from demo_lightning.strategies.runtime import CommunicationRuntime

__all__ = [
    "CommunicationRuntime",
    "CommunicationStrategy",
    "DeMoFabricStrategy",
    "DeMoStrategy",
    "DesLocFabricStrategy",
    "DesLocStrategy",
    "FabricCommunicationStrategy",
]
