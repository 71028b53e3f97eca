"""Cutting any tensor into equal DCT tiles, and putting it back together.

Every tensor is first viewed as a matrix: 0-D as ``(1, 1)``, 1-D as ``(1, n)``, N-D (conv
weights and the like) as ``(shape[0], prod(shape[1:]))``. Each matrix dimension ``d`` is cut into
tiles of ``min(chunk, d)`` and padded with zeros up to a multiple of that tile. This differs from
the DeMo reference, which picks the largest divisor of ``d`` not above ``chunk``: a prime
dimension there degenerates to tiles of 1 (no compression) and N-D weights fail. Here a prime
dimension of 127 with ``chunk=64`` is padded to 128 and cut into two 64-long tiles.

Padding only ever adds zeros on the way in; :func:`from_tiles` crops it on the way out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TileLayout", "plan_tiles", "to_tiles", "from_tiles"]


@dataclass(frozen=True)
class TileLayout:
    """How one tensor shape maps onto ``n_tiles`` tiles of ``tile_rows`` x ``tile_cols``."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    tile_rows: int
    tile_cols: int

    @property
    def padded_rows(self) -> int:
        return math.ceil(self.rows / self.tile_rows) * self.tile_rows

    @property
    def padded_cols(self) -> int:
        return math.ceil(self.cols / self.tile_cols) * self.tile_cols

    @property
    def n_tiles(self) -> int:
        return (self.padded_rows // self.tile_rows) * (self.padded_cols // self.tile_cols)

    @property
    def tile_numel(self) -> int:
        return self.tile_rows * self.tile_cols

    @property
    def tile_shape(self) -> tuple[int, int]:
        return (self.tile_rows, self.tile_cols)

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def plan_tiles(shape: torch.Size | tuple[int, ...], chunk: int) -> TileLayout:
    """Plan the tiling of a tensor of ``shape`` with tiles of at most ``chunk`` per dimension.

    Raises:
        ValueError: if ``chunk`` < 1 or the shape has a zero-sized dimension.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    shape = tuple(int(s) for s in shape)
    if any(s == 0 for s in shape):
        raise ValueError(f"cannot tile an empty tensor of shape {shape}")
    if len(shape) == 0:
        rows, cols = 1, 1
    elif len(shape) == 1:
        rows, cols = 1, shape[0]
    else:
        rows, cols = shape[0], math.prod(shape[1:])
    return TileLayout(shape=shape, rows=rows, cols=cols, tile_rows=min(chunk, rows), tile_cols=min(chunk, cols))


def to_tiles(x: Tensor, layout: TileLayout, out: Tensor | None = None) -> Tensor:
    """View ``x`` as a matrix, zero-pad it and return its tiles as ``(n_tiles, tile_rows, tile_cols)``.

    With ``out`` (a contiguous tensor of that shape) the tiles are written there, in one copy.
    """
    if tuple(x.shape) != layout.shape:
        raise ValueError(f"to_tiles: tensor of shape {tuple(x.shape)} does not match layout shape {layout.shape}")
    matrix = x.reshape(layout.rows, layout.cols)
    pad_rows, pad_cols = layout.padded_rows - layout.rows, layout.padded_cols - layout.cols
    if pad_rows or pad_cols:
        matrix = F.pad(matrix, (0, pad_cols, 0, pad_rows))
    tr, tc = layout.tile_rows, layout.tile_cols
    grid = matrix.reshape(layout.padded_rows // tr, tr, layout.padded_cols // tc, tc).permute(0, 2, 1, 3)
    if out is None:
        return grid.reshape(-1, tr, tc)
    out.view(grid.shape).copy_(grid)
    return out


def from_tiles(tiles: Tensor, layout: TileLayout) -> Tensor:
    """Inverse of :func:`to_tiles`: reassemble, crop the padding and restore the original shape."""
    tr, tc = layout.tile_rows, layout.tile_cols
    grid_rows, grid_cols = layout.padded_rows // tr, layout.padded_cols // tc
    if tiles.shape != (grid_rows * grid_cols, tr, tc):
        raise ValueError(f"from_tiles: expected tiles of shape {(grid_rows * grid_cols, tr, tc)}, got {tuple(tiles.shape)}")
    matrix = tiles.reshape(grid_rows, grid_cols, tr, tc).permute(0, 2, 1, 3).reshape(layout.padded_rows, layout.padded_cols)
    return matrix[: layout.rows, : layout.cols].reshape(layout.shape)
