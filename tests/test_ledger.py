"""Byte ledger: wire models, per-step windows and totals."""

from __future__ import annotations

import pytest

from demo_lightning.comm import ByteLedger, Communicator, ddp_bytes_per_step, ring_all_gather_bytes, ring_all_reduce_bytes


def test_ring_models() -> None:
    assert ring_all_gather_bytes(100, 1) == 0
    assert ring_all_gather_bytes(100, 4) == 300
    assert ring_all_reduce_bytes(400, 2) == 400
    assert ring_all_reduce_bytes(400, 4) == 600
    assert ddp_bytes_per_step(1000, 2) == 4000


def test_records_totals_and_step_window() -> None:
    ledger = ByteLedger(rank=1)
    ledger.record("broadcast", "setup", 80, world_size=4, root=0)
    ledger.begin_step()
    ledger.record("all_gather", "demo/topk", 100, world_size=4)
    ledger.record("all_reduce", "demo/dense", 40, world_size=4)
    step = ledger.end_step(ddp_bytes=6000)
    assert step.calls == 2 and step.payload_bytes == 140
    assert step.sent_bytes == 300 + 60 and step.received_bytes == 300 + 60
    assert step.ratio_vs_ddp == pytest.approx(6000 / 360)
    assert ledger.totals["setup"].received_bytes == 80 and ledger.totals["setup"].sent_bytes == 80
    assert ledger.total_payload_bytes == 220
    root = ByteLedger(rank=0)
    root.record("broadcast", "setup", 80, world_size=4, root=0)
    assert root.totals["setup"].received_bytes == 0
    last = ByteLedger(rank=3)
    last.record("broadcast", "setup", 80, world_size=4, root=0)
    assert last.totals["setup"].sent_bytes == 0


def test_single_process_communicator_is_identity_and_recorded() -> None:
    import torch

    comm = Communicator()
    buf = torch.arange(10, dtype=torch.uint8)
    gathered = comm.all_gather_bytes(buf, "t")
    assert gathered.is_completed()  # no process group: nothing to wait for
    assert gathered.wait()[0] is buf and gathered.wait()[0] is buf  # wait() is idempotent
    x = torch.ones(3)
    reduced = comm.all_reduce_sum_(x, "r")
    assert reduced.is_completed() and reduced.wait() is x and torch.equal(x, torch.ones(3))
    assert comm.ledger.total_payload_bytes == 10 + 12
    assert comm.ledger.total_sent_bytes == 0
    with pytest.raises(ValueError, match="uint8"):
        comm.all_gather_bytes(torch.ones(2), "t")


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"), (1, "1 B"), (999, "999 B"), (999.4, "999 B"), (999.6, "1.0 kB"), (1000, "1.0 kB"),
        (62425, "62.4 kB"), (62425.0, "62.4 kB"), (999_949, "999.9 kB"), (999_960, "1.0 MB"), (1.5e6, "1.5 MB"),
        (2.34e9, "2.3 GB"), (7.5e12, "7.5 TB"), (3e15, "3000.0 TB"),
    ],
)
def test_human_bytes_uses_decimal_si_units(nbytes: float, text: str) -> None:
    from demo_lightning.comm.ledger import human_bytes

    assert human_bytes(nbytes) == text


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "62425", None])
def test_human_bytes_rejects_what_is_not_a_byte_count(bad: object) -> None:
    from demo_lightning.comm.ledger import human_bytes

    with pytest.raises(ValueError, match="byte count"):
        human_bytes(bad)  # type: ignore[arg-type]


