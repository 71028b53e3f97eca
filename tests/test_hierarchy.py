"""The node hierarchy without Lightning: 4 gloo processes posing as 2 nodes of 2 (``NodeTopology(4, 2)``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from demo_lightning.algorithms import DeMoConfig, DeMoExchange
from demo_lightning.comm import Communicator, NodeTopology, build_node_groups

from dist_helpers import run_workers, tensor_hash

pytestmark = pytest.mark.timeout(240)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 10))


def _run(rank: int, world: int, split_at: int, steps: int) -> dict[str, Any]:
    """``steps`` exchanges; at ``split_at`` the state is saved and a fresh exchange (a resumed run) takes over."""
    groups = build_node_groups(NodeTopology(world, 2))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = DeMoConfig.of(topk=8, dense_below=200, value_format="bf16")
    comm = Communicator(topology=NodeTopology(world, 2))
    exchange = DeMoExchange(opt, config, comm, node_groups=groups)
    hashes, state = [], None
    for step in range(steps):
        if step == split_at:
            state = exchange.state_dict()
            exchange.remove()
            exchange = DeMoExchange(opt, config, comm, node_groups=groups)
            exchange.load_state_dict(state)
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        exchange.step()
        opt.step()
        hashes.append(tensor_hash(torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    owners = exchange.owners()
    groups.destroy()
    return {
        "hashes": hashes, "owners": owners, "local": rank % 2,
        "held": [exchange.has_momentum(p) for p in model.parameters()],
        "saved": sorted(int(i) for i in (state or exchange.state_dict())["momentum"]["momenta"]),
        "momenta": [tensor_hash(exchange.momentum(p)) for p in model.parameters()],
    }


def test_every_rank_of_both_nodes_applies_the_same_update_and_keeps_only_its_share(tmp_path: Path) -> None:
    ranks = run_workers(_run, 4, tmp_path, -1, 4)
    assert all(r["hashes"] == ranks[0]["hashes"] for r in ranks) and len(set(ranks[0]["hashes"])) == 4
    owners = ranks[0]["owners"]
    assert all(r["owners"] == owners for r in ranks) and set(owners) == {0, 1}  # the same split everywhere, both used
    for r in ranks:  # momenta of its own share only, also in its checkpoint state
        assert r["held"] == [o == r["local"] for o in owners]
        assert r["saved"] == [i for i, o in enumerate(owners) if o == r["local"]]
    # each share's momentum differs between the nodes (each node's own gradients), as DeMo's workers' do
    assert ranks[0]["momenta"] != ranks[2]["momenta"]


def test_a_resumed_exchange_continues_bitwise(tmp_path: Path) -> None:
    straight = run_workers(_run, 4, tmp_path / "straight", -1, 5)
    resumed = run_workers(_run, 4, tmp_path / "resumed", 3, 5)
    for a, b in zip(straight, resumed):
        assert a["hashes"] == b["hashes"] and a["momenta"] == b["momenta"]
