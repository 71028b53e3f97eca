"""Lightning callbacks over our strategies: adaptive keep ratio, adaptive DES-LOC periods, per-layer policies,
communication monitor."""

from demo_lightning.callbacks.adaptive_keep_ratio import AdaptiveKeepRatio
from demo_lightning.callbacks.adaptive_sync_periods import AdaptiveSyncPeriods
from demo_lightning.callbacks.communication_monitor import CommunicationMonitor
from demo_lightning.callbacks.layer_kinds import LAYER_KINDS, layer_kinds
from demo_lightning.callbacks.layer_policy import PRESETS, LayerPolicy, LayerRule
from demo_lightning.schedules import Schedule

__all__ = [
    "LAYER_KINDS",
    "PRESETS",
    "AdaptiveKeepRatio",
    "AdaptiveSyncPeriods",
    "CommunicationMonitor",
    "LayerPolicy",
    "LayerRule",
    "Schedule",
    "layer_kinds",
]