def test_node_topology_groups_links_and_inter_node_shares() -> None:
    from demo_lightning.comm import NodeTopology

    topo = NodeTopology(8, 4)
    assert topo.num_nodes == 2 and topo.node_of(5) == 1 and topo.local_rank_of(5) == 1
    assert topo.node_ranks(1) == [4, 5, 6, 7] and topo.peer_ranks(2) == [2, 6]
    every = list(range(8))
    assert topo.link_of(every) == "inter" and topo.link_of([4, 5]) == "intra" and topo.link_of([1, 5]) == "inter"
    # a ring over all 8 ranks leaves each node once: each of the node's 4 members is charged 1/4 of its bytes
    assert topo.inter_share(every, 3) == 0.25 and topo.inter_share([1, 5], 1) == 1.0 and topo.inter_share([4, 5, 6], 5) == 0.0
    assert topo.ddp_inter_node_bytes(800.0) == 200.0 and NodeTopology.single_node(4).ddp_inter_node_bytes(800.0) == 0.0
    with pytest.raises(ValueError, match="same number of processes"):
        NodeTopology(6, 4)
    with pytest.raises(ValueError, match="positive integer"):
        NodeTopology(4, 0)


def test_ledger_splits_each_record_by_link_and_models_two_links() -> None:
    from demo_lightning.callbacks.communication_monitor import ddp_link_seconds, link_seconds

    ledger = ByteLedger(rank=0)
    ledger.begin_step()
    flat = ledger.record("all_gather", "demo/topk", 100, world_size=8, link="inter", inter_share=0.25)
    inside = ledger.record("all_reduce", "demo/node_reduce", 400, world_size=4, link="intra")
    step = ledger.end_step(ddp_bytes=7000.0, ddp_inter_node_bytes=1750.0)
    assert flat.sent_bytes == 700 and flat.inter_node_bytes == 175 and flat.intra_node_bytes == 525
    assert inside.inter_node_bytes == 0 and inside.intra_node_bytes == 600
    assert step.inter_node_bytes == 175 and step.intra_node_bytes == 700 + 600 - 175
    assert step.inter_node_ratio_vs_ddp == 10.0 and ledger.cumulative_inter_node_ratio_vs_ddp == 10.0
    assert ledger.payload_by_link == {"inter": 100, "intra": 400}
    # the node's 4 ranks share its inter-node link: 4 x 175 bytes at 1 Gbit/s; the rest on 8 Gbit/s; 7 + 6 hops of 1 ms
    expected = 4 * 175 * 8 / 1e9 + (525 + 600) * 8 / 8e9 + 13 * 1e-3
    assert link_seconds([flat, inside], 4, 1.0, 8.0, 1e-3) == pytest.approx(expected)
    # DDP: one bucket, a ring over 8 ranks (14 hops); 1750 of its 7000 bytes per rank on the node's link
    assert ddp_link_seconds(7000.0, 1750.0, 1000, 8, 4, 1.0, 8.0, 1e-3) == pytest.approx(14e-3 + 4 * 1750 * 8 / 1e9 + 5250 * 8 / 8e9)
    with pytest.raises(ValueError, match="inter_share"):
        ledger.record("all_gather", "x", 1, world_size=2, inter_share=1.5)


def test_communicator_refuses_a_topology_of_another_size() -> None:
    from demo_lightning.comm import NodeTopology

    with pytest.raises(ValueError, match="topology describes 4 ranks"):
        Communicator(topology=NodeTopology(4, 2))


def test_monitor_two_link_arguments_go_together() -> None:
    from demo_lightning.callbacks import CommunicationMonitor

    with pytest.raises(ValueError, match="inter_gbps and intra_gbps go together"):
        CommunicationMonitor(inter_gbps=10)
    with pytest.raises(ValueError, match="intra_gbps"):
        CommunicationMonitor(inter_gbps=10, intra_gbps=0)


def test_topology_from_every_ranks_report() -> None:
    from demo_lightning.comm import NodeTopology

    rows = [(r, r // 2, r % 2, 2) for r in range(6)]
    assert NodeTopology.from_ranks(rows[::-1]) == NodeTopology(6, 2)
    uneven = [(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 1)]
    with pytest.raises(ValueError, match=r"different numbers of processes \(node 0: 2, node 1: 1\)"):
        NodeTopology.from_ranks(uneven)
    shuffled = [(0, 0, 0, 2), (1, 1, 0, 2), (2, 0, 1, 2), (3, 1, 1, 2)]
    with pytest.raises(ValueError, match=r"rank\(s\) \[1, 2\] are not numbered node-major"):
        NodeTopology.from_ranks(shuffled)
