"""Choosing which DCT coefficients of each tile are shared.

Two rules, both per tile:

* ``"topk"`` (the DeMo paper): the ``k`` coefficients of largest magnitude. Each worker picks its
  own, so their positions travel with the values.
* ``"lowpass"``: a fixed set of the ``k`` lowest frequencies, ordered by ``i + j`` and then ``i``
  (a zig-zag-like order over the tile). Every worker picks the same positions, so no index is
  sent and the values of all workers can be summed by an all-reduce.

The strength is either ``topk`` (coefficients per tile, clamped to the tile size) or
``keep_ratio`` (fraction of each tile, at least one coefficient) — never both.
"""

from __future__ import annotations

import functools
import math
from typing import Literal, Optional, get_args

import torch
from torch import Tensor

from demo_lightning.validation import check_fraction, check_int

__all__ = [
    "SELECTIONS", "Selection", "coefficients_per_tile", "lowpass_order", "lowpass_positions", "select", "validate_strength",
]

Selection = Literal["topk", "lowpass"]
SELECTIONS: tuple[str, ...] = get_args(Selection)


def validate_strength(topk: Optional[int], keep_ratio: Optional[float]) -> None:
    """Check a ``topk`` / ``keep_ratio`` pair, raising ``ValueError`` that names the argument."""
    if topk is not None and keep_ratio is not None:
        raise ValueError(
            f"give either topk (coefficients per chunk) or keep_ratio (fraction of each chunk), not both "
            f"(got topk={topk}, keep_ratio={keep_ratio}); drop one of them"
        )
    if topk is not None:
        check_int("topk", topk, 1, "coefficients kept per chunk")
    if keep_ratio is not None:
        check_fraction("keep_ratio", keep_ratio, "e.g. keep_ratio=0.01 keeps 1% of each chunk")


def coefficients_per_tile(tile_numel: int, topk: Optional[int], keep_ratio: Optional[float]) -> int:
    """Number of coefficients kept in a tile of ``tile_numel`` elements (between 1 and ``tile_numel``)."""
    validate_strength(topk, keep_ratio)
    if topk is not None:
        return min(int(topk), tile_numel)
    if keep_ratio is not None:
        return max(1, min(tile_numel, math.ceil(float(keep_ratio) * tile_numel - 1e-9)))
    raise ValueError("one of topk or keep_ratio must be given")


@functools.lru_cache(maxsize=64)
def _lowpass_order_cpu(tile_rows: int, tile_cols: int) -> Tensor:
    i = torch.arange(tile_rows).repeat_interleave(tile_cols)
    j = torch.arange(tile_cols).repeat(tile_rows)
    return torch.argsort((i + j) * (tile_rows + 1) + i, stable=True)


def lowpass_order(tile_rows: int, tile_cols: int, device: torch.device | str | None = None) -> Tensor:
    """Every flat position of a tile, lowest frequency first (the order ``"lowpass"`` keeps them in)."""
    return _lowpass_order_cpu(tile_rows, tile_cols).to(device if device is not None else "cpu")


@functools.lru_cache(maxsize=256)
def _lowpass_positions_cpu(tile_rows: int, tile_cols: int, k: int) -> Tensor:
    return _lowpass_order_cpu(tile_rows, tile_cols)[:k].sort().values


def lowpass_positions(tile_rows: int, tile_cols: int, k: int, device: torch.device | str | None = None) -> Tensor:
    """Flat positions (row-major, sorted) of the ``k`` lowest frequencies of a tile."""
    if not 1 <= k <= tile_rows * tile_cols:
        raise ValueError(f"k must lie in [1, {tile_rows * tile_cols}], got {k}")
    return _lowpass_positions_cpu(tile_rows, tile_cols, k).to(device if device is not None else "cpu")


def select(coefficients: Tensor, k: int, selection: Selection) -> tuple[Tensor, Tensor]:
    """Select ``k`` coefficients from each tile of ``coefficients`` ``(T, r, c)``.

    Returns:
        ``(positions, values)``, both ``(T, k)``; positions are int64 flat (row-major) indices into
        a tile. For ``"lowpass"`` the positions are the same in every tile.
    """
    if coefficients.dim() != 3:
        raise ValueError(f"select expects coefficients of shape (tiles, rows, cols), got {tuple(coefficients.shape)}")
    n_tiles, rows, cols = coefficients.shape
    flat = coefficients.reshape(n_tiles, rows * cols)
    if not 1 <= k <= rows * cols:
        raise ValueError(f"k must lie in [1, {rows * cols}], got {k}")
    if selection == "topk":
        positions = torch.topk(flat.abs(), k, dim=1, sorted=False).indices
    elif selection == "lowpass":
        positions = lowpass_positions(rows, cols, k, flat.device).expand(n_tiles, k)
    else:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    return positions, torch.gather(flat, 1, positions)
