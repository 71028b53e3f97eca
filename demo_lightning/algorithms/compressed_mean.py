"""Mean over workers of a list of tensors, sent through the DeMo codec.

This is the communication core of DeMo (arXiv 2411.19870), shared by the DeMo exchange (which
feeds it momenta) and by DES-LOC's compressed parameter sync (which feeds it parameter changes).
For each input tensor ``x`` on each worker::

    (I, V)  = select(DCT(tiles(x)), k)          # top-k by magnitude, or the k lowest frequencies
    V^      = quantize(V)                       # value_format
    sent    = IDCT(scatter(I, V^))              # what this worker contributed (for error feedback)
    mean    = IDCT( sum_{r=0..W-1} scatter(I_r, V^_r) / W )

Tensors with fewer than ``dense_below`` elements skip the codec: ``mean`` is an fp32 all-reduce of
``x`` divided by W and ``sent`` is ``x`` itself.

Determinism: ranks' contributions are summed in rank order 0..W-1 into a dense coefficient buffer
(positions within a tile are distinct, so ``scatter_add_`` never collides), which makes every
replica compute bitwise the same ``mean``. With identical inputs on W workers the mean equals a
single worker's bitwise only for W = 1, 2 or 4 (``(a + a) / 2 == a``, and ``(((a + a) + a) + a) / 4
== a`` for every float, checked over all fp32 significands): for other W the rounded partial sums
``3a``, ``5a``, ... leave ``sum / W`` an ulp off for many values (fp32: ``(0.9 + 0.9 + 0.9) / 3 !=
0.9``; eight copies of 0.1 summed in order and divided by 8 are not 0.1 either).

Performance: tiles of the same shape from all tensors are transformed together (one GEMM plus one
batched matmul per family); one inverse transform serves ``sent`` and ``mean``; each bucket of up to
``bucket_cap_mb`` megabytes is one collective; consecutive tensors of one family in a bucket are
packed, unpacked and scattered as one run (:func:`~demo_lightning.codec.pack_segments`: the wire
bytes stay those of one segment per tensor), so the number of small tensor operations per step
does not grow with the number of tensors.

Failure: the trainable tensor layout (count, sizes, ranks) is compared across workers whenever it
changes; a mismatch raises ``RuntimeError`` on every rank before any data moves. A collective that
cannot complete raises after the process group's timeout.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from demo_lightning.codec import (
    SELECTIONS,
    VALUE_FORMATS,
    TileLayout,
    coefficients_per_tile,
    dct2,
    from_tiles,
    idct2,
    lowpass_order,
    pack_segments,
    plan_tiles,
    saturate,
    segment_nbytes,
    select,
    to_tiles,
    unpack_segments,
    validate_strength,
)
from demo_lightning.comm import Communicator

__all__ = ["DEFAULT_TOPK", "CodecConfig", "CompressedMean", "TensorCodec", "TensorEnergy", "compute_dtype"]

DEFAULT_TOPK = 64
_WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Transforms run in fp32 for half-precision tensors, else in the tensor's own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass(frozen=True)
class CodecConfig:
    """How tensors are compressed on the wire.

    Args:
        chunk: tile side: 2-D views are cut into ``chunk`` x ``chunk`` tiles, 1-D into ``chunk``-long ones.
        topk: coefficients kept per tile (clamped to the tile size); 64 when neither this nor
            ``keep_ratio`` is given (1.6 % of a 64x64 tile; the paper used 32 with fp32 values).
        keep_ratio: fraction of each tile kept, in (0, 1]; exclusive with ``topk``.
        selection: ``"topk"`` (largest magnitudes, positions sent) or ``"lowpass"`` (fixed lowest
            frequencies, no positions; all-reduced when ``value_format`` is a float format).
        value_format: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"int8"`` or ``"sign"``.
        dense_below: tensors with fewer elements are all-reduced densely in fp32 (0 disables).
        bucket_cap_mb: largest payload of one collective, in megabytes.
    """

    chunk: int = 64
    topk: Optional[int] = None
    keep_ratio: Optional[float] = None
    selection: Literal["topk", "lowpass"] = "topk"
    value_format: Literal["fp32", "bf16", "fp16", "int8", "sign"] = "sign"
    dense_below: int = 4096
    bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be a positive integer (tile side), got {self.chunk!r}; the paper uses 64")
        validate_strength(self.topk, self.keep_ratio)
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.value_format not in VALUE_FORMATS:
            raise ValueError(f"value_format must be one of {VALUE_FORMATS}, got {self.value_format!r}")
        if isinstance(self.dense_below, bool) or not isinstance(self.dense_below, int) or self.dense_below < 0:
            raise ValueError(f"dense_below must be a non-negative integer (element count), got {self.dense_below!r}")
        if not isinstance(self.bucket_cap_mb, (int, float)) or not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")

    @property
    def strength(self) -> tuple[Optional[int], Optional[float]]:
        """``(topk, keep_ratio)`` with the default applied."""
        if self.topk is None and self.keep_ratio is None:
            return DEFAULT_TOPK, None
        return self.topk, self.keep_ratio

    @property
    def sends_positions(self) -> bool:
        return self.selection == "topk"

    @property
    def all_reduces(self) -> bool:
        """Low-pass values in a float format are summed by an all-reduce; everything else is all-gathered."""
        return self.selection == "lowpass" and self.value_format in _WIRE_DTYPES


@dataclass(frozen=True)
class TensorCodec:
    """One tensor's departures from the :class:`CodecConfig` (``None`` fields inherit it).

    Per-layer policies and the adaptive keep ratio set these; every rank must set the same ones
    (the plan's fingerprint, compared across ranks whenever it changes, includes them).

    Args:
        topk: coefficients kept per tile for this tensor.
        keep_ratio: fraction of each tile kept, in (0, 1]; exclusive with ``topk``.
        chunk: tile side for this tensor.
        dense: ``True`` sends the whole tensor by an fp32 all-reduce, ``False`` compresses it
            even below ``dense_below``.
    """

    topk: Optional[int] = None
    keep_ratio: Optional[float] = None
    chunk: Optional[int] = None
    dense: Optional[bool] = None

    def __post_init__(self) -> None:
        validate_strength(self.topk, self.keep_ratio)
        if self.chunk is not None and (isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1):
            raise ValueError(f"chunk must be a positive integer (tile side), got {self.chunk!r}")
        if self.dense is not None and not isinstance(self.dense, bool):
            raise ValueError(f"dense must be True, False or None, got {self.dense!r}")

    def strength(self, config: CodecConfig) -> tuple[Optional[int], Optional[float]]:
        """``(topk, keep_ratio)`` for this tensor."""
        if self.topk is None and self.keep_ratio is None:
            return config.strength
        return self.topk, self.keep_ratio


@dataclass(frozen=True)
class TensorEnergy:
    """How much of one input's energy (squared L2 norm) the codec kept, on this worker.

    The DCT is orthonormal and padding is zero, so ``total`` is both ``||x||^2`` and the energy of
    all coefficients; ``captured`` is that of the selected coefficients before quantisation.
    ``curve[k - 1]`` (only when requested) is the fraction of ``total`` the best ``k`` coefficients
    per tile would keep (for ``"lowpass"``: the ``k`` lowest frequencies), for ``k = 1..tile_numel``.
    """

    total: float
    captured: float
    k: int
    tile_numel: int
    n_tiles: int
    curve: Optional[Tensor] = None

    @property
    def fraction(self) -> float:
        """Captured fraction of the energy (1 for an all-zero input, which loses nothing)."""
        return self.captured / self.total if self.total > 0 else 1.0

    def k_for(self, target: float) -> int:
        """Smallest ``k`` whose curve reaches ``target`` (the largest ``k`` if none does)."""
        if self.curve is None:
            raise ValueError("this TensorEnergy has no curve: pass energy_curve=True to CompressedMean")
        hit = torch.nonzero(self.curve >= target - 1e-12)
        return int(hit[0, 0]) + 1 if hit.numel() else int(self.curve.numel())


@dataclass
class _Item:
    """One input tensor's place in the plan."""

    position: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    dense: bool
    layout: Optional[TileLayout] = None
    k: int = 0
    family: Any = None
    tile_offset: int = 0
    nbytes: int = 0

    @property
    def n_tiles(self) -> int:
        return self.layout.n_tiles if self.layout is not None else 0

    @property
    def rows(self) -> slice:
        return slice(self.tile_offset, self.tile_offset + self.n_tiles)


@dataclass
class _Run:
    """Consecutive inputs of one bucket and one family: their tiles are consecutive rows of the
    family, and their segments are packed, sent and decoded together."""

    family: Any
    items: list[_Item]

    @property
    def rows(self) -> slice:
        return slice(self.items[0].tile_offset, self.items[-1].tile_offset + self.items[-1].n_tiles)

    @property
    def tiles(self) -> tuple[int, ...]:
        return tuple(m.n_tiles for m in self.items)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.items)


