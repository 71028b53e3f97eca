"""The default k by the number of DeMo workers (issue 18): ``clamp(128 // W, 8, 64)`` for an
all-gathered exchange, so its bytes per worker do not grow with ``W``; explicit settings and
all-reduced exchanges keep theirs; the planner and a real exchange agree on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange
from demo_lightning.algorithms.config import default_topk
from demo_lightning.comm import Communicator
from demo_lightning.comm.topology import NodeTopology
from demo_lightning.planning import modeled_collectives

from dist_helpers import run_workers

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(("workers", "k"), [(1, 64), (2, 64), (3, 42), (4, 32), (5, 25), (8, 16), (16, 8), (17, 8), (1024, 8)])
def test_default_topk_holds_w_times_k_at_128_between_8_and_64(workers: int, k: int) -> None:
    assert default_topk(workers) == k


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, None])
def test_default_topk_refuses_a_bad_worker_count_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match="workers"):
        default_topk(bad)


def test_for_workers_resolves_only_the_unset_all_gathered_default() -> None:
    assert CodecConfig().for_workers(4).topk == 32
    assert CodecConfig(value_format="fp32", selection="lowpass").for_workers(4) == CodecConfig(value_format="fp32", selection="lowpass")
    assert CodecConfig(selection="lowpass").for_workers(4).topk == 32  # 1-bit low-pass values are all-gathered
    assert CodecConfig(selection="shared", value_format="bf16").for_workers(8).strength == (64, None)
    assert CodecConfig(topk=64).for_workers(8).topk == 64
    assert CodecConfig(keep_ratio=0.02).for_workers(8).strength == (None, 0.02)
    resolved = CodecConfig(chunk=32, value_format="int8").for_workers(8)
    assert (resolved.topk, resolved.chunk, resolved.value_format) == (16, 32, "int8")


def test_exchange_without_a_process_group_keeps_64() -> None:
    ex = DeMoExchange(torch.optim.SGD(nn.Linear(64, 64).parameters(), lr=0.1), DeMoConfig(), Communicator())
    assert ex.config.codec.topk == 64 and ex.config.codec.strength == (64, None)


def _planned_payload(shapes: list[tuple[int, ...]], topology: NodeTopology, method: str, codec: CodecConfig) -> int:
    return sum(r.payload_bytes for r in modeled_collectives(shapes, topology, method, codec) if r.tag.startswith("demo/"))


def test_planner_uses_the_workers_k_flat_over_ranks_hierarchical_over_nodes() -> None:
    shapes = [(256, 256), (512, 256)]
    four = NodeTopology(4, 4)  # one node of 4 ranks
    assert _planned_payload(shapes, four, "flat", CodecConfig()) == _planned_payload(shapes, four, "flat", CodecConfig(topk=32))
    assert _planned_payload(shapes, four, "flat", CodecConfig()) < _planned_payload(shapes, four, "flat", CodecConfig(topk=64))
    two_by_two = NodeTopology(4, 2)  # 2 nodes of 2: the DeMo workers are the 2 nodes
    assert _planned_payload(shapes, two_by_two, "hierarchical", CodecConfig()) == _planned_payload(
        shapes, two_by_two, "hierarchical", CodecConfig(topk=64))
    assert _planned_payload(shapes, four, "shared", CodecConfig(selection="shared", value_format="bf16")) == _planned_payload(
        shapes, four, "shared", CodecConfig(selection="shared", value_format="bf16", topk=64))


def _one_step(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(128, 256, bias=False)  # 8 tiles of 64 x 64, compressed
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ex = DeMoExchange(opt, DeMoConfig.of(**config), Communicator())
    gen = torch.Generator().manual_seed(rank)
    model(torch.randn(4, 128, generator=gen)).pow(2).sum().backward()
    ex.step()
    opt.step()
    return {"topk": ex.config.codec.topk, "sent": ex.comm.ledger.last_step.sent_bytes,
            "payload": ex.payload_bytes(model.weight), "planned": DeMoConfig.of(**config).codec.for_workers(world)}


def test_three_gloo_workers_resolve_42_and_send_what_the_planner_models(tmp_path: Path) -> None:
    ranks = run_workers(_one_step, 3, tmp_path, {"early_steps": 0})  # the steady state (test_early_phase: the first steps)
    assert {r["topk"] for r in ranks} == {42}
    explicit = run_workers(_one_step, 3, tmp_path / "explicit", {"topk": 42})
    assert [r["sent"] for r in ranks] == [r["sent"] for r in explicit]  # the same bytes as topk=42 given
    model_bytes = sum(r.sent_bytes for r in modeled_collectives([(256, 128)], NodeTopology(3, 3), "flat", CodecConfig()))
    assert ranks[0]["sent"] == model_bytes
    assert ranks[0]["payload"] == CodecConfig(topk=42).payload_bytes((256, 128))
    assert ranks[0]["planned"].topk == 42
