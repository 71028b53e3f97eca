"""Process groups of a node hierarchy: this rank's node, and its peers of the same local index.

For ``W = N * G`` ranks numbered node-major (:class:`~demo_lightning.comm.topology.NodeTopology`):

* the intra-node group of node ``n``: ranks ``[n*G + i for i in range(G)]`` (the fast link);
* the inter-node group of local index ``i``: ranks ``[n*G + i for n in range(N)]`` (one rank per
  node: the slow link, each of the node's ranks on its own share of it).

Creating a group is a collective over the default group: every rank must call
:func:`build_node_groups` at the same point with the same topology (it creates all ``N + G`` groups
on every rank, members or not, in the same order). :meth:`NodeGroups.destroy` releases this rank's
two groups (before the default group goes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from demo_lightning.comm.topology import NodeTopology

__all__ = ["NodeGroups", "build_node_groups"]


@dataclass
class NodeGroups:
    """This rank's place in a node hierarchy and its two process groups."""

    topology: NodeTopology
    rank: int
    intra: Optional[dist.ProcessGroup]
    inter: Optional[dist.ProcessGroup]

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank_of(self.rank)

    @property
    def node(self) -> int:
        return self.topology.node_of(self.rank)

    @property
    def ranks_per_node(self) -> int:
        return self.topology.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.topology.num_nodes

    def destroy(self) -> None:
        """Destroy this rank's two groups (idempotent; a no-op without a process group)."""
        if dist.is_available() and dist.is_initialized():
            for group in (self.intra, self.inter):
                if group is not None:
                    dist.destroy_process_group(group)
        self.intra = self.inter = None


def build_node_groups(topology: NodeTopology) -> NodeGroups:
    """Create the intra- and inter-node groups of ``topology`` (a collective: every rank calls it).

    Raises ``ValueError`` if no process group is initialised or its size is not ``topology``'s.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("build_node_groups needs an initialised default process group (torch.distributed.init_process_group)")
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"the topology has {topology.world_size} ranks, the default process group {dist.get_world_size()}")
    rank = dist.get_rank()
    intra, _ = dist.new_subgroups_by_enumeration([topology.node_ranks(n) for n in range(topology.num_nodes)])
    inter, _ = dist.new_subgroups_by_enumeration([topology.peer_ranks(i) for i in range(topology.ranks_per_node)])
    return NodeGroups(topology, rank, intra, inter)
