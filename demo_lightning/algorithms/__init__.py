"""Communication algorithms that attach to an optimizer, usable without Lightning."""

from demo_lightning.algorithms.compressed_mean import DEFAULT_TOPK, CodecConfig, CompressedMean, TensorCodec, TensorEnergy
from demo_lightning.algorithms.demo import (
    DEMO_STATE_KEY,
    UPDATES,
    DeMoConfig,
    DeMoExchange,
    ExchangeStats,
    TensorSettings,
    warn_if_stateful,
)
from demo_lightning.algorithms.guard import NonFiniteFlags, agree_nonfinite, gather_nonfinite

__all__ = [
    "DEFAULT_TOPK",
    "DEMO_STATE_KEY",
    "UPDATES",
    "CodecConfig",
    "CompressedMean",
    "DeMoConfig",
    "DeMoExchange",
    "ExchangeStats",
    "NonFiniteFlags",
    "TensorCodec",
    "TensorEnergy",
    "TensorSettings",
    "agree_nonfinite",
    "gather_nonfinite",
    "warn_if_stateful",
]
