"""The orthonormal transforms a tile can be coded in: DCT-II, Haar wavelets, or none.

Every transform here is separable: one orthonormal ``n x n`` matrix ``B_n`` per tile side, and a
tile ``X`` (``r x c``) has the coefficients ``B_r X B_c^T`` (inverse ``B_r^T K B_c``). The exchange
runs them through the same fused GEMMs (:mod:`~demo_lightning.codec.transform`), the same selection
and the same error feedback; only the matrix differs:

* ``"dct"`` (the DeMo paper): the DCT-II basis of :func:`~demo_lightning.codec.dct_basis`; row
  ``k`` is frequency ``k``.
* ``"haar"`` (seed 000 §7: wavelets instead of the DCT): the Haar wavelet basis of
  :func:`haar_basis`, rows ordered coarse to fine. For ``n = 2^L`` it is the standard orthonormal
  multi-level Haar matrix,

      h_0(t) = 1 / sqrt(n),
      h_{2^p + q}(t) = sqrt(2^p / n) * (+1 on [q n / 2^p, (q + 1/2) n / 2^p), -1 on [(q + 1/2) n / 2^p, (q + 1) n / 2^p), 0 elsewhere)

  for ``p = 0 .. L - 1`` and ``q = 0 .. 2^p - 1`` (``t = 0 .. n - 1``): the full ``L``-level Haar
  transform, ``pywt.wavedec(x, "haar", mode="periodization")`` concatenated as ``[cA_L, cD_L, ...,
  cD_1]``. For any other ``n`` (a tile side below ``chunk``, or a ``chunk`` that is not a power of
  two) it is the unbalanced Haar basis (Girardi and Sweldens, 1997) of the same recursion: a segment
  of length ``L >= 2`` is split into its first ``ceil(L / 2)`` and last ``floor(L / 2)`` points, and
  contributes the detail row that is ``+sqrt(L2 / (L1 L))`` on the first part and ``-sqrt(L1 / (L2 L))``
  on the second (``L1``, ``L2`` the parts' lengths); rows are the constant row, then the details
  breadth-first (coarse to fine, left to right within a level). It is orthonormal for every
  ``n``, its first row is the mean (``1 / sqrt(n)`` everywhere), every other row sums to zero, and for
  powers of two it is the matrix above. The 2-D transform of a tile is the tensor product of the two
  1-D ones (the *standard* 2-D Haar decomposition: every row scale with every column scale), not
  Mallat's pyramid (``pywt.wavedec2``), because a separable product is what the GEMMs compute.
* ``"identity"`` (SparseLoCo: chunked top-k with error feedback needs no transform): ``B = I``.
  The transform is skipped, not multiplied: the coefficients are the (padded) tensor itself, so no
  GEMM runs and a momentum is stored as it is.

``"lowpass"`` selection keeps the ``k`` lowest coefficient indices in the zig-zag order of
:func:`~demo_lightning.codec.lowpass_order` (by ``i + j``, then ``i``): the lowest frequencies for the
DCT, the coarsest scales first for Haar (its rows are ordered coarse to fine). With ``"identity"``
it would be the same ``k`` elements of every tile forever; the codec's config refuses it unless
every coefficient is kept.

Bases are built in float64, cast once, and cached per (transform, size, dtype, device).
"""

from __future__ import annotations

import functools
import math
from typing import Literal, Optional, get_args

import torch
from torch import Tensor

from demo_lightning.codec.dct import dct_basis

__all__ = ["TRANSFORMS", "Transform", "haar_basis", "inverse_tile_transform", "tile_transform", "transform_basis"]

Transform = Literal["dct", "haar", "identity"]
"""The orthonormal transform of every tile: DCT-II, Haar wavelets (coarse to fine) or none."""
TRANSFORMS: tuple[str, ...] = get_args(Transform)


def _haar_rows(size: int) -> list[tuple[int, int, int]]:
    """``(start, first, second)`` of every detail row, breadth-first: the segment ``[start,
    start + first + second)`` split into its first ``first`` and last ``second`` points."""
    rows: list[tuple[int, int, int]] = []
    level = [(0, size)]
    while level:
        below = []
        for start, length in level:
            if length < 2:
                continue
            first = (length + 1) // 2
            rows.append((start, first, length - first))
            below += [(start, first), (start + first, length - first)]
        level = below
    return rows


@functools.lru_cache(maxsize=128)
def _cached_haar(size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    basis = torch.zeros(size, size, dtype=torch.float64)
    basis[0] = 1.0 / math.sqrt(size)
    for row, (start, first, second) in enumerate(_haar_rows(size), start=1):
        length = first + second
        basis[row, start : start + first] = math.sqrt(second / (first * length))
        basis[row, start + first : start + length] = -math.sqrt(first / (second * length))
    return basis.to(dtype=dtype, device=device).contiguous()


def haar_basis(size: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """The orthonormal Haar wavelet matrix of ``size`` x ``size``, rows coarse to fine (see the
    module docstring; cached: do not modify in place).

    Raises:
        ValueError: if ``size`` < 1 or ``dtype`` is not floating point.
    """
    if size < 1:
        raise ValueError(f"haar_basis: size must be >= 1, got {size}")
    if not dtype.is_floating_point:
        raise ValueError(f"haar_basis: dtype must be floating point, got {dtype}")
    return _cached_haar(int(size), dtype, torch.device(device if device is not None else "cpu"))


def transform_basis(
    transform: str, size: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> Optional[Tensor]:
    """``B_size`` of ``transform`` (cached), or ``None`` for ``"identity"`` (nothing to multiply)."""
    if transform == "dct":
        return dct_basis(size, dtype, device)
    if transform == "haar":
        return haar_basis(size, dtype, device)
    if transform == "identity":
        return None
    raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")


def _separable(tiles: Tensor, transform: str, inverse: bool) -> Tensor:
    rows = transform_basis(transform, tiles.shape[-2], tiles.dtype, tiles.device)
    cols = transform_basis(transform, tiles.shape[-1], tiles.dtype, tiles.device)
    if rows is None or cols is None:
        return tiles.clone()
    left, right = (rows.T, cols) if inverse else (rows, cols.T)
    return torch.matmul(torch.matmul(left, tiles), right)


def tile_transform(tiles: Tensor, transform: str = "dct") -> Tensor:
    """``B_r X B_c^T`` of every tile of ``tiles`` ``(T, r, c)`` (a new tensor; ``"identity"``: a copy)."""
    return _separable(tiles, transform, inverse=False)


def inverse_tile_transform(coefficients: Tensor, transform: str = "dct") -> Tensor:
    """Inverse of :func:`tile_transform`: ``B_r^T K B_c`` of every tile (a new tensor)."""
    return _separable(coefficients, transform, inverse=True)
