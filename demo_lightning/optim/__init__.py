"""Optimizers: update rules that compose with the DeMo exchange and DES-LOC averaging."""

from demo_lightning.optim.decoupled_momentum import DecoupledMomentum, decoupled_momentum_update
from demo_lightning.optim.signum import Signum, signum_update

__all__ = ["DecoupledMomentum", "Signum", "decoupled_momentum_update", "signum_update"]
