"""The package's public surface: ``demo_lightning.__all__`` is what ``from demo_lightning import ...``
gives, each name the very object its home module defines, and importing the package registers
the strategy names ``"demo"`` and ``"desloc"`` with Lightning's Trainer and Fabric."""

from __future__ import annotations

import importlib

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import demo_lightning

# where each public name is defined (a rename or a second definition breaks this table)
HOMES = {
    "AdaptiveKeepRatio": "demo_lightning.callbacks.adaptive_keep_ratio",
    "AdaptiveSyncPeriods": "demo_lightning.callbacks.adaptive_sync_periods",
    "ByteLedger": "demo_lightning.comm.ledger",
    "CodecConfig": "demo_lightning.algorithms.config",
    "CollectiveError": "demo_lightning.comm.collectives",
    "CollectiveWork": "demo_lightning.comm.collectives",
    "CommunicationMonitor": "demo_lightning.callbacks.communication_monitor",
    "Communicator": "demo_lightning.comm.collectives",
    "CompressedMean": "demo_lightning.algorithms.compressed_mean",
    "DeMoConfig": "demo_lightning.algorithms.demo",
    "DeMoExchange": "demo_lightning.algorithms.demo",
    "DeMoFabricStrategy": "demo_lightning.strategies.fabric",
    "DeMoStrategy": "demo_lightning.strategies.demo",
    "DecoupledMomentum": "demo_lightning.optim.decoupled_momentum",
    "DesLocAverager": "demo_lightning.algorithms.desloc",
    "DesLocConfig": "demo_lightning.algorithms.desloc",
    "DesLocFabricStrategy": "demo_lightning.strategies.fabric",
    "DesLocStrategy": "demo_lightning.strategies.desloc",
    "LayerPolicy": "demo_lightning.callbacks.layer_policy",
    "LayerRule": "demo_lightning.callbacks.layer_policy",
    "NonFiniteGuard": "demo_lightning.algorithms.guard",
    "Schedule": "demo_lightning.schedules",
    "Signum": "demo_lightning.optim.signum",
    "StepContext": "demo_lightning.algorithms.participants",
    "StepParticipant": "demo_lightning.algorithms.participants",
    "TensorCodec": "demo_lightning.algorithms.config",
    "TensorSettings": "demo_lightning.algorithms.demo",
    "run_step": "demo_lightning.algorithms.participants",
}


def test_all_is_sorted_without_duplicates() -> None:
    names = demo_lightning.__all__
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert list(names) == sorted(names)


def test_all_is_the_documented_surface() -> None:
    assert set(demo_lightning.__all__) == set(HOMES) | {"__version__"}
    assert isinstance(demo_lightning.__version__, str) and demo_lightning.__version__


@pytest.mark.parametrize("name", sorted(HOMES))
def test_each_name_is_importable_from_the_top_and_is_its_home_modules_object(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from demo_lightning import {name}", namespace)  # the import statement users write
    obj = namespace[name]
    assert obj is getattr(demo_lightning, name)
    assert obj.__module__ == HOMES[name], f"{name} is defined in {obj.__module__}, not {HOMES[name]}"
    assert getattr(importlib.import_module(HOMES[name]), name) is obj
    assert obj.__doc__, f"{name} has no docstring"


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from demo_lightning import *", namespace)
    assert {k for k in namespace if k != "__builtins__"} == set(demo_lightning.__all__)


@pytest.mark.parametrize(("name", "cls"), [("demo", demo_lightning.DeMoStrategy), ("desloc", demo_lightning.DesLocStrategy)])
def test_strategy_names_resolve_to_the_classes(name: str, cls: type) -> None:
    assert name in StrategyRegistry
    assert StrategyRegistry[name]["strategy"] is cls
    assert isinstance(StrategyRegistry.get(name), cls)
    trainer = Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert type(trainer.strategy) is cls


def test_registering_again_adds_nothing() -> None:
    before = list(StrategyRegistry)
    demo_lightning.DeMoStrategy.register_strategies(StrategyRegistry)
    demo_lightning.DesLocStrategy.register_strategies(StrategyRegistry)
    assert list(StrategyRegistry) == before


@pytest.mark.parametrize(("name", "cls"), [("demo", demo_lightning.DeMoFabricStrategy), ("desloc", demo_lightning.DesLocFabricStrategy)])
def test_fabric_strategy_names_resolve_to_the_classes(name: str, cls: type) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    assert STRATEGY_REGISTRY[name]["strategy"] is cls
    assert type(Fabric(strategy=name, accelerator="cpu", devices=1).strategy) is cls
