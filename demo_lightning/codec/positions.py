"""How a tile's selected positions are coded on the wire: fixed-width indices or Elias-Fano.

A worker that sends its own top-k sends, per tile of ``n`` elements, ``k`` distinct positions in
``[0, n)``. Two codings, both of a fixed size per tile (every rank knows every payload's size from
``k`` and ``n`` alone, which the all-gather needs):

``"packed"``
    each position in ``ceil(log2 n)`` bits, in the order given: ``k ceil(log2 n)`` bits a tile (12
    bits a position for a 64 x 64 tile).

``"elias_fano"``
    the Elias-Fano code of the sorted positions (Elias 1974, Fano 1971; as in succinct indexes, e.g.
    Vigna, "Quasi-succinct indices", WSDM 2013): with ``L = floor(log2(n / k))`` (0 when ``k >= n /
    2``), each position ``p_i`` (ascending) is split into its low ``L`` bits, written as they are, and
    its high part ``h_i = p_i >> L``, written in unary as the set bits ``h_i + i`` of a bit vector of
    ``U = k + ((n - 1) >> L) + 1`` bits. A tile takes ``k L + U`` bits, at most about ``k (2 +
    log2(n / k))``: within two bits a position of the information-theoretic minimum ``log2 C(n, k)``.
    For a 64 x 64 tile: 9 bits a position at k 32 (against 12), 8 at k 64, 6 at k 256. Decoding
    returns the positions in ascending order, so the values travel in that order too
    (:func:`~demo_lightning.codec.packing.pack_segments`' ``wire_order``; the scales are computed
    before the reordering, so nothing decoded differs from the fixed width's).

Where Elias-Fano would take more bits than the fixed width (a few positions in a big tile: ``k = 1``
of 4,096 takes 14 bits against 12), :func:`position_bits` keeps the fixed width for that ``(k, n)``:
the choice depends on ``k`` and ``n`` only, so every rank makes the same one. :func:`position_coding`
says which.

Failure behaviour: the encoders do not check their input (a sync on an accelerator); positions
outside ``[0, n)`` or, for Elias-Fano, not strictly ascending per tile decode to other positions.
The exchange's selection produces valid ones by construction (distinct positions; the packer sorts
them); the tests check every coding's round trip.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "POSITION_FORMATS",
    "PositionFormat",
    "elias_fano_bits",
    "elias_fano_decode",
    "elias_fano_encode",
    "elias_fano_low_bits",
    "index_bits",
    "position_bits",
    "position_coding",
]

PositionFormat = Literal["packed", "elias_fano"]
"""How each tile's ``k`` positions travel: fixed-width indices, or Elias-Fano where it is smaller."""
POSITION_FORMATS: tuple[str, ...] = get_args(PositionFormat)


def index_bits(tile_numel: int) -> int:
    """Narrowest bit width that holds every flat index of a tile of ``tile_numel`` elements."""
    if tile_numel < 1:
        raise ValueError(f"tile_numel must be >= 1, got {tile_numel}")
    return max(1, math.ceil(math.log2(tile_numel)))


def _check_k(k: int, tile_numel: int) -> None:
    if not 1 <= k <= tile_numel:
        raise ValueError(f"k must lie in [1, tile_numel={tile_numel}] (distinct positions of one tile), got {k}")


def elias_fano_low_bits(k: int, tile_numel: int) -> int:
    """``L = floor(log2(n / k))`` for ``k`` positions of ``[0, n)``, 0 when ``k > n / 2``."""
    _check_k(k, tile_numel)
    return (tile_numel // k).bit_length() - 1


def elias_fano_bits(k: int, tile_numel: int) -> int:
    """Bits of the Elias-Fano code of ``k`` positions of ``[0, n)``: ``k L + k + ((n - 1) >> L) + 1``."""
    low = elias_fano_low_bits(k, tile_numel)
    return k * low + k + ((tile_numel - 1) >> low) + 1


def position_coding(k: int, tile_numel: int, position_format: PositionFormat) -> PositionFormat:
    """The coding a tile of ``k`` of ``tile_numel`` positions travels in under ``position_format``:
    ``"elias_fano"`` only where it is strictly smaller than the fixed width."""
    if position_format not in POSITION_FORMATS:
        raise ValueError(f"position_format must be one of {POSITION_FORMATS}, got {position_format!r}")
    if position_format == "elias_fano" and elias_fano_bits(k, tile_numel) < k * index_bits(tile_numel):
        return "elias_fano"
    return "packed"


def position_bits(k: int, tile_numel: int, position_format: PositionFormat = "packed") -> int:
    """Bits one tile's ``k`` positions take on the wire under ``position_format``."""
    _check_k(k, tile_numel)
    if position_coding(k, tile_numel, position_format) == "elias_fano":
        return elias_fano_bits(k, tile_numel)
    return k * index_bits(tile_numel)


def elias_fano_encode(positions: Tensor, tile_numel: int) -> Tensor:
    """The Elias-Fano bits of each row of strictly ascending ``positions`` ``(R, k)`` in ``[0, n)``:
    ``(R, elias_fano_bits(k, n))`` int64 zeros and ones, per row the ``k L`` low bits (position by
    position, least significant first) then the ``U``-bit upper vector."""
    rows, k = positions.shape
    low_bits = elias_fano_low_bits(k, tile_numel)
    pos = positions.to(torch.int64)
    upper_len = elias_fano_bits(k, tile_numel) - k * low_bits
    upper = torch.zeros(rows, upper_len, dtype=torch.int64, device=pos.device)
    ranks = torch.arange(k, dtype=torch.int64, device=pos.device)
    upper.scatter_(1, (pos >> low_bits) + ranks, 1)
    if low_bits == 0:
        return upper
    shifts = torch.arange(low_bits, dtype=torch.int64, device=pos.device)
    low = ((pos.unsqueeze(-1) >> shifts) & 1).reshape(rows, k * low_bits)
    return torch.cat([low, upper], dim=1)


def elias_fano_decode(bits: Tensor, k: int, tile_numel: int) -> Tensor:
    """Inverse of :func:`elias_fano_encode`: ``bits`` ``(R, elias_fano_bits(k, n))`` (any integer or
    bool dtype) to the positions ``(R, k)`` int64, ascending per row. No data-dependent shapes (no
    host sync): the upper vector's set bits are found by a running count and one scatter."""
    rows = bits.shape[0]
    low_bits = elias_fano_low_bits(k, tile_numel)
    bits = bits.to(torch.int64)
    upper = bits[:, k * low_bits:]
    # the k set bits' indices, ascending: the i-th one (by a running count) lands in column i; the zeros
    # go to a spare column k, dropped
    column = torch.where(upper.bool(), upper.cumsum(dim=1) - 1, k)
    where = torch.arange(upper.shape[1], dtype=torch.int64, device=bits.device).expand_as(upper)
    set_at = torch.zeros(rows, k + 1, dtype=torch.int64, device=bits.device).scatter_(1, column, where)[:, :k]
    high = set_at - torch.arange(k, dtype=torch.int64, device=bits.device)
    if low_bits == 0:
        return high
    weights = 1 << torch.arange(low_bits, dtype=torch.int64, device=bits.device)
    low = (bits[:, : k * low_bits].view(rows, k, low_bits) * weights).sum(dim=2)
    return (high << low_bits) | low
