"""Collectives and their byte ledger: the only place ``torch.distributed`` is called."""

from demo_lightning.comm.collectives import CollectiveError, CollectiveWork, Communicator
from demo_lightning.comm.ledger import (
    ByteLedger,
    CollectiveRecord,
    StepTraffic,
    TagTotals,
    ddp_bytes_for,
    ddp_bytes_per_step,
    human_bytes,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
)
from demo_lightning.comm.groups import NodeGroups, build_node_groups
from demo_lightning.comm.topology import Link, NodeTopology

__all__ = [
    "ByteLedger",
    "CollectiveError",
    "CollectiveRecord",
    "CollectiveWork",
    "Communicator",
    "Link",
    "NodeGroups",
    "NodeTopology",
    "StepTraffic",
    "TagTotals",
    "build_node_groups",
    "ddp_bytes_for",
    "ddp_bytes_per_step",
    "human_bytes",
    "ring_all_gather_bytes",
    "ring_all_reduce_bytes",
]
