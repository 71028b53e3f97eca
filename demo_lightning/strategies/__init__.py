"""Lightning strategies (thin layers over :mod:`demo_lightning.algorithms`)."""

from demo_lightning.strategies.demo import DeMoStrategy

__all__ = ["DeMoStrategy"]
