"""The tile DCT computed on a tensor's own matrix layout: no tile copies, the decay fused in.

A tensor viewed as its matrix ``X`` (``R x C``, see :mod:`~demo_lightning.codec.chunking`) and
padded with zeros to ``Rp x Cp`` (multiples of the tile ``tr x tc``) is cut into tiles
``X[a, b] = X[a tr : (a + 1) tr, b tc : (b + 1) tc]``. The 2-D DCT-II of every tile,
``C_r X[a, b] C_c^T``, is stored in the same place: the coefficients ``K`` of the tensor are again
an ``Rp x Cp`` matrix whose block ``(a, b)`` holds tile ``(a, b)``'s spectrum. Then

    right factor:  X C_c^T (block-diagonal)  =  one GEMM of the contiguous view (Rp * Cp / tc, tc) by C_c^T
    left factor:   C_r (X C_c^T)             =  a batched GEMM (``bmm``, the basis expanded: no copy)
                                                of the Rp / tr row bands (tr, Cp) by C_r

both on contiguous memory: unlike the tile-major form (``to_tiles`` then a batched ``(T, tr, tc)``
matmul) nothing is permuted or copied, and the left factor's GEMMs are wide (``N = Cp``), so the
transform runs near the machine's matmul speed. :func:`accumulate_spectrum` fuses DeMo's momentum
update into the last GEMM (``K <- decay K + DCT(x)``: ``addmm`` with ``beta = decay``), so the
decay costs no pass of its own.

Element ``(i, j)`` of tile ``(a, b)`` (flat position ``p = i tc + j`` in the tile, as the
selection reports it) lives at ``(a tr + i) Cp + b tc + j`` of the flat coefficient matrix:
:func:`tile_origins` gives every tile's first element, and :func:`flat_index` turns positions into
such offsets (for ``gather`` / ``scatter``), for one tensor or for several stored back to back.

Rounding: the result equals :func:`~demo_lightning.codec.dct2` of the tiles up to float rounding
(the same products, summed by different GEMM kernels); a given call is deterministic.

Transforms (``transform``, see :mod:`~demo_lightning.codec.bases`): the DCT-II above is the default;
``"haar"`` runs the same two GEMMs with the Haar wavelet matrices in place of ``C_r`` and ``C_c``;
``"identity"`` runs no GEMM at all: ``K <- decay K + pad(x)`` is one elementwise pass (a plain copy
at decay 0), and the inverse is ``scale * K``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from demo_lightning.codec.bases import transform_basis
from demo_lightning.codec.chunking import TileLayout

__all__ = ["accumulate_spectrum", "flat_index", "inverse_spectrum", "padded_matrix", "tile_origins", "tile_view"]


def padded_matrix(x: Tensor, layout: TileLayout, work: Tensor | None = None) -> Tensor:
    """``x`` as its ``Rp x Cp`` matrix: a view when the shape tiles exactly, else ``work`` (an
    ``Rp x Cp`` buffer whose padding is zero and stays zero: only the ``R x C`` corner is written)."""
    matrix = x.reshape(layout.rows, layout.cols)
    if layout.padded_rows == layout.rows and layout.padded_cols == layout.cols:
        return matrix
    if work is None:
        work = torch.zeros((layout.padded_rows, layout.padded_cols), dtype=x.dtype, device=x.device)
    work[: layout.rows, : layout.cols].copy_(matrix)
    return work


def _bases(layout: TileLayout, dtype: torch.dtype, device: torch.device, transform: str) -> tuple[Tensor, Tensor]:
    rows, cols = transform_basis(transform, layout.tile_rows, dtype, device), transform_basis(transform, layout.tile_cols, dtype, device)
    assert rows is not None and cols is not None  # "identity" never multiplies
    return rows, cols


def accumulate_spectrum(
    x: Tensor | None, layout: TileLayout, out: Tensor, decay: float, scratch: Tensor, padded: Tensor | None = None,
    transform: str = "dct",
) -> Tensor:
    """``out <- decay * out + T(pad(x))`` per tile, on the matrix layout (see the module docstring).

    Args:
        x: the tensor (``layout.shape``, ``out``'s dtype), or ``None`` for a zero input.
        out: ``Rp x Cp`` coefficients, updated in place. With ``decay == 0`` its old contents are
            ignored (not read: NaN in them does not propagate), so it need not be initialised.
        scratch: an ``Rp x Cp`` buffer for the intermediate product (any contents; unused by ``"identity"``).
        padded: for a shape that does not tile exactly, an ``Rp x Cp`` buffer whose padding is zero
            (it stays zero: only the ``R x C`` corner is written); allocated when ``None``.
        transform: ``T``: ``"dct"`` (DCT-II), ``"haar"`` or ``"identity"`` (no GEMM: ``out <- decay *
            out + pad(x)`` in one elementwise pass, a copy at decay 0);
            see :mod:`~demo_lightning.codec.bases`.
    """
    if x is None:
        return out.mul_(decay) if decay != 0 else out.zero_()
    matrix = padded_matrix(x, layout, padded)
    if transform == "identity":
        return out.copy_(matrix) if decay == 0 else torch.add(matrix, out, alpha=decay, out=out)
    rows_basis, cols_basis = _bases(layout, out.dtype, out.device, transform)
    tr, tc, rp, cp = layout.tile_rows, layout.tile_cols, layout.padded_rows, layout.padded_cols
    if tr == 1:  # one-row tiles: the left factor is [[1]]
        left = matrix
    else:
        left = torch.bmm(rows_basis.expand(rp // tr, tr, tr), matrix.reshape(rp // tr, tr, cp), out=scratch.view(rp // tr, tr, cp))
    flat_out = out.view(rp * cp // tc, tc)
    return torch.addmm(flat_out, left.reshape(rp * cp // tc, tc), cols_basis.T, beta=decay, out=flat_out).view(rp, cp)


def inverse_spectrum(
    coefficients: Tensor, layout: TileLayout, out: Tensor, scratch: Tensor, scale: float = 1.0, transform: str = "dct"
) -> Tensor:
    """``out <- scale * T^-1(coefficients)`` per tile: ``Rp x Cp`` in, ``Rp x Cp`` out (crop with
    ``out[:R, :C]``). ``out`` and ``scratch`` (``Rp x Cp``, any contents) must not alias
    ``coefficients`` or each other; ``out`` need not be initialised. ``transform`` as in
    :func:`accumulate_spectrum` (``"identity"``: ``out <- scale * coefficients``, no GEMM)."""
    if transform == "identity":
        return torch.mul(coefficients.view(out.shape), scale, out=out)
    rows_basis, cols_basis = _bases(layout, coefficients.dtype, coefficients.device, transform)
    tr, tc, rp, cp = layout.tile_rows, layout.tile_cols, layout.padded_rows, layout.padded_cols
    right = out if tr == 1 else scratch
    flat = right.view(rp * cp // tc, tc)
    torch.addmm(flat, coefficients.reshape(rp * cp // tc, tc), cols_basis, beta=0, alpha=scale, out=flat)
    if tr == 1:
        return out.view(rp, cp)
    return torch.bmm(rows_basis.T.expand(rp // tr, tr, tr), scratch.view(rp // tr, tr, cp), out=out.view(rp // tr, tr, cp)).view(rp, cp)


def tile_view(coefficients: Tensor, layout: TileLayout) -> Tensor:
    """The ``Rp x Cp`` coefficients as ``(Rp / tr, Cp / tc, tr, tc)``: tile ``(a, b)`` at ``[a, b]`` (a view)."""
    tr, tc = layout.tile_rows, layout.tile_cols
    return coefficients.view(layout.padded_rows // tr, tr, layout.padded_cols // tc, tc).permute(0, 2, 1, 3)


def tile_origins(layout: TileLayout, base: int = 0, device: torch.device | str | None = None) -> Tensor:
    """Flat offset of every tile's first element, tiles in row-major order, for a coefficient
    matrix stored from offset ``base`` (int64, ``(n_tiles,)``)."""
    tr, tc, cp = layout.tile_rows, layout.tile_cols, layout.padded_cols
    a = torch.arange(layout.padded_rows // tr, dtype=torch.int64, device=device)
    b = torch.arange(cp // tc, dtype=torch.int64, device=device)
    return (base + (a * tr * cp).unsqueeze(1) + (b * tc).unsqueeze(0)).reshape(-1)


def flat_index(positions: Tensor, origins: Tensor, row_stride: Tensor | int, tile_cols: int) -> Tensor:
    """Flat offsets of ``positions`` ``(T, k)`` (flat in-tile indices ``i tc + j``) for tiles
    starting at ``origins`` ``(T,)`` in matrices of ``row_stride`` columns (an int, or ``(T,)``)."""
    stride = row_stride.unsqueeze(1) if isinstance(row_stride, Tensor) else row_stride
    return origins.unsqueeze(1) + torch.div(positions, tile_cols, rounding_mode="floor") * stride + positions % tile_cols
