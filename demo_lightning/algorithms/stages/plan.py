"""The plan of an exchange: which tensors are compressed, how they are tiled, grouped and bucketed.

Built from the tensors' shapes, dtypes and devices and their per-tensor codec settings alone (no
data, no communication), so every rank that has the same tensors and settings builds the same
plan. Stages read it:

* a **family** is every compressed tensor with the same tile shape, ``k``, compute dtype and device.
  Its tensors' coefficient matrices (``Rp x Cp`` each, see
  :mod:`~demo_lightning.codec.transform`) are stored back to back in one flat buffer; the plan
  gives each tile's first element there (``origins``) and its matrix's row length (``strides``),
  so one selection, one gather and one scatter serve the whole family;
* a **bucket** is one collective of at most ``bucket_cap_mb`` megabytes; within it a **run** is
  the bucket's tensors of one family (consecutive rows of the family, whatever other families lie
  between them in plan order), packed, sent and decoded together, in order of first appearance;
* a **dense group** is the tensors the codec sends densely (below ``dense_below``, or 1-D) of one compute dtype and device,
  summed by one all-reduce in the codec's ``dense_format`` (bf16 by default);
* a **position group** (``config.position_group_size > 1``, top-k only) is up to that many tensors of
  one run with the same shape and role (:func:`block_role` of the parameter's name, when the
  exchange knows the names: the same projection in every block), in plan order: its first member
  (the carrier) sends the positions
  the group chose together, the others only their values (:attr:`TensorPlan.shares_with`), so
  their ``nbytes`` are the values' alone. Groups never cross a run, so a bucket decodes alone.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import torch
from torch import Tensor

from demo_lightning.algorithms.config import CodecConfig, TensorCodec, compute_dtype
from demo_lightning.codec import TileLayout, lowpass_positions, values_nbytes
from demo_lightning.codec.transform import flat_index, tile_origins

__all__ = ["ExchangePlan", "Family", "Run", "TensorPlan", "block_role", "build_plan"]

FamilyKey = tuple[tuple[int, int], int, torch.dtype, torch.device]
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")


def block_role(name: str) -> str:
    """A parameter's role across repeated blocks: its qualified name with every integer path
    component replaced by ``#`` (``"blocks.3.attn.qkv.weight"`` -> ``"blocks.#.attn.qkv.weight"``), so
    the same projection of every block of a ``ModuleList`` / ``Sequential`` has the same role."""
    return _INDEX.sub("#", name)


@dataclass
class TensorPlan:
    """One input tensor's place in the plan."""

    position: int
    shape: tuple[int, ...]
    dtype: torch.dtype  # compute dtype
    device: torch.device
    layout: Optional[TileLayout] = None
    k: int = 0
    family: Optional[FamilyKey] = None
    tile_offset: int = 0  # first row among the family's tiles
    flat_offset: int = 0  # first element in the family's flat storage
    nbytes: int = 0  # wire bytes per step
    shares_with: Optional["TensorPlan"] = None  # the position group's first member, whose positions this one uses
    role: Optional[str] = None  # what position groups match besides the shape (block_role of the name; None: shape alone)

    @property
    def dense(self) -> bool:
        return self.layout is None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_tiles(self) -> int:
        return self.layout.n_tiles if self.layout is not None else 0

    @property
    def rows(self) -> slice:
        return slice(self.tile_offset, self.tile_offset + self.n_tiles)

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """``(Rp, Cp)``: the padded coefficient matrix."""
        assert self.layout is not None
        return (self.layout.padded_rows, self.layout.padded_cols)

    @property
    def stored_numel(self) -> int:
        """Elements this tensor takes in its family's storage (``Rp * Cp``) or, dense, its own."""
        return self.layout.padded_rows * self.layout.padded_cols if self.layout is not None else self.numel

    @property
    def span(self) -> slice:
        return slice(self.flat_offset, self.flat_offset + self.stored_numel)


