"""Encode stage: tensors into spectra (DCT, Haar or none), spectra into the coefficients to send.

Two entry points, both pure tensor code (no communication):

* :func:`transform_into` writes ``T(pad(x))`` of every compressed input into its family's flat
  storage (``decay`` 0), or accumulates ``decay * K + T(pad(g))`` (DeMo's momentum in
  coefficient space) into storage that persists between steps; ``T`` is the plan's
  ``config.transform`` (:mod:`~demo_lightning.codec.bases`: DCT-II, Haar wavelets, or
  ``"identity"``, which copies instead of multiplying);
* :func:`select` chooses, per tile, the ``k`` coefficients of largest magnitude (``"topk"``) or
  the ``k`` lowest frequencies (``"lowpass"``) from a family's storage and returns their in-tile
  positions, their flat storage offsets and their values: one ``topk`` and one ``take`` for the
  whole family.

Quantisation belongs to the wire format, which the transport owns (an all-gather packs
fp32/bf16/fp16/int8/sign with positions; an all-reduce saturates floats so that ``W`` of them
sum without overflow): the transport returns the values exactly as every receiver decodes them,
and that is what error feedback subtracts.

:class:`Workspace` holds the scratch buffers the transforms need, allocated once per plan:
nothing here zero-fills a buffer that is fully overwritten, and a tensor that tiles exactly is
transformed straight from its own memory (a view); only a tensor whose shape needs padding is
copied, into a buffer whose padding is zeroed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from demo_lightning.algorithms.stages.plan import ExchangePlan, Family, TensorPlan
from demo_lightning.codec import Selection
from demo_lightning.codec.transform import accumulate_spectrum, tile_view

__all__ = ["Selected", "Workspace", "select", "select_at", "transform_into", "write_magnitudes"]


@dataclass
class Selected:
    """One family's chosen coefficients on this worker: all ``(n_tiles, k)``."""

    family: Family
    positions: Tensor  # int64 in-tile flat positions
    offsets: Tensor  # int64 offsets into the family's flat storage
    values: Tensor  # the coefficients, in the family's compute dtype


class Workspace:
    """Scratch buffers for one plan's transforms, allocated on first use and kept.

    * per (dtype, device): one buffer of the largest padded matrix, for a transform's middle product;
    * per tensor that needs padding: a padded input matrix with zero padding (zeroed once);
    * per family: a flat buffer of the family's size (the magnitudes for ``"topk"`` selection,
      then the mean's coefficients in the decode stage).
    """

    def __init__(self, plan: ExchangePlan) -> None:
        self.plan = plan
        self._scratch: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._padded: dict[int, Tensor] = {}
        self._family: dict[object, Tensor] = {}
        self._second: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def scratch(self, item: TensorPlan, second: bool = False) -> Tensor:
        """An ``Rp x Cp`` buffer (any contents) for ``item``; ``second`` gives a distinct one."""
        pool = self._second if second else self._scratch
        key = (item.dtype, item.device)
        buf = pool.get(key)
        if buf is None:
            largest = max(t.stored_numel for t in self.plan.tensors if not t.dense and (t.dtype, t.device) == key)
            buf = pool[key] = torch.empty(largest, dtype=item.dtype, device=item.device)
        return buf[: item.stored_numel].view(item.matrix_shape)

    def padded(self, item: TensorPlan) -> Optional[Tensor]:
        """The zero-padded input buffer of ``item`` (``None`` when its shape tiles exactly)."""
        layout = item.layout
        assert layout is not None
        if layout.padded_rows == layout.rows and layout.padded_cols == layout.cols:
            return None
        buf = self._padded.get(item.position)
        if buf is None:
            buf = self._padded[item.position] = torch.zeros(item.matrix_shape, dtype=item.dtype, device=item.device)
        return buf

    def family(self, family: Family) -> Tensor:
        """The family's flat work buffer (any contents)."""
        buf = self._family.get(family.key)
        if buf is None:
            buf = self._family[family.key] = torch.empty(family.numel, dtype=family.dtype, device=family.device)
        return buf


