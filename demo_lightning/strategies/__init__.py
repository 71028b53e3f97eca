"""Lightning strategies (thin layers over :mod:`demo_lightning.algorithms`)."""

from demo_lightning.strategies.base import CommunicationStrategy
from demo_lightning.strategies.demo import DeMoStrategy
from demo_lightning.strategies.desloc import DesLocStrategy

__all__ = ["CommunicationStrategy", "DeMoStrategy", "DesLocStrategy"]