@dataclass
class Family:
    """Compressed tensors sharing tile shape, ``k``, compute dtype and device."""

    key: FamilyKey
    members: list[TensorPlan] = field(default_factory=list)

    @property
    def tile_shape(self) -> tuple[int, int]:
        return self.key[0]

    @property
    def k(self) -> int:
        return self.key[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.key[2]

    @property
    def device(self) -> torch.device:
        return self.key[3]

    @property
    def tile_numel(self) -> int:
        return self.tile_shape[0] * self.tile_shape[1]

    @property
    def n_tiles(self) -> int:
        return sum(m.n_tiles for m in self.members)

    @property
    def numel(self) -> int:
        """Elements of the family's flat storage."""
        return sum(m.stored_numel for m in self.members)

    @cached_property
    def origins(self) -> Tensor:
        """``(n_tiles,)`` flat offset of each tile's first element in the family's storage."""
        return torch.cat([tile_origins(m.layout, m.flat_offset, self.device) for m in self.members])  # type: ignore[arg-type]

    @cached_property
    def strides(self) -> Tensor:
        """``(n_tiles,)`` row length (``Cp``) of each tile's matrix."""
        return torch.cat([torch.full((m.n_tiles,), m.layout.padded_cols, dtype=torch.int64, device=self.device) for m in self.members])  # type: ignore[union-attr]

    def offsets(self, positions: Tensor, rows: slice = slice(None)) -> Tensor:
        """Flat storage offsets of in-tile ``positions`` ``(T, k)`` of the tiles ``rows``."""
        return flat_index(positions, self.origins[rows], self.strides[rows], self.tile_shape[1])

    @cached_property
    def group_index(self) -> Optional[Tensor]:
        """``(n_tiles,)``: for each tile, its row among the position groups' tiles (a carrier's tiles
        in family order, a member's tiles mapped onto its carrier's); ``None`` when no tensor of the
        family shares its positions."""
        if all(m.shares_with is None for m in self.members):
            return None
        return _carrier_rows_of(self.members, self.device)

    @property
    def group_rows(self) -> int:
        """Tiles whose positions are chosen (every tile when nothing is shared)."""
        return sum(m.n_tiles for m in self.members if m.shares_with is None)

    @cached_property
    def lowpass_positions(self) -> Tensor:
        """``(n_tiles, k)``: the ``k`` lowest frequencies of every tile (a view of one row)."""
        return lowpass_positions(*self.tile_shape, self.k, self.device).expand(self.n_tiles, self.k)

    @cached_property
    def lowpass_offsets(self) -> Tensor:
        return self.offsets(self.lowpass_positions)


@dataclass
class Run:
    """Consecutive tensors of one bucket and one family: consecutive rows of the family."""

    family: Family
    members: list[TensorPlan]

    @property
    def rows(self) -> slice:
        return slice(self.members[0].tile_offset, self.members[-1].tile_offset + self.members[-1].n_tiles)

    @property
    def tiles(self) -> tuple[int, ...]:
        return tuple(m.n_tiles for m in self.members)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)

    @property
    def coefficients(self) -> int:
        return sum(m.n_tiles for m in self.members) * self.family.k

    @cached_property
    def positioned(self) -> tuple[bool, ...]:
        """Per member, whether its segment carries positions (``False``: it uses its group's); read
        once the plan is built (the exchange asks every step)."""
        return tuple(m.shares_with is None for m in self.members)

    @cached_property
    def shares_positions(self) -> bool:
        """Some member uses another's positions (a position group)."""
        return not all(self.positioned)

    @cached_property
    def carrier_rows(self) -> Tensor:
        """Rows of the run (``0 .. sum(tiles)``) whose positions go on the wire."""
        rows, offset = [], 0
        for m in self.members:
            if m.shares_with is None:
                rows.append(torch.arange(offset, offset + m.n_tiles, dtype=torch.int64))
            offset += m.n_tiles
        return torch.cat(rows).to(self.family.device)

    @cached_property
    def position_rows(self) -> Tensor:
        """For each row of the run, its row among the carried positions (:attr:`carrier_rows`' order)."""
        return _carrier_rows_of(self.members, self.family.device)


def _carrier_rows_of(members: Sequence[TensorPlan], device: torch.device) -> Tensor:
    """For each tile of ``members`` (in order), its row among the tiles of the members that carry
    positions (in order): a carrier's own tiles, a group member's mapped onto its carrier's (which
    comes first)."""
    start: dict[int, int] = {}
    rows, carried = [], 0
    for m in members:
        if m.shares_with is None:
            start[m.position] = carried
            carried += m.n_tiles
        base = start[(m.shares_with or m).position]
        rows.append(torch.arange(base, base + m.n_tiles, dtype=torch.int64))
    return torch.cat(rows).to(device)


