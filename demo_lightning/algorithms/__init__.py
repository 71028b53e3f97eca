"""Communication algorithms that attach to an optimizer, usable without Lightning."""

from demo_lightning.algorithms.compressed_mean import CompressedMean
from demo_lightning.algorithms.config import DEFAULT_TOPK, CodecConfig, TensorCodec, compute_dtype
from demo_lightning.algorithms.demo import (
    DEFAULT_EARLY_STEPS,
    DEFAULT_EARLY_TOPK,
    DEMO_STATE_KEY,
    MIN_DEFAULT_EARLY_STEPS,
    UPDATES,
    DeMoConfig,
    DeMoExchange,
    ExchangeStats,
    TensorEnergy,
    TensorSettings,
    default_early_steps,
    warn_if_stateful,
)
from demo_lightning.algorithms.guard import NonFiniteFlags, agree_nonfinite, gather_nonfinite
from demo_lightning.algorithms.momentum import MOMENTUM_STATE_VERSION, SpectralMomentum

__all__ = [
    "DEFAULT_EARLY_STEPS",
    "DEFAULT_EARLY_TOPK",
    "DEFAULT_TOPK",
    "DEMO_STATE_KEY",
    "MIN_DEFAULT_EARLY_STEPS",
    "MOMENTUM_STATE_VERSION",
    "UPDATES",
    "CodecConfig",
    "CompressedMean",
    "DeMoConfig",
    "DeMoExchange",
    "ExchangeStats",
    "NonFiniteFlags",
    "SpectralMomentum",
    "TensorCodec",
    "TensorEnergy",
    "TensorSettings",
    "agree_nonfinite",
    "compute_dtype",
    "default_early_steps",
    "gather_nonfinite",
    "warn_if_stateful",
]
