"""Which ranks share a node: the link classes of a collective, and the groups of a node hierarchy.

A job of ``W = N * G`` ranks on ``N`` nodes of ``G`` ranks each, numbered node-major (rank
``n * G + i`` is local rank ``i`` of node ``n``; torchrun, SLURM and Lightning number them so).
Two link classes:

* ``"intra"``: between ranks of one node (NVLink, PCIe, shared memory: fast);
* ``"inter"``: between nodes (the network: slow, and shared by the node's ``G`` ranks).

Bytes on the inter-node link, per rank, for one ring collective over a group: the ring visits the
group's members in rank order, so it leaves and enters each node once; every ring edge carries the
same bytes (``(W_g - 1) P`` for an all-gather of ``P`` per rank, ``2 (W_g - 1) / W_g * B`` for an
all-reduce of ``B``), so the node's link carries what one member sends, and each of the ``m``
members of the group on this node is charged ``1 / m`` of its own sent bytes
(:meth:`NodeTopology.inter_share`). A group inside one node charges nothing to the inter-node link.
DDP's gradient all-reduce over all ``W`` ranks (NCCL's ring ordered by node) is charged the same
way: ``1 / G`` of its bytes per rank, about 8 bytes per fp32 parameter on every node's link.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Link", "NodeTopology", "split_by_payload"]

Link = Literal["intra", "inter"]


@dataclass(frozen=True)
class NodeTopology:
    """``world_size`` ranks on nodes of ``ranks_per_node`` each, numbered node-major.

    Raises ``ValueError`` unless both are positive integers and ``ranks_per_node`` divides
    ``world_size`` (nodes of different sizes are not supported).
    """

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NodeTopology {name} must be a positive integer, got {value!r}")
        if self.world_size % self.ranks_per_node:
            raise ValueError(
                f"NodeTopology: {self.world_size} ranks do not split into nodes of {self.ranks_per_node}; every node "
                "must run the same number of processes (devices per node)"
            )

    @classmethod
    def from_ranks(cls, rows: Sequence[Sequence[int]]) -> "NodeTopology":
        """The topology of ranks that reported ``(global_rank, node_rank, local_rank, processes_per_node)``
        (every rank's row, in any order).

        Raises ``ValueError`` naming the nodes and their sizes if the nodes run different numbers of
        processes (or a node's count disagrees with what its ranks were told), and naming the ranks
        if they are not numbered node-major (``global_rank == node_rank * G + local_rank``).
        """
        per_node: dict[int, int] = {}
        told: dict[int, set[int]] = {}
        for _, node, _, local_world in rows:
            per_node[node] = per_node.get(node, 0) + 1
            told.setdefault(node, set()).add(local_world)
        if len(set(per_node.values())) > 1 or any(told[n] != {per_node[n]} for n in per_node):
            counts = ", ".join(f"node {n}: {per_node[n]}" for n in sorted(per_node))
            raise ValueError(
                f"the nodes run different numbers of processes ({counts}); every node must run the same number: launch "
                "every node with the same --nproc-per-node (Trainer(devices=...)) and the same num_nodes"
            )
        ranks_per_node = next(iter(per_node.values()))
        misplaced = sorted(r for r, node, local, _ in rows if r != node * ranks_per_node + local)
        if misplaced:
            raise ValueError(
                f"rank(s) {misplaced} are not numbered node-major (global_rank == node_rank * {ranks_per_node} + local_rank), "
                "which the link classes and hierarchy='node' assume; check the launcher's NODE_RANK / GROUP_RANK"
            )
        return cls(len(rows), ranks_per_node)

    @classmethod
    def single_node(cls, world_size: int) -> "NodeTopology":
        """Every rank on one node (every link intra-node)."""
        return cls(world_size, world_size)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of node ``node`` (an intra-node group)."""
        return [node * self.ranks_per_node + i for i in range(self.ranks_per_node)]

    def peer_ranks(self, local_rank: int) -> list[int]:
        """Local rank ``local_rank`` of every node (an inter-node group)."""
        return [n * self.ranks_per_node + local_rank for n in range(self.num_nodes)]

    def link_of(self, ranks: Sequence[int]) -> Link:
        """``"inter"`` if the ranks span more than one node, else ``"intra"``."""
        return "inter" if len({self.node_of(r) for r in ranks}) > 1 else "intra"

    def inter_share(self, ranks: Sequence[int], rank: int) -> float:
        """The fraction of ``rank``'s sent bytes in a ring collective over ``ranks`` that is charged to
        the inter-node link: ``1 / m`` for ``m`` members on ``rank``'s node when the group spans
        nodes, ``0`` when it does not (see the module docstring)."""
        if self.link_of(ranks) == "intra":
            return 0.0
        node = self.node_of(rank)
        return 1.0 / sum(1 for r in ranks if self.node_of(r) == node)

    def ddp_inter_node_bytes(self, ddp_bytes: float) -> float:
        """DDP's all-reduce bytes per rank that cross the inter-node link (``ddp_bytes / G`` on more than one node)."""
        return ddp_bytes / self.ranks_per_node if self.num_nodes > 1 else 0.0


def split_by_payload(payloads: Sequence[int], ranks: int) -> list[int]:
    """Which of ``ranks`` local ranks exchanges each tensor under a node hierarchy: tensors in
    decreasing payload (ties: earlier first) each go to the rank with the least payload so far
    (ties: the lowest). Payloads alone decide it, so every rank computes the same split."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer (local ranks per node), got {ranks!r}")
    load = [0] * ranks
    owners = [0] * len(payloads)
    for i in sorted(range(len(payloads)), key=lambda i: (-payloads[i], i)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += payloads[i]
    return owners