@dataclass
class ExchangePlan:
    """Everything the stages need to know about a list of tensors (see the module docstring)."""

    config: CodecConfig
    tensors: list[TensorPlan]
    dense_groups: dict[tuple[torch.dtype, torch.device], list[TensorPlan]]
    families: dict[FamilyKey, Family]
    buckets: list[list[Run]]

    @property
    def coefficients(self) -> int:
        """Coefficients one worker sends per exchange."""
        return sum(f.n_tiles * f.k for f in self.families.values())

    @property
    def compressed_numel(self) -> int:
        """Elements of the compressed tensors (unpadded)."""
        return sum(m.numel for f in self.families.values() for m in f.members)

    def fingerprint(self) -> list[int]:
        """What must agree across ranks: count, then per tensor size, rank, dense, k, tile size and dtype."""
        values = [len(self.tensors)]
        for t in self.tensors:
            values += [t.numel, len(t.shape), int(t.dense), t.k, t.layout.tile_numel if t.layout else 0,
                       zlib.crc32(str(t.dtype).encode())]
        return values


def build_plan(
    config: CodecConfig,
    tensors: Sequence[Tensor],
    overrides: Optional[Sequence[Optional[TensorCodec]]] = None,
    roles: Optional[Sequence[Optional[str]]] = None,
) -> ExchangePlan:
    """The plan for ``tensors`` (only their shapes, dtypes and devices are read) under ``config``
    and per-tensor ``overrides`` (``None`` entries inherit the config); ``roles``: per tensor, what
    position groups match besides the shape (``None``: the shape alone)."""
    if overrides is not None and len(overrides) != len(tensors):
        raise ValueError(f"got {len(overrides)} per-tensor codec settings for {len(tensors)} tensors; give one per tensor (None inherits)")
    if roles is not None and len(roles) != len(tensors):
        raise ValueError(f"got {len(roles)} roles for {len(tensors)} tensors; give one per tensor (None: the shape alone)")
    items: list[TensorPlan] = []
    for position, x in enumerate(tensors):
        own = overrides[position] if overrides is not None else None
        shape = tuple(x.shape)
        layout, k = config.layout(shape, own)
        if layout is not None and k < layout.tile_numel and config.transform == "identity" and config.selection == "lowpass":
            raise ValueError(
                f"tensor {position} (shape {shape}) keeps {k} of {layout.tile_numel} per tile under transform='identity' and "
                "selection='lowpass', which would send the same elements every step and never the rest: keep every "
                "coefficient (keep_ratio=1.0) for it, or use selection='topk'"
            )
        item = TensorPlan(position, shape, compute_dtype(x.dtype), x.device, layout=layout, k=k,
                          role=roles[position] if roles is not None else None)
        if layout is not None:
            item.family = (layout.tile_shape, k, item.dtype, item.device)
            item.nbytes = config.payload_bytes(shape, own)
        items.append(item)
    dense_groups: dict[tuple[torch.dtype, torch.device], list[TensorPlan]] = {}
    families: dict[Any, Family] = {}
    cap = int(config.bucket_cap_mb * 1024 * 1024)
    buckets: list[list[Run]] = []
    size = 0
    for item in items:
        if item.dense:
            group = dense_groups.setdefault((item.dtype, item.device), [])
            item.flat_offset = sum(m.numel for m in group)
            group.append(item)
            continue
        family = families.setdefault(item.family, Family(item.family))  # type: ignore[arg-type]
        item.tile_offset = family.n_tiles
        item.flat_offset = family.numel
        if not buckets or size + item.nbytes > cap:
            buckets.append([])
            size = 0
        bucket = buckets[-1]
        # the family's next rows join its run in this bucket (tensors of other families may lie between
        # them in plan order: a block's projections keeping different k), so a run is one family per bucket
        run = next((r for r in bucket if r.family is family and family.members and r.members[-1] is family.members[-1]), None)
        if run is not None:
            run.members.append(item)
        else:
            bucket.append(Run(family, [item]))
        family.members.append(item)
        size += item.nbytes
    if config.position_group_size > 1:
        _group_positions(buckets, config)
    return ExchangePlan(config, items, dense_groups, families, buckets)


def _group_positions(buckets: list[list[Run]], config: CodecConfig) -> None:
    """Cut every run's tensors of one shape and role, in plan order, into position groups of
    ``config.position_group_size``; members after the first send values only (fewer bytes, so
    every bucket still fits its cap)."""
    for bucket in buckets:
        for run in bucket:
            open_groups: dict[tuple[tuple[int, ...], Optional[str]], list[TensorPlan]] = {}
            for item in run.members:
                key = (item.shape, item.role)
                group = open_groups.setdefault(key, [])
                if len(group) == config.position_group_size:
                    group = open_groups[key] = []
                if group:
                    item.shares_with = group[0]
                    item.nbytes = values_nbytes(item.n_tiles, item.k, config.value_format, config.fp16_share)
                group.append(item)
