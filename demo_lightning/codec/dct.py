"""Orthonormal DCT-II basis and the separable 2-D transform of tiles.

DeMo (Peng, Quesnelle, Kingma, arXiv 2411.19870) moves each worker's momentum into a frequency
domain with a chunked DCT-II before choosing what to share. The basis is built in closed form,

    C[k, n] = sqrt(2 / N) * cos(pi * (2n + 1) * k / (2N)),   row k = 0 scaled by 1 / sqrt(2),

which makes ``C`` orthonormal (``C @ C.T == I``), so the inverse transform is ``C.T``. A tile
``X`` of shape ``(r, c)`` is transformed as ``C_r @ X @ C_c.T``; a size-1 basis is ``[[1.0]]``, so
1-D chunks (tiles of one row) use the same code path as 2-D tiles.

The basis is computed in float64 and cast once; it is cached per (size, dtype, device).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

__all__ = ["dct_basis", "dct2", "idct2"]


@functools.lru_cache(maxsize=128)
def _cached_basis(size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    n = torch.arange(size, dtype=torch.float64)
    k = n.unsqueeze(1)
    basis = math.sqrt(2.0 / size) * torch.cos(math.pi * (2.0 * n + 1.0) * k / (2.0 * size))
    basis[0] /= math.sqrt(2.0)
    return basis.to(dtype=dtype, device=device).contiguous()


def dct_basis(size: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """Return the orthonormal DCT-II matrix of ``size`` x ``size`` (cached; do not modify in place).

    Args:
        size: transform length, at least 1.
        dtype: floating dtype of the returned matrix.
        device: device of the returned matrix (CPU by default).

    Raises:
        ValueError: if ``size`` < 1 or ``dtype`` is not floating point.
    """
    if size < 1:
        raise ValueError(f"dct_basis: size must be >= 1, got {size}")
    if not dtype.is_floating_point:
        raise ValueError(f"dct_basis: dtype must be floating point, got {dtype}")
    return _cached_basis(int(size), dtype, torch.device(device if device is not None else "cpu"))


def _separable(tiles: Tensor, left: Tensor, right_t: Tensor) -> Tensor:
    """``left @ tile @ right_t`` for every tile; the right product runs as one flat GEMM (faster than batched)."""
    n_tiles, rows, cols = tiles.shape
    out = (tiles.reshape(n_tiles * rows, cols) @ right_t).view(n_tiles, rows, cols)
    return out if rows == 1 else torch.matmul(left, out)


def dct2(tiles: Tensor) -> Tensor:
    """Separable 2-D DCT-II of a batch of tiles ``(T, r, c)`` -> coefficients ``(T, r, c)``."""
    rows = dct_basis(tiles.shape[-2], tiles.dtype, tiles.device)
    cols = dct_basis(tiles.shape[-1], tiles.dtype, tiles.device)
    return _separable(tiles, rows, cols.T)


def idct2(coefficients: Tensor) -> Tensor:
    """Inverse of :func:`dct2`: coefficients ``(T, r, c)`` -> tiles ``(T, r, c)``."""
    rows = dct_basis(coefficients.shape[-2], coefficients.dtype, coefficients.device)
    cols = dct_basis(coefficients.shape[-1], coefficients.dtype, coefficients.device)
    return _separable(coefficients, rows.T, cols)