def transform_into(
    plan: ExchangePlan,
    inputs: Sequence[Optional[Tensor]],
    storage: dict[object, Tensor],
    workspace: Workspace,
    decay: float | Sequence[float] = 0.0,
) -> None:
    """For every compressed input ``x`` (``None``: a zero input), ``K <- decay * K + T(pad(x))``
    in its family's ``storage`` (flat, ``family.numel`` long), ``T`` the plan's transform. With
    ``decay`` 0 the storage's old contents are not read. ``decay`` may be one value per input."""
    transform = plan.config.transform
    for family in plan.families.values():
        flat = storage[family.key]
        for item in family.members:
            x = inputs[item.position]
            if x is not None and x.dtype != item.dtype:
                x = x.to(item.dtype)
            d = decay if isinstance(decay, (int, float)) else decay[item.position]
            accumulate_spectrum(x, item.layout, flat[item.span].view(item.matrix_shape), float(d),  # type: ignore[arg-type]
                                workspace.scratch(item), workspace.padded(item), transform)


def write_magnitudes(family: Family, storage: Tensor, magnitudes: Tensor) -> Tensor:
    """Every tile's ``|K|``, tile-major, into ``magnitudes`` (``family.numel`` elements, any contents):
    one pass per tensor (the absolute value and the reordering together); returns them as
    ``(n_tiles, tile_numel)`` rows."""
    n, numel = family.n_tiles, family.tile_numel
    tiles = magnitudes[: n * numel].view(n, numel)
    for item in family.members:
        layout = item.layout
        assert layout is not None
        grid = tile_view(storage[item.span].view(item.matrix_shape), layout)
        torch.abs(grid, out=tiles[item.rows].view(grid.shape))
    return tiles


def select_at(family: Family, storage: Tensor, positions: Tensor) -> Selected:
    """The coefficients of ``family``'s ``storage`` at in-tile ``positions`` ``(n_tiles, k)`` (chosen elsewhere)."""
    offsets = family.offsets(positions)
    return Selected(family, positions, offsets, storage.take(offsets))


def select(
    family: Family, storage: Tensor, selection: Selection, magnitudes: Optional[Tensor] = None, strongest_first: bool = False
) -> Selected:
    """Choose ``k`` coefficients per tile of ``family`` from its flat ``storage``.

    ``"topk"`` needs ``magnitudes``, a flat buffer of ``family.numel`` elements (any contents):
    every tile's ``|K|`` is written there tile-major (one pass per tensor: the absolute value and
    the reordering together), and one ``topk`` over it picks the positions (ties broken by
    ``torch.topk``, the same on every rank for the same data); ``strongest_first`` orders each
    tile's picks by magnitude, largest first (``value_format="mixed"`` sends the first in fp16).
    Tensors of a position group (:attr:`Family.group_index`) take the ``k`` positions of largest
    summed energy ``sum_m |K_m|^2`` over the group's corresponding tiles (ordered by it with
    ``strongest_first``): one ``topk`` over the groups' rows, one gather back to every member.
    """
    if selection == "lowpass":
        positions, offsets = family.lowpass_positions, family.lowpass_offsets
    elif selection == "topk":
        if magnitudes is None:
            raise ValueError("select(..., 'topk') needs a magnitudes buffer of family.numel elements")
        tiles = write_magnitudes(family, storage, magnitudes)
        groups = family.group_index
        if groups is None:
            return select_at(family, storage, torch.topk(tiles, family.k, dim=1, sorted=strongest_first).indices)
        # position groups: per tile index, the k largest summed energies sum_m |K_m|^2 of the group's members
        energy = tiles.new_zeros(family.group_rows, family.tile_numel).index_add_(0, groups, tiles.square())
        chosen = torch.topk(energy, family.k, dim=1, sorted=strongest_first).indices
        return select_at(family, storage, chosen.index_select(0, groups))
    else:
        raise ValueError(f"selection must be 'topk' or 'lowpass', got {selection!r}")
    return Selected(family, positions, offsets, storage.take(offsets))
