"""Settings of the DeMo codec, declared once: the exchange (:class:`~demo_lightning.algorithms.DeMoConfig`)
and DES-LOC's compressed parameter sync (:class:`~demo_lightning.algorithms.desloc.DesLocConfig`) both
hold a :class:`CodecConfig`; :class:`TensorCodec` is one tensor's departures from it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Optional, get_args

import torch

from demo_lightning.codec import VALUE_FORMATS, TileLayout, ValueFormat, coefficients_per_tile, plan_tiles
from demo_lightning.codec import DEFAULT_HEAD_SHARE, PositionFormat, positions_nbytes, segment_nbytes, validate_strength
from demo_lightning.codec.bases import TRANSFORMS, Transform
from demo_lightning.validation import check_choice, check_int, check_number, check_optional_int

__all__ = [
    "DENSE_FORMATS", "DEFAULT_TOPK", "DenseFormat", "GATHERED_PER_TILE", "MIN_DEFAULT_TOPK", "EXCHANGE_SELECTIONS", "WIRE_DTYPES", "CodecConfig", "ExchangeSelection",
    "POSITION_FORMAT_SETTINGS", "PositionFormatSetting", "TensorCodec", "compute_dtype", "default_topk", "resolve_position_format",
]

DEFAULT_TOPK = 64
"""The default coefficients per tile at one or two workers (an all-gathered exchange), and at every
``W`` for an all-reduced one (``"shared"``, low-pass float values)."""
GATHERED_PER_TILE = 128
"""``W * k``: the coefficients of each tile that reach every worker per step under the default k."""
MIN_DEFAULT_TOPK = 8
"""The default k never goes below this (from 16 workers on, the all-gather's bytes grow with W again)."""
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DenseFormat = Literal["fp32", "bf16"]
"""How the tensors under ``dense_below`` travel: ``"fp32"`` (their compute dtype: fp32, or fp64 for
double tensors) or ``"bf16"`` (rounded to bfloat16, half the bytes; the rounding error stays with
the sender, in its residual momentum or the caller's error feedback)."""
DENSE_FORMATS: tuple[str, ...] = get_args(DenseFormat)
ExchangeSelection = Literal["topk", "lowpass", "shared"]
"""Which coefficients a worker sends: its own top-k per tile, the fixed lowest frequencies, or the
positions one worker chose for everybody this step (``"shared"``, see :class:`CodecConfig`)."""
EXCHANGE_SELECTIONS: tuple[str, ...] = get_args(ExchangeSelection)
PositionFormatSetting = Literal["auto", "packed", "elias_fano"]
"""A :class:`CodecConfig`'s ``position_format``: a wire coding, or ``"auto"`` (:func:`resolve_position_format`)."""
POSITION_FORMAT_SETTINGS: tuple[str, ...] = get_args(PositionFormatSetting)


def resolve_position_format(setting: str, selection: str, value_format: str) -> PositionFormat:
    """The wire coding of the positions for ``position_format=setting``: ``"packed"`` or
    ``"elias_fano"`` as given; ``"auto"`` (the default) is ``"elias_fano"`` where it applies (each
    worker sends its own positions, ``selection="topk"``, and its values need no magnitude order,
    ``value_format`` other than ``"mixed"``) and ``"packed"`` elsewhere. The two codings train bit
    for bit alike (:mod:`demo_lightning.codec.positions`), so ``"auto"`` never sends more bytes; it
    costs a sort and the code's bit arithmetic in the packer and unpacker (about 1.7x their time on a
    CPU thread, ``benchmarks/positions.py``)."""
    check_choice("position_format", setting, POSITION_FORMAT_SETTINGS,
                 "how top-k positions travel: 'auto' (Elias-Fano where it applies), 'packed' (fixed width) or 'elias_fano' (sorted, fewer bits)")
    if setting != "auto":
        return setting  # type: ignore[return-value]
    return "elias_fano" if selection == "topk" and value_format != "mixed" else "packed"


def default_topk(workers: int) -> int:
    """The default coefficients per tile for an all-gathered exchange over ``workers`` DeMo workers
    (issue 18): ``clamp(128 // W, 8, 64)``, so ``W * k`` stays 128 (64 at 2 workers, 32 at 4, 16 at 8).

    Why: with the all-gather every worker receives the ``W - 1`` others' payloads, so at a fixed k
    its bytes grow with ``W - 1`` while DDP's ring all-reduce stays about ``8 n`` a worker: at k 64
    the default moved 106x fewer bytes than DDP at 2 workers but 62x at 4. Holding ``W * k`` keeps
    the ratio about constant and the decoded update about as dense (the sum of ``W`` sparse
    components, then its sign); measured at 4 workers on two corpora (``benchmarks/parity.py``:
    1.02x DDP's loss on C/C++, 1.07x on prose, against 1.02x and 1.03x at k 64; with the exchange's
    early phase, then 4x this k for the first 40 exchanges, 1.03x on both; with 256 a tile for 20,
    the phase now, 1.03x and 1.02x). Under ``hierarchy="node"`` the
    DeMo workers are the nodes.
    """
    workers = check_int("workers", workers, 1, "DeMo workers in the exchange")
    return max(MIN_DEFAULT_TOPK, min(DEFAULT_TOPK, GATHERED_PER_TILE // workers))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Transforms run in fp32 for half-precision tensors, else in the tensor's own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass(frozen=True)
class CodecConfig:
    """How tensors are compressed on the wire.

    Args:
        chunk: tile side: 2-D views are cut into ``chunk`` x ``chunk`` tiles, 1-D into ``chunk``-long ones.
        topk: coefficients kept per tile (clamped to the tile size). When neither this nor
            ``keep_ratio`` is given, the exchange resolves it from its number of workers ``W``
            (:meth:`for_workers`): for an all-gathered exchange :func:`default_topk` ``(W)`` =
            ``clamp(128 // W, 8, 64)`` (64 at 2 workers: 1.6 % of a 64x64 tile; 32 at 4), so the bytes
            per worker do not grow with ``W`` up to 16; 64 for an all-reduced one. (The paper used 32
            with fp32 values.) Unresolved, :attr:`strength` reads 64.
        keep_ratio: fraction of each tile kept, in (0, 1]; exclusive with ``topk``.
        selection: ``"topk"`` (largest magnitudes, positions sent) or ``"lowpass"`` (fixed lowest
            frequencies, no positions; all-reduced when ``value_format`` is a float format), or
            ``"shared"``: ScaleCom's cyclic local top-k (Chen et al., NeurIPS 2020): at exchange
            ``t`` worker ``t mod W`` alone picks the top-k positions per tile from its own momentum and
            broadcasts them bit-packed; every worker sends its values at those positions, summed by
            an all-reduce, so the bytes per worker do not grow with ``W``. Needs a float
            ``value_format`` (values are summed on the wire); error feedback as usual.
        value_format: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` (one byte a value
            with a per-tile fp32 scale), ``"int8"``, ``"mixed"`` (per tile the strongest ``fp16_share``
            of the kept values in fp16, the rest in int8) or ``"sign"``; see
            :mod:`demo_lightning.codec.packing` for each format's bytes and rounding.
        fp16_share: with ``value_format="mixed"``, the share of each tile's kept values sent in fp16
            (``ceil(fp16_share * k)``, at least one), in (0, 1); default a quarter.
        dense_below: tensors with fewer elements skip the codec and are all-reduced whole, in
            ``dense_format`` (0 disables). Default 1,024 (issue 18): 4,096 had kept a ResNet's 1x1
            convolutions and classifier (2,048 and 2,560 elements) dense: 81x fewer bytes than DDP
            on the digits ResNet-10t, 101x at 1,024 (three seeds: the same validation accuracy as
            DDP's; the README's parity table).
        dense_vectors: 1-D tensors (norm gains, biases) skip the codec whatever their size, as
            PyTorch's PowerSGD hook leaves them uncompressed: a DCT over unrelated channels has no
            spatial meaning, and their bytes are a vanishing share of a model's (a 7 B LLaMA's
            norms are 0.004 % of its elements). ``False``: a 1-D tensor is compressed when it has
            ``dense_below`` elements or more (the 1-D chunk codec).
        dense_format: the wire format of those tensors: ``"bf16"`` (the default: 2 bytes an element,
            summed in bfloat16; the sender keeps its rounding error ``m - bf16(m)`` as residual
            momentum, so nothing is lost over steps, as for the compressed tensors' unsent
            coefficients) or ``"fp32"`` (the compute dtype, exact: 4 bytes an element, 8 for fp64).
            bfloat16 has fp32's exponent range, so no value saturates. Issue 18: on the 0.44 M GPT the
            norms sent densely in fp32 were 5,120 of the 16,784 bytes a step (30 %).
        bucket_cap_mb: largest payload of one collective, in megabytes.
        transform: the orthonormal transform of every tile, before the same selection and error
            feedback (:mod:`demo_lightning.codec.bases`): ``"dct"`` (DCT-II, the paper's), ``"haar"``
            (Haar wavelets, rows coarse to fine: for a tile side ``n = 2^L`` the ``L``-level Haar matrix
            ``h_0 = 1/sqrt(n)``, ``h_{2^p+q}(t) = sqrt(2^p/n) (+1 | -1)`` on the two halves of the
            ``q``-th of ``2^p`` segments; other sides, e.g. a dimension below ``chunk``, get the
            unbalanced Haar basis of the same halving recursion, also orthonormal) or ``"identity"``
            (no transform, SparseLoCo's chunked top-k: the momentum is stored and selected as it is; no
            GEMM). ``"lowpass"`` keeps the coarsest Haar scales first; under ``"identity"`` it has no
            meaning and is refused unless every coefficient is kept.
        position_group_size: with ``"topk"``: tensors of the same shape and settings share their
            positions in groups of this many (seed 000 §7, "every 10 layers share base frequencies"):
            in plan order, the compressed tensors of one shape (e.g. the same projection in
            consecutive blocks) are cut into groups of ``position_group_size``; per tile index each
            group keeps the ``k`` positions of largest summed energy ``sum_m |K_m|^2`` over its members
            and sends them once, in its first member's segment; every member sends its own values
            there. ``1`` (the default): every tensor picks and sends its own.
        position_format: how the positions of ``"topk"`` travel: ``"auto"`` (the default:
            ``"elias_fano"`` with ``selection="topk"`` unless ``value_format="mixed"``, else
            ``"packed"``; resolved when the config is made, so the field then holds the coding),
            ``"packed"`` (each in ``ceil(log2(chunk^2))`` bits, 12 for a 64 x 64 tile) or ``"elias_fano"`` (each tile's
            positions sorted and Elias-Fano coded, about ``2 + log2(chunk^2 / k)`` bits each: 9 at k
            32, 8 at k 64, 6 at k 256; where that is not smaller, e.g. k 1, the fixed width). Lossless:
            the same coefficients, scales and decoded values as ``"packed"``, so the same training
            bit for bit, on fewer bytes (:mod:`demo_lightning.codec.positions`). Each tile's values
            go on the wire in ascending position order, so it cannot be combined with
            ``value_format="mixed"`` (strongest first).
    """

    chunk: int = 64
    topk: Optional[int] = None
    keep_ratio: Optional[float] = None
    selection: ExchangeSelection = "topk"
    value_format: ValueFormat = "sign"
    dense_below: int = 1024
    dense_vectors: bool = True
    dense_format: DenseFormat = "bf16"
    bucket_cap_mb: float = 25.0
    fp16_share: float = DEFAULT_HEAD_SHARE
    transform: Transform = "dct"
    position_group_size: int = 1
    position_format: PositionFormatSetting = "auto"

    def __post_init__(self) -> None:
        check_int("chunk", self.chunk, 1, "tile side; the paper uses 64")
        validate_strength(self.topk, self.keep_ratio)
        check_choice("selection", self.selection, EXCHANGE_SELECTIONS)
        check_choice("value_format", self.value_format, VALUE_FORMATS)
        check_choice("transform", self.transform, TRANSFORMS, "the tile transform: DCT-II, Haar wavelets, or none")
        if self.transform == "identity" and self.selection == "lowpass" and not self.keeps_everything:
            raise ValueError(
                "transform='identity' has no frequencies, so selection='lowpass' would send the same first k elements "
                "of every tile forever and never the rest: use selection='topk' (chunked top-k, as SparseLoCo) or "
                "'shared', or keep every coefficient (keep_ratio=1.0)"
            )
        if self.selection == "shared" and self.value_format not in WIRE_DTYPES:
            raise ValueError(
                f"selection='shared' sums the values of every worker on the wire (an all-reduce), which "
                f"value_format={self.value_format!r} cannot be: use value_format='fp32', 'bf16' or 'fp16', or "
                "selection='topk' for 1-bit or int8 values"
            )
        check_number("fp16_share", self.fp16_share, 0.0, 1.0, low_open=True, high_open=True,
                     hint="the share of each tile's kept values sent in fp16 under value_format='mixed'; e.g. 0.25")
        check_int("dense_below", self.dense_below, 0, "element count")
        if not isinstance(self.dense_vectors, bool):
            raise ValueError(
                f"dense_vectors must be True (1-D tensors such as norms and biases skip the codec) or False (compressed "
                f"from dense_below elements), got {self.dense_vectors!r}"
            )
        check_choice("dense_format", self.dense_format, DENSE_FORMATS,
                     "the wire format of the tensors under dense_below: 'bf16' (half the bytes, rounding error kept as residual) or 'fp32' (exact)")
        check_int("position_group_size", self.position_group_size, 1, "tensors of one shape that share their positions; 1: off")
        if self.position_group_size > 1 and self.selection != "topk":
            raise ValueError(
                f"position_group_size={self.position_group_size} shares top-k positions between tensors, but "
                f"selection={self.selection!r} sends no positions of its own ('lowpass': fixed, 'shared': one worker's "
                "for everybody): use selection='topk', or position_group_size=1"
            )
        check_number("bucket_cap_mb", self.bucket_cap_mb, 0.0, low_open=True, hint="megabytes per collective")
        object.__setattr__(self, "position_format", resolve_position_format(self.position_format, self.selection, self.value_format))
        if self.position_format == "elias_fano" and self.selection != "topk":
            sent = "no positions" if self.selection == "lowpass" else "one worker's positions, broadcast bit-packed"
            raise ValueError(
                f"position_format='elias_fano' codes the positions each worker sends with selection='topk'; "
                f"selection={self.selection!r} sends {sent}: use selection='topk', or position_format='packed'"
            )
        if self.position_format == "elias_fano" and self.value_format == "mixed":
            raise ValueError(
                "position_format='elias_fano' sends each tile's values in ascending position order, but "
                "value_format='mixed' sends the strongest first (its fp16 head): use another value_format, or position_format='packed'"
            )

    @property
    def strength(self) -> tuple[Optional[int], Optional[float]]:
        """``(topk, keep_ratio)`` with the default applied."""
        if self.topk is None and self.keep_ratio is None:
            return DEFAULT_TOPK, None
        return self.topk, self.keep_ratio

    @property
    def default_strength(self) -> bool:
        """Neither ``topk`` nor ``keep_ratio`` was given: the exchange chooses k (:meth:`for_workers`)."""
        return self.topk is None and self.keep_ratio is None

    def for_workers(self, workers: int, topk_factor: int = 1) -> "CodecConfig":
        """These settings for an exchange over ``workers`` DeMo workers, keeping ``topk_factor``
        times their k (the exchange's early phase passes its factor, see
        :class:`~demo_lightning.algorithms.DeMoConfig`): with neither ``topk`` nor ``keep_ratio``
        given, ``topk`` set to ``topk_factor`` times the default k, :func:`default_topk`
        ``(workers)`` when the values are all-gathered (:attr:`all_reduces` false), else
        :data:`DEFAULT_TOPK`; given a strength, that strength times ``topk_factor`` (a
        ``keep_ratio`` capped at 1; a ``topk`` past the tile keeps the whole tile). Every rank of an
        exchange resolves the same k (they agree on ``workers``)."""
        check_int("topk_factor", topk_factor, 1, "times the default k")
        if not self.default_strength:
            if topk_factor == 1:
                return self
            if self.topk is not None:
                return replace(self, topk=topk_factor * self.topk)
            return replace(self, keep_ratio=min(1.0, topk_factor * float(self.keep_ratio)))
        if self.all_reduces:
            return self if topk_factor == 1 else replace(self, topk=topk_factor * DEFAULT_TOPK)
        return replace(self, topk=topk_factor * default_topk(workers))

    @property
    def keeps_everything(self) -> bool:
        """Every coefficient of every tile is kept (``keep_ratio=1.0``, or a ``topk`` of at least ``chunk^2``)."""
        topk, keep_ratio = self.strength
        return keep_ratio == 1.0 or (topk is not None and topk >= self.chunk * self.chunk)

    @property
    def sends_positions(self) -> bool:
        """Every worker sends its own positions with its values (``"topk"``)."""
        return self.selection == "topk"

    @property
    def all_reduces(self) -> bool:
        """Values summed by an all-reduce: ``"shared"``, and low-pass values in a float format;
        everything else is all-gathered."""
        return self.selection == "shared" or (self.selection == "lowpass" and self.value_format in WIRE_DTYPES)

    def layout(self, shape: tuple[int, ...], own: Optional["TensorCodec"] = None) -> tuple[Optional[TileLayout], int]:
        """``(tiles, k)`` for a tensor of ``shape`` under ``own``: ``(None, 0)`` when it is sent densely."""
        own = own if own is not None else _INHERIT
        if own.dense if own.dense is not None else self.sends_densely(shape):
            return None, 0
        topk, keep_ratio = own.strength(self)
        layout = plan_tiles(shape, own.chunk if own.chunk is not None else self.chunk)
        return layout, coefficients_per_tile(layout.tile_numel, topk, keep_ratio)

    def sends_densely(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of ``shape`` skips the codec by these settings alone (a
        :class:`TensorCodec`'s ``dense`` overrides it): fewer than :attr:`dense_below` elements, or
        1-D under :attr:`dense_vectors`."""
        return math.prod(shape) < self.dense_below or (self.dense_vectors and len(shape) <= 1)

    @property
    def strongest_first(self) -> bool:
        """Whether the selection orders each tile's values by magnitude, largest first (``"mixed"``
        sends the first ``fp16_share`` of them in fp16)."""
        return self.value_format == "mixed"

    def dense_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The wire dtype of a tensor of ``dtype`` sent densely (:attr:`dense_format`)."""
        return torch.bfloat16 if self.dense_format == "bf16" else compute_dtype(dtype)

    def dense_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of ``numel`` elements of a ``dtype`` tensor sent densely (:attr:`dense_format`)."""
        return numel * self.dense_dtype(dtype).itemsize

    def payload_bytes(self, shape: tuple[int, ...], own: Optional["TensorCodec"] = None) -> int:
        """Bytes one worker hands to the collectives for a tensor of ``shape`` (an fp32 tensor's
        :meth:`dense_nbytes` when dense); for ``"shared"``: its values plus the bit-packed positions
        of the broadcast."""
        layout, k = self.layout(shape, own)
        if layout is None:
            return self.dense_nbytes(math.prod(shape))
        if self.selection == "shared":
            return layout.n_tiles * k * WIRE_DTYPES[self.value_format].itemsize + positions_nbytes(layout.n_tiles, k, layout.tile_numel)
        if self.all_reduces:
            return layout.n_tiles * k * WIRE_DTYPES[self.value_format].itemsize
        return segment_nbytes(layout.n_tiles, k, layout.tile_numel, self.value_format, self.sends_positions, self.fp16_share,
                              self.position_format)


@dataclass(frozen=True)
class TensorCodec:
    """One tensor's departures from the :class:`CodecConfig` (``None`` fields inherit it).

    Per-layer policies and the adaptive keep ratio set these; every rank must set the same ones
    (the plan's digest, compared across ranks at every step, includes them).

    Args:
        topk: coefficients kept per tile for this tensor.
        keep_ratio: fraction of each tile kept, in (0, 1]; exclusive with ``topk``.
        chunk: tile side for this tensor.
        dense: ``True`` sends the whole tensor by an all-reduce in ``dense_format``, ``False`` compresses it
            even below ``dense_below``.
    """

    topk: Optional[int] = None
    keep_ratio: Optional[float] = None
    chunk: Optional[int] = None
    dense: Optional[bool] = None

    def __post_init__(self) -> None:
        validate_strength(self.topk, self.keep_ratio)
        check_optional_int("chunk", self.chunk, 1, "tile side")
        if self.dense is not None and not isinstance(self.dense, bool):
            raise ValueError(f"dense must be True, False or None, got {self.dense!r}")

    def strength(self, config: CodecConfig) -> tuple[Optional[int], Optional[float]]:
        """``(topk, keep_ratio)`` for this tensor."""
        if self.topk is None and self.keep_ratio is None:
            return config.strength
        return self.topk, self.keep_ratio


_INHERIT = TensorCodec()
