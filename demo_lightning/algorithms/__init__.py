"""Communication algorithms that attach to an optimizer, usable without Lightning."""

from demo_lightning.algorithms.compressed_mean import DEFAULT_TOPK, CodecConfig, CompressedMean
from demo_lightning.algorithms.demo import (
    DEMO_STATE_KEY,
    UPDATES,
    DeMoConfig,
    DeMoExchange,
    ExchangeStats,
    warn_if_stateful,
)

__all__ = [
    "DEFAULT_TOPK",
    "DEMO_STATE_KEY",
    "UPDATES",
    "CodecConfig",
    "CompressedMean",
    "DeMoConfig",
    "DeMoExchange",
    "ExchangeStats",
    "warn_if_stateful",
]
