"""Shared positions (``selection="shared"``): one worker's top-k positions, broadcast to every worker.

ScaleCom's cyclic local top-k (CLT-k; Chen et al., "ScaleCom: Scalable Sparsified Gradient
Compression for Communication-Efficient Distributed Training", NeurIPS 2020): at exchange ``t`` the
leader ``t mod W`` (a rank of the exchange's group) chooses, per tile, the ``k`` coefficients of
largest magnitude of its own momentum; the positions are broadcast and every worker sends its own
values at them. Because every worker's values sit at the same positions they can be summed by an
all-reduce, whose bytes per worker (``2 (W - 1) / W`` of the values) do not grow with ``W``; the
broadcast of the positions costs each worker at most their size once. Momentum is correlated across
workers (they follow the same loss), so one worker's largest components are largely the others'
too; what a worker's own top-k would have sent stays in its residual (error feedback) and the
rotation lets each worker lead in turn.

Wire format: per tensor (in plan order), its ``n_tiles * k`` positions bit-packed at
``ceil(log2(tile_numel))`` bits, byte-aligned per tensor (:func:`~demo_lightning.codec.pack_bits`),
as in a top-k segment; one ``uint8`` broadcast per exchange.

Failure: a broadcast that does not complete raises :class:`~demo_lightning.comm.CollectiveError`
from :func:`broadcast_positions` after the process group's timeout.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from demo_lightning.algorithms.stages.plan import ExchangePlan
from demo_lightning.codec import index_bits, pack_bits, positions_nbytes, unpack_bits
from demo_lightning.comm import Communicator

__all__ = ["broadcast_positions"]


def broadcast_positions(
    plan: ExchangePlan, chosen: Optional[dict[object, Tensor]], communicator: Communicator, leader: int,
    tag: str, group: Optional[dist.ProcessGroup] = None,
) -> dict[object, Tensor]:
    """Every family's ``(n_tiles, k)`` positions as the ``leader`` chose them.

    The leader (rank ``leader`` of ``group``; ``None``: the communicator's own) passes ``chosen``
    (its positions per family key); every other rank passes ``None``. One broadcast; every rank
    returns the same positions (int64, on the families' devices)."""
    families = list(plan.families.values())
    sizes = [[positions_nbytes(m.n_tiles, f.k, f.tile_numel) for m in f.members] for f in families]
    device = communicator.device
    if chosen is not None:
        parts = [
            pack_bits(chosen[f.key][m.rows].reshape(-1), index_bits(f.tile_numel)).to(device)
            for f in families for m in f.members
        ]
        buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    else:
        buffer = torch.empty(sum(map(sum, sizes)), dtype=torch.uint8, device=device)
    buffer = communicator.broadcast_(buffer, tag, src=leader, group=group).wait()
    out: dict[object, Tensor] = {}
    offset = 0
    for f, member_sizes in zip(families, sizes):
        bits = index_bits(f.tile_numel)
        rows = []
        for m, n in zip(f.members, member_sizes):
            rows.append(unpack_bits(buffer[offset : offset + n], bits, m.n_tiles * f.k).view(m.n_tiles, f.k))
            offset += n
        out[f.key] = torch.cat(rows).to(f.device)
    return out