@dataclass
class _Plan:
    items: list[_Item]
    dense_groups: dict[tuple[torch.dtype, torch.device], list[_Item]]
    families: "OrderedDict[Any, list[_Item]]"
    buckets: list[list[_Run]]


class CompressedMean:
    """Average tensors over workers through the DeMo codec (see the module docstring).

    Args:
        config: codec settings.
        communicator: collectives and their ledger.
    """

    def __init__(self, config: CodecConfig, communicator: Communicator) -> None:
        self.config = config
        self.comm = communicator
        self._plan: Optional[_Plan] = None
        self._plan_key: Optional[tuple] = None
        self.coefficients = 0
        self.last_energy: list[TensorEnergy] = []

    def layout(self, shape: tuple[int, ...], override: Optional[TensorCodec] = None) -> tuple[Optional[TileLayout], int]:
        """``(tiles, k)`` for a tensor of ``shape``: ``(None, 0)`` when it is sent densely."""
        cfg = self.config
        own = override if override is not None else _INHERIT
        numel = math.prod(shape)
        if own.dense if own.dense is not None else numel < cfg.dense_below:
            return None, 0
        topk, keep_ratio = own.strength(cfg)
        layout = plan_tiles(shape, own.chunk if own.chunk is not None else cfg.chunk)
        return layout, coefficients_per_tile(layout.tile_numel, topk, keep_ratio)

    def payload_bytes(self, shape: tuple[int, ...], override: Optional[TensorCodec] = None) -> int:
        """Bytes one worker hands to the collective for a tensor of ``shape`` (fp32 when dense)."""
        layout, k = self.layout(shape, override)
        if layout is None:
            return 4 * math.prod(shape)
        if self.config.all_reduces:
            return layout.n_tiles * k * _WIRE_DTYPES[self.config.value_format].itemsize
        return segment_nbytes(layout.n_tiles, k, layout.tile_numel, self.config.value_format, self.config.sends_positions)

    def _build_plan(self, tensors: list[Tensor], overrides: list[TensorCodec]) -> _Plan:
        cfg = self.config
        items: list[_Item] = []
        for position, (x, own) in enumerate(zip(tensors, overrides)):
            layout, k = self.layout(tuple(x.shape), own)
            item = _Item(position, tuple(x.shape), compute_dtype(x.dtype), x.device, dense=layout is None, layout=layout, k=k)
            if not item.dense:
                item.family = (layout.tile_shape, k, item.dtype, item.device)
                item.nbytes = self.payload_bytes(tuple(x.shape), own)
            items.append(item)
        dense_groups: dict[tuple[torch.dtype, torch.device], list[_Item]] = {}
        families: OrderedDict[Any, list[_Item]] = OrderedDict()
        cap = int(cfg.bucket_cap_mb * 1024 * 1024)
        buckets: list[list[_Run]] = []
        size = 0
        for item in items:
            if item.dense:
                dense_groups.setdefault((item.dtype, item.device), []).append(item)
                continue
            members = families.setdefault(item.family, [])
            item.tile_offset = sum(m.n_tiles for m in members)
            if not buckets or size + item.nbytes > cap:
                buckets.append([])
                size = 0
            bucket = buckets[-1]
            if bucket and bucket[-1].family == item.family and bucket[-1].items[-1] is members[-1]:
                bucket[-1].items.append(item)  # the family's next rows: same run
            else:
                bucket.append(_Run(item.family, [item]))
            members.append(item)
            size += item.nbytes
        fingerprint = [len(items)]
        for x, item in zip(tensors, items):
            fingerprint += [
                x.numel(), x.dim(), int(item.dense), item.k, item.layout.tile_numel if item.layout else 0,
                zlib.crc32(str(item.dtype).encode()),  # dense tensors are summed in groups per compute dtype
            ]
        self.comm.check_same(
            fingerprint, "codec/fingerprint",
            "the list of tensors to average (count, sizes, compute dtypes), or their per-tensor codec settings (k, chunk, dense)",
        )
        return _Plan(items, dense_groups, families, buckets)

    def plan(self, tensors: list[Tensor], overrides: Optional[list[Optional[TensorCodec]]] = None) -> _Plan:
        """The (cached) plan for these shapes and per-tensor settings; rebuilding it compares
        layouts and settings across ranks (a collective: every rank rebuilds at the same call)."""
        own = _resolve_overrides(tensors, overrides)
        key = tuple((tuple(x.shape), x.dtype, x.device, o) for x, o in zip(tensors, own))
        if self._plan is None or key != self._plan_key:
            self._plan = self._build_plan(tensors, own)
            self._plan_key = key
        return self._plan

    @torch.no_grad()
    def __call__(
        self,
        inputs: list[Tensor],
        tag: str,
        overrides: Optional[list[Optional[TensorCodec]]] = None,
        energy_curve: bool = False,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Return ``(mean over workers, what this worker sent)`` for every input, in the compute dtype.

        ``overrides`` gives per-input :class:`TensorCodec` settings (``None``: the config's).
        Afterwards :attr:`last_energy` holds each input's :class:`TensorEnergy`, with the
        energy curve when ``energy_curve`` is set (it costs a sort of every tile).
        """
        cfg = self.config
        world = self.comm.world_size
        plan = self.plan(inputs, overrides)
        energy: list[Optional[TensorEnergy]] = [None] * len(inputs)
        mean_out: list[Optional[Tensor]] = [None] * len(inputs)
        sent_out: list[Optional[Tensor]] = [None] * len(inputs)

        for group in plan.dense_groups.values():
            flat = torch.cat([inputs[i.position].reshape(-1).to(i.dtype) for i in group])
            sizes = [inputs[i.position].numel() for i in group]
            totals = torch.segment_reduce(flat.pow(2), "sum", lengths=torch.tensor(sizes, device=flat.device)).tolist()
            self.comm.all_reduce_sum_(flat, f"{tag}/dense")
            flat.div_(world)
            for item, part, total in zip(group, torch.split(flat, sizes), totals):
                mean_out[item.position] = part.view(item.shape)
                sent_out[item.position] = inputs[item.position].to(item.dtype)
                energy[item.position] = TensorEnergy(total, total, 0, 0, 0)

        # per family: rows [:n] hold what this worker sent, rows [n:] the mean over workers
        selected: dict[Any, tuple[Tensor, Tensor]] = {}
        decode: dict[Any, Tensor] = {}
        for key, members in plan.families.items():
            ref = members[0]
            n_tiles = sum(m.n_tiles for m in members)
            tiles = torch.empty((n_tiles, *ref.layout.tile_shape), dtype=ref.dtype, device=ref.device)
            for m in members:
                to_tiles(inputs[m.position].to(ref.dtype), m.layout, out=tiles[m.rows])
            spectrum = dct2(tiles)
            positions, values = select(spectrum, ref.k, cfg.selection)
            selected[key] = (positions, values)
            # per input: energy of all its tiles and of what was kept (one reduction for the family)
            per_tile = torch.stack([spectrum.pow(2).sum((1, 2)), values.pow(2).sum(1)], 1).double()
            lengths = torch.tensor([m.n_tiles for m in members], device=ref.device)
            member_energy = torch.segment_reduce(per_tile, "sum", lengths=lengths, axis=0).tolist()
            cumulative = self._energy_cumsum(spectrum) if energy_curve else None
            for index, m in enumerate(members):
                total, kept = member_energy[index]
                curve = None
                if cumulative is not None:
                    curve = cumulative[m.rows].sum(0).double() / total if total > 0 else torch.ones(cumulative.shape[1], dtype=torch.float64)
                energy[m.position] = TensorEnergy(total, kept, m.k, m.layout.tile_numel, m.n_tiles, curve)
            decode[key] = torch.zeros((2 * n_tiles, ref.layout.tile_numel), dtype=ref.dtype, device=ref.device)

        coefficients = 0
        for bucket in plan.buckets:
            if cfg.all_reduces:
                parts = []
                for run in bucket:
                    positions, values = (x[run.rows] for x in selected[run.family])
                    # saturate so that the SUM of W values in the wire format stays finite (each
                    # |value| <= about max / W; the excess stays in the sender's residual)
                    narrow = saturate(values, cfg.value_format, world)
                    self._sent_rows(decode, run).scatter_(1, positions, narrow.to(values.dtype))
                    parts.append(narrow.reshape(-1))
                flat = torch.cat(parts)
                self.comm.all_reduce_sum_(flat, f"{tag}/lowpass")
                offset = 0
                for run in bucket:
                    positions, values = (x[run.rows] for x in selected[run.family])
                    part = flat[offset : offset + values.numel()].view_as(values).to(values.dtype)
                    self._mean_rows(decode, run).scatter_(1, positions, part)
                    offset += values.numel()
                    coefficients += values.numel()
                continue
            segments = []
            for run in bucket:
                positions, values = (x[run.rows] for x in selected[run.family])
                tile_numel = run.items[0].layout.tile_numel
                buf, decoded = pack_segments(positions if cfg.sends_positions else None, values, run.tiles, tile_numel, cfg.value_format)
                self._sent_rows(decode, run).scatter_(1, positions, decoded.to(values.dtype))
                segments.append(buf)
                coefficients += values.numel()
            gathered = self.comm.all_gather_bytes(torch.cat(segments), f"{tag}/{'topk' if cfg.sends_positions else 'values'}")
            for rank_buf in gathered:  # rank order 0..W-1 on every replica
                offset = 0
                for run in bucket:
                    own_positions, own_values = (x[run.rows] for x in selected[run.family])
                    positions, values = unpack_segments(
                        rank_buf[offset : offset + run.nbytes], run.tiles, own_values.shape[1], run.items[0].layout.tile_numel,
                        cfg.value_format, cfg.sends_positions,
                    )
                    self._mean_rows(decode, run).scatter_add_(1, positions if positions is not None else own_positions, values.to(own_values.dtype))
                    offset += run.nbytes

        for key, members in plan.families.items():
            buf = decode[key]
            n = buf.shape[0] // 2
            buf[n:].div_(world)
            tiles = idct2(buf.view(2 * n, *members[0].layout.tile_shape))
            for m in members:
                sent_out[m.position] = from_tiles(tiles[m.rows], m.layout)
                mean_out[m.position] = from_tiles(tiles[n:][m.rows], m.layout)
        self.coefficients = coefficients
        self.last_energy = [e for e in energy if e is not None]
        return [t for t in mean_out if t is not None], [t for t in sent_out if t is not None]

    def _energy_cumsum(self, coefficients: Tensor) -> Tensor:
        """Per tile, the energy of its best 1, 2, ... coefficients under this selection rule."""
        squared = coefficients.pow(2).flatten(1)
        if self.config.selection == "topk":
            ordered = squared.sort(dim=1, descending=True).values
        else:
            ordered = squared[:, lowpass_order(coefficients.shape[1], coefficients.shape[2], squared.device)]
        return ordered.cumsum(1)

    @staticmethod
    def _sent_rows(decode: dict[Any, Tensor], run: _Run) -> Tensor:
        return decode[run.family][run.rows]

    @staticmethod
    def _mean_rows(decode: dict[Any, Tensor], run: _Run) -> Tensor:
        buf = decode[run.family]
        return buf[buf.shape[0] // 2 :][run.rows]


def _resolve_overrides(tensors: list[Tensor], overrides: Optional[list[Optional[TensorCodec]]]) -> list[TensorCodec]:
    if overrides is None:
        return [_INHERIT] * len(tensors)
    if len(overrides) != len(tensors):
        raise ValueError(f"got {len(overrides)} per-tensor codec settings for {len(tensors)} tensors; give one per tensor (None inherits)")
    return [o if o is not None else _INHERIT for o in overrides]


_INHERIT = TensorCodec()
