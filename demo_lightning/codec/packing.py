"""Wire formats: selected coefficients packed into one ``uint8`` byte buffer.

A segment for ``T`` tiles with ``k`` coefficients each is laid out as

    [positions: T*k indices, bit-packed at ceil(log2(tile_numel)) bits,
                or T Elias-Fano codes of k positions each]                   (only when sent)
    [values: T*k values in the chosen value format (+ per-tile scales for fp8, int8, mixed and sign)]

Index width: a tile of 4096 elements needs 12 bits, not the 64 of an int64 (the DeMo reference
spends 8 of its 12 bytes per coefficient on indices); ``position_format="elias_fano"`` codes a tile's
sorted positions in about ``2 + log2(tile_numel / k)`` bits each (9 at k 32 of 4096, 8 at k 64), see
:mod:`demo_lightning.codec.positions`.

Value formats:

=========  ===============================================================  ===========
format     encoding                                                         lossless?
=========  ===============================================================  ===========
``fp32``   IEEE float32                                                     yes
``bf16``   bfloat16 (round to nearest even; beyond +-3.3895e38 saturates)   for bf16 data
``fp16``   float16 (round to nearest even; beyond +-65504 saturates)        for fp16 data
``fp8_e4m3``  per-tile scale ``s = max|v| / 448`` (fp32) and ``v/s`` as float8     no
             e4m3 (3 mantissa bits; round to nearest even, clamped to +-448)
``fp8_e5m2``  per-tile scale ``s = max|v| / 57344`` (fp32) and ``v/s`` as float8   no
             e5m2 (2 mantissa bits, more range)
``int8``   per-tile scale ``s = max|v| / 127`` (fp32) and ``round(v/s)``    no
``mixed``  per tile the strongest ``h = ceil(head_share * k)`` values in fp16,  no
           the other ``k - h`` in int8 with their own scale (``max`` of those)
``sign``   per-tile scale ``s = mean|v|`` (fp32) and one bit ``v >= 0``     no
=========  ===============================================================  ===========

``mixed`` (seed 000 §7: key frequencies in FP16, edge frequencies in INT8) sends the first ``h``
values of each row in fp16 and the rest in int8: the selections hand them over strongest first for
this format (``torch.topk(..., sorted=True)``), and ``selection="lowpass"`` in its fixed frequency
order, so the ``h`` lowest frequencies go in fp16. ``head_share`` (in (0, 1), default a quarter) is
an argument of every function here that sizes, packs or unpacks values. Every format keeps the
order of positions and values: unpacking returns them as they were packed.

:func:`pack_segment` also returns the values a receiver will decode, so a sender can subtract
exactly what it sent (error feedback keeps the quantisation error). Unpacking returns those
decoded values bit for bit; for ``fp32`` (and ``bf16``/``fp16`` data in their own format) they
equal the input exactly.

Range: finite inputs always decode to finite values. A float format *saturates*: a finite value
beyond the format's largest finite value ``M`` is sent as ``+-M`` (:func:`saturate`), where a
plain cast would give inf and poison the mean and the residual; the sender's error feedback
(``v - decoded``) keeps the excess, which goes out in later steps. The scaled formats' scales
(fp8, int8, sign) stay finite for any finite tile (``max_code * s`` and ``mean|v|`` never overflow
fp32; fp8 codes are clamped to the format's largest finite value before the cast, which would give
NaN in e4m3 and inf in e5m2), and an all-zero tile has scale 0 and decodes to exact zeros. Non-finite inputs (inf, NaN) are not disguised: they
decode to non-finite values (the non-finite guard keeps them from being exchanged at all).
:func:`saturation_limit` gives a tighter ``M`` for values that are summed in the wire format
(the low-pass all-reduce), so that a sum of ``W`` of them cannot overflow either.

:func:`pack_segments` / :func:`unpack_segments` pack many segments (one per tensor) that share
``k``, tile size and format in a fixed number of tensor operations, byte for byte equal to
concatenating :func:`pack_segment` per segment: each segment's bit fields still start on a byte
boundary, so every tensor's bytes stay what :func:`segment_nbytes` says. A segment may leave its
positions out (``with_positions`` / ``positioned`` per segment): tensors of a position group send
their shared positions once, in the group's first segment, and only values in the others.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from demo_lightning.codec.positions import PositionFormat, elias_fano_decode, elias_fano_encode, index_bits, position_bits, position_coding

__all__ = [
    "DEFAULT_HEAD_SHARE",
    "VALUE_FORMATS",
    "ValueFormat",
    "head_count",
    "index_bits",
    "pack_bits",
    "unpack_bits",
    "quantize_values",
    "saturate",
    "saturation_limit",
    "values_nbytes",
    "positions_nbytes",
    "segment_nbytes",
    "pack_segment",
    "unpack_segment",
    "pack_segments",
    "unpack_segments",
]

ValueFormat = Literal["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "mixed", "sign"]
VALUE_FORMATS: tuple[str, ...] = get_args(ValueFormat)
_FLOAT_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# one byte a value and a per-tile fp32 scale: (code dtype, largest code magnitude)
_SCALED_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
    "int8": (torch.int8, 127.0),
}
_SCALE_BYTES = 4
DEFAULT_HEAD_SHARE = 0.25
"""``mixed``: the share of each tile's kept values sent in fp16 (the rest in int8)."""


def _check_format(value_format: str) -> None:
    if value_format not in VALUE_FORMATS:
        raise ValueError(f"value_format must be one of {VALUE_FORMATS}, got {value_format!r}")


def head_count(k: int, head_share: float = DEFAULT_HEAD_SHARE) -> int:
    """``mixed``: how many of a tile's ``k`` values go in fp16: ``ceil(head_share * k)``, at least 1."""
    if not 0.0 < head_share < 1.0:
        raise ValueError(f"head_share must lie in (0, 1) (the share of each tile's kept values sent in fp16), got {head_share!r}")
    return min(k, max(1, math.ceil(head_share * k - 1e-9)))


def pack_bits(values: Tensor, bits: int) -> Tensor:
    """Pack non-negative integers ``< 2**bits`` (any integer or bool tensor) into ``uint8``, LSB first."""
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must lie in [1, 32], got {bits}")
    flat = values.reshape(-1).to(torch.int64)
    shifts = torch.arange(bits, device=flat.device, dtype=torch.int64)
    stream = ((flat.unsqueeze(1) >> shifts) & 1).reshape(-1)
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = 1 << torch.arange(8, device=flat.device, dtype=torch.int64)
    return (stream.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, count: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` integers as int64."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_bits expects uint8, got {packed.dtype}")
    if packed.numel() * 8 < count * bits:
        raise ValueError(f"buffer of {packed.numel()} bytes cannot hold {count} values of {bits} bits")
    shifts8 = torch.arange(8, device=packed.device, dtype=torch.int64)
    stream = ((packed.to(torch.int64).unsqueeze(1) >> shifts8) & 1).reshape(-1)[: count * bits]
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int64)
    return (stream.view(count, bits) * weights).sum(dim=1)


@functools.lru_cache(maxsize=64)
def saturation_limit(value_format: ValueFormat, summands: int = 1) -> float:
    """Largest magnitude ``L`` (a value of the format) such that a sum of ``summands`` values of
    magnitude at most ``L``, added in the format in any order, cannot overflow.

    For one summand ``L`` is the format's largest finite value (65504 for fp16). Otherwise a sum
    of ``W`` values computed by any tree of ``W - 1`` correctly rounded additions satisfies
    ``|s| <= (1 + u)^(W - 1) * sum|v_i|`` (``u``: the unit roundoff, half the format's epsilon),
    so ``L = max / (W * (1 + u)^(W - 1))``, rounded down onto the format's grid, keeps every
    partial sum finite: a little below ``max / W`` (fp16, W = 2: 32736, not 32752).

    Why clamp each value rather than pre-scale every value by ``1 / W`` before the sum: pre-scaling
    moves *all* values ``log2(W)`` binades closer to the format's underflow (fp16 is subnormal
    below 6.1e-5), losing precision on the small coefficients that are the common case, to protect
    the rare huge ones, which error feedback delivers in later steps anyway.

    Raises ``ValueError`` for a format without a float wire type or for ``summands < 1``.
    """
    if value_format not in _FLOAT_FORMATS:
        raise ValueError(f"saturation applies to the float formats {tuple(_FLOAT_FORMATS)}, got {value_format!r}")
    if isinstance(summands, bool) or not isinstance(summands, int) or summands < 1:
        raise ValueError(f"summands must be a positive integer (the number of workers summed), got {summands!r}")
    info = torch.finfo(_FLOAT_FORMATS[value_format])
    if summands == 1:
        return float(info.max)
    bound = float(info.max) / (summands * (1.0 + info.eps / 2) ** (summands - 1))
    exponent = math.frexp(bound)[1]  # bound lies in [2**(exponent - 1), 2**exponent)
    spacing = max(2.0 ** (exponent - 1) * info.eps, info.smallest_normal * info.eps)  # the format's spacing there
    return math.floor(bound / spacing) * spacing


def saturate(values: Tensor, value_format: ValueFormat, summands: int = 1) -> Tensor:
    """``values`` cast to the wire dtype of a float format, finite values clamped to
    ``+-saturation_limit(value_format, summands)``.

    A plain cast turns a finite value beyond the format's range into inf (fp16: anything from
    65520 up; bf16 and fp32 near fp32's max); this sends the largest magnitude the format (or a
    sum of ``summands`` such values) can carry instead, and the caller's error feedback keeps the
    difference. Infinities and NaNs pass through unchanged (the non-finite guard's business).
    Values within range are rounded exactly as ``values.to(dtype)`` rounds them.
    """
    limit = saturation_limit(value_format, summands)
    dtype = _FLOAT_FORMATS[value_format]
    if values.dtype not in (torch.float32, torch.float64):
        values = values.to(torch.float32)  # half types exactly (the limit may not be one of theirs), integers
    if float(torch.finfo(values.dtype).max) <= limit:
        return values.to(dtype)  # fp32 into fp32: nothing can lie beyond the limit
    clamped = values.clamp(-limit, limit)  # NaN stays NaN
    return torch.where(torch.isinf(values), values, clamped).to(dtype)


def _encode_values(
    values: Tensor, value_format: ValueFormat, segments: tuple[int, ...] | None = None, head_share: float = DEFAULT_HEAD_SHARE,
    wire_order: Tensor | None = None,
) -> tuple[list[Tensor], Tensor]:
    """Encode ``values`` ``(T, k)``: the wire bytes per field and the fp32 values a receiver will decode.

    ``segments``: values per segment (default one segment); sign bits are byte-aligned per segment.
    ``wire_order`` ``(T, k)``: each row's values go on the wire in this order (Elias-Fano positions
    travel sorted); the per-tile scales and the decoded values (returned in the given order) are
    computed from the values as given, so they are bit for bit those of the unpermuted encoding.
    """
    _check_format(value_format)

    def wire(x: Tensor) -> Tensor:  # an element-wise field in wire order (float8 gathered as its bytes)
        if wire_order is None:
            return x
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return x.view(torch.uint8).gather(1, wire_order).view(x.dtype)
        return x.gather(1, wire_order)

    values = saturate(values, "fp32")  # float64 beyond fp32's range: fp32's max, not inf (as below)
    if value_format in _FLOAT_FORMATS:
        narrow = saturate(values, value_format)
        return [_as_bytes(wire(narrow))], narrow.to(torch.float32)
    if value_format in _SCALED_FORMATS:
        return _encode_scaled(values, value_format, wire)
    if value_format == "mixed":
        if wire_order is not None:
            raise ValueError("value_format='mixed' sends each tile's strongest values first; it takes no other wire order")
        h = head_count(values.shape[1], head_share)
        head = saturate(values[:, :h], "fp16")
        tail_parts, tail = _encode_scaled(values[:, h:], "int8")
        return [_as_bytes(head), *tail_parts], torch.cat([head.to(torch.float32), tail], dim=1)
    magnitude = values.abs()
    peak = magnitude.amax(dim=1, keepdim=True)
    scale = magnitude.mean(dim=1, keepdim=True)
    # the sum of |v| can overflow fp32 although every |v| is finite: then mean|v| = max|v| * mean(|v| / max|v|)
    rescaled = peak * (magnitude / torch.where(peak > 0, peak, torch.ones_like(peak))).mean(dim=1, keepdim=True)
    scale = torch.where(torch.isinf(scale) & torch.isfinite(peak), rescaled, scale)
    positive = values >= 0
    bits = _pack_bit_fields(wire(positive), 1, segments if segments is not None else (positive.numel(),))
    return [_as_bytes(scale), bits], _decode_sign(scale, positive)


def _encode_scaled(values: Tensor, value_format: str, wire: Callable[[Tensor], Tensor] = lambda x: x) -> tuple[list[Tensor], Tensor]:
    """fp8 / int8: a per-row scale ``s = max|v| / max_code`` (fp32) and one-byte codes of ``v / s``."""
    dtype, top = _SCALED_FORMATS[value_format]
    if values.shape[1] == 0:  # mixed with every value in the head: an empty tail still has its scale
        scale = values.new_zeros((values.shape[0], 1))
        return [_as_bytes(scale), values.new_zeros(0, dtype=torch.uint8)], values.new_zeros(values.shape)
    scale = values.abs().amax(dim=1, keepdim=True) / top
    # max|v| near fp32's max: s = max|v| / max_code may round up so far that max_code * s is inf; step down
    scale = torch.where(torch.isinf(scale * top) & torch.isfinite(scale), torch.nextafter(scale, torch.zeros_like(scale)), scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero tile: codes 0, decoded 0 * 0
    scaled = values / safe
    if dtype == torch.int8:
        codes = torch.round(scaled).clamp_(-top, top).to(torch.int8)
    else:  # round to nearest even in the float8 format; clamp first: a cast beyond its range gives NaN (e4m3) / inf
        codes = scaled.clamp(-top, top).to(dtype)
    return [_as_bytes(scale), _as_bytes(wire(codes))], _decode_scaled(scale, codes)


def _decode_scaled(scale: Tensor, codes: Tensor) -> Tensor:
    return codes.to(torch.float32) * scale


def _decode_sign(scale: Tensor, positive: Tensor) -> Tensor:
    return torch.where(positive, scale, -scale)


def quantize_values(values: Tensor, value_format: ValueFormat, head_share: float = DEFAULT_HEAD_SHARE) -> Tensor:
    """Round ``values`` ``(T, k)`` through ``value_format``; return what a receiver decodes (fp32).

    ``mixed``: in the given order (the first ``h`` of each row in fp16), as without positions."""
    return _encode_values(values, value_format, head_share=head_share)[1]


def values_nbytes(n_tiles: int, k: int, value_format: ValueFormat, head_share: float = DEFAULT_HEAD_SHARE) -> int:
    """Bytes taken by ``n_tiles * k`` values (and their scales) in ``value_format``."""
    return sum(_value_field_sizes(n_tiles, k, value_format, head_share))


def _value_field_sizes(n_tiles: int, k: int, value_format: str, head_share: float) -> list[int]:
    """The values' fields of one segment, in wire order."""
    _check_format(value_format)
    count = n_tiles * k
    if value_format in _FLOAT_FORMATS:
        return [count * _FLOAT_FORMATS[value_format].itemsize]
    if value_format in _SCALED_FORMATS:
        return [n_tiles * _SCALE_BYTES, count]
    if value_format == "mixed":
        h = head_count(k, head_share)
        return [n_tiles * h * 2, n_tiles * _SCALE_BYTES, n_tiles * (k - h)]
    return [n_tiles * _SCALE_BYTES, math.ceil(count / 8)]


def positions_nbytes(n_tiles: int, k: int, tile_numel: int, position_format: PositionFormat = "packed") -> int:
    """Bytes of ``n_tiles`` tiles' ``k`` in-tile positions each, coded by ``position_format``
    (:func:`~demo_lightning.codec.positions.position_bits` a tile), padded to a byte."""
    return math.ceil(n_tiles * position_bits(k, tile_numel, position_format) / 8)


def segment_nbytes(
    n_tiles: int, k: int, tile_numel: int, value_format: ValueFormat, with_positions: bool, head_share: float = DEFAULT_HEAD_SHARE,
    position_format: PositionFormat = "packed",
) -> int:
    """Bytes of one packed segment (see the module docstring for the layout)."""
    position_bytes = positions_nbytes(n_tiles, k, tile_numel, position_format) if with_positions else 0
    return position_bytes + values_nbytes(n_tiles, k, value_format, head_share)


def _as_bytes(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.uint8).reshape(-1)


def _from_bytes(buf: Tensor, dtype: torch.dtype) -> Tensor:
    # a slice of a bigger buffer may be misaligned for dtype: copy before reinterpreting
    return buf.clone().view(dtype)


def pack_segment(
    positions: Tensor | None, values: Tensor, tile_numel: int, value_format: ValueFormat, head_share: float = DEFAULT_HEAD_SHARE,
    position_format: PositionFormat = "packed",
) -> tuple[Tensor, Tensor]:
    """Pack positions (optional) and values ``(T, k)`` into one ``uint8`` buffer.

    Returns:
        ``(buffer, decoded)``: the bytes, and the fp32 values that :func:`unpack_segment` will
        return for them (bit for bit; in position order under Elias-Fano positions), for the
        sender's error feedback.
    """
    return pack_segments(positions, values, (values.shape[0],), tile_numel, value_format, head_share,
                         position_format=position_format)


def unpack_segment(
    buf: Tensor, n_tiles: int, k: int, tile_numel: int, value_format: ValueFormat, with_positions: bool,
    head_share: float = DEFAULT_HEAD_SHARE, position_format: PositionFormat = "packed",
) -> tuple[Tensor | None, Tensor]:
    """Inverse of :func:`pack_segment`: ``(positions or None, values as fp32)``, both ``(T, k)``."""
    return unpack_segments(buf, (n_tiles,), k, tile_numel, value_format, with_positions, head_share, position_format)

@functools.lru_cache(maxsize=256)
def _bit_field_index(counts: tuple[int, ...], bits: int, device: torch.device) -> tuple[int, Tensor | None]:
    """``(padded_bits, destination)`` for bit fields of ``counts[i] * bits`` bits, each padded to a byte.

    ``destination[j]`` is where bit ``j`` of the unpadded concatenation lands; ``None`` when no
    segment needs padding (the concatenation is already aligned).
    """
    lengths = [c * bits for c in counts]
    padded = [8 * math.ceil(n / 8) for n in lengths]
    if lengths == padded:
        return sum(lengths), None
    pads = torch.tensor([p - n for p, n in zip(padded, lengths)], dtype=torch.int64)
    before = pads.cumsum(0) - pads  # padding bits ahead of each segment
    offsets = torch.repeat_interleave(before, torch.tensor(lengths, dtype=torch.int64))
    return sum(padded), (torch.arange(sum(lengths), dtype=torch.int64) + offsets).to(device)


def _pack_bit_fields(values: Tensor, bits: int, counts: tuple[int, ...]) -> Tensor:
    """``cat(pack_bits(v_i, bits))`` over consecutive runs ``v_i`` of ``counts[i]`` values."""
    total, destination = _bit_field_index(counts, bits, values.device)
    if destination is None:
        return pack_bits(values, bits)
    flat = values.reshape(-1).to(torch.int64)
    stream = ((flat.unsqueeze(1) >> torch.arange(bits, device=flat.device, dtype=torch.int64)) & 1).reshape(-1)
    padded = stream.new_zeros(total)
    padded[destination] = stream
    return pack_bits(padded, 1)


def _unpack_bit_fields(packed: Tensor, bits: int, counts: tuple[int, ...]) -> Tensor:
    """Inverse of :func:`_pack_bit_fields`: all values, as int64."""
    total, destination = _bit_field_index(counts, bits, packed.device)
    if destination is None:
        return unpack_bits(packed, bits, sum(counts))
    stream = unpack_bits(packed, 1, total)[destination]
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int64)
    return (stream.view(-1, bits) * weights).sum(dim=1)


def _pack_positions(positions: Tensor, k: int, tile_numel: int, carried: tuple[int, ...], position_format: PositionFormat) -> Tensor:
    """The positions field: each segment's ``carried[i]`` positions (``k`` a row), coded, padded to a byte."""
    if position_coding(k, tile_numel, position_format) == "packed":
        return _pack_bit_fields(positions, index_bits(tile_numel), carried)
    bits = elias_fano_encode(positions.reshape(-1, k), tile_numel)
    return _pack_bit_fields(bits, 1, tuple(n // k * bits.shape[1] for n in carried))


def _unpack_positions(field: Tensor, k: int, tile_numel: int, carried: tuple[int, ...], position_format: PositionFormat) -> Tensor:
    """Inverse of :func:`_pack_positions`: the positions ``(sum(carried) // k, k)``."""
    if position_coding(k, tile_numel, position_format) == "packed":
        return _unpack_bit_fields(field, index_bits(tile_numel), carried).view(-1, k)
    per_tile = position_bits(k, tile_numel, position_format)
    bits = _unpack_bit_fields(field, 1, tuple(n // k * per_tile for n in carried))
    return elias_fano_decode(bits.view(-1, per_tile), k, tile_numel)


def _position_flags(counts: tuple[int, ...], with_positions: bool | Sequence[bool]) -> tuple[bool, ...]:
    """One flag per segment: whether it carries its positions (a bool applies to every segment)."""
    if isinstance(with_positions, bool):
        return (with_positions,) * len(counts)
    flags = tuple(bool(f) for f in with_positions)
    if len(flags) != len(counts):
        raise ValueError(f"got {len(flags)} position flags for {len(counts)} segments; give one per segment")
    return flags


def _field_sizes(
    tiles: tuple[int, ...], k: int, tile_numel: int, value_format: str, flags: tuple[bool, ...], head_share: float,
    position_format: PositionFormat = "packed",
) -> list[list[int]]:
    """Per field (positions, scales, values, ...) in wire order, the bytes each segment gives it."""
    fields = []
    if any(flags):
        fields.append([positions_nbytes(t, k, tile_numel, position_format) if f else 0 for t, f in zip(tiles, flags)])
    per_segment = [_value_field_sizes(t, k, value_format, head_share) for t in tiles]
    fields.extend([sizes[f] for sizes in per_segment] for f in range(len(per_segment[0])))
    return fields


@functools.lru_cache(maxsize=256)
def _interleave_index(
    tiles: tuple[int, ...], k: int, tile_numel: int, value_format: str, flags: tuple[bool, ...], device: torch.device,
    head_share: float = DEFAULT_HEAD_SHARE, position_format: PositionFormat = "packed",
) -> Tensor | None:
    """Index that turns field-major bytes (every segment's positions, then every scale, ...) into
    segment-major wire order (segment 0's fields, then segment 1's, ...); ``None`` for one segment."""
    if len(tiles) == 1:
        return None
    fields = _field_sizes(tiles, k, tile_numel, value_format, flags, head_share, position_format)
    starts, base = [], 0
    for sizes in fields:
        starts.append([base + sum(sizes[:i]) for i in range(len(tiles))])
        base += sum(sizes)
    pieces = [torch.arange(starts[f][i], starts[f][i] + fields[f][i], dtype=torch.int64) for i in range(len(tiles)) for f in range(len(fields))]
    return torch.cat(pieces).to(device)


def pack_segments(
    positions: Tensor | None, values: Tensor, tiles: Sequence[int], tile_numel: int, value_format: ValueFormat,
    head_share: float = DEFAULT_HEAD_SHARE, positioned: Sequence[bool] | None = None, position_format: PositionFormat = "packed",
    wire_order: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Pack consecutive segments of ``tiles[i]`` rows each, as :func:`pack_segment` would one by one.

    ``position_format="elias_fano"`` codes each tile's positions as
    :mod:`~demo_lightning.codec.positions` says, where that is smaller than the fixed width: each
    row's positions go sorted, and every row's values in ``wire_order`` ``(sum(tiles), k)``, the
    order that sorts its positions (by default ``positions.argsort(dim=1)``, which needs every
    segment to carry positions; with position groups the caller gives it, members in their
    carrier's order). The scales and the returned decoded values are those of the values as given,
    so the sender's error feedback and the receivers' decoded sets are bit for bit ``"packed"``'s;
    :func:`unpack_segments` returns the positions sorted, each value beside its own.

    ``values`` are ``(sum(tiles), k)``; ``positions`` the same rows, or (``positioned`` given: one
    flag per segment) only the rows of the segments whose flag is set, which alone carry positions.
    The buffer equals ``cat([pack_segment(rows of segment i) for i])`` byte for byte, in a number of
    tensor operations that does not grow with the number of segments. Returns ``(buffer, decoded)``.
    """
    counts = tuple(int(t) for t in tiles)
    if sum(counts) != values.shape[0]:
        raise ValueError(f"segments cover {sum(counts)} tiles, values have {values.shape[0]} rows")
    flags = _position_flags(counts, positions is not None if positioned is None else positioned)
    if any(flags) and positions is None:
        raise ValueError("positioned marks segments that carry positions, but no positions were given")
    k = values.shape[1]
    per_segment = tuple(t * k for t in counts)
    coded = any(flags) and position_coding(k, tile_numel, position_format) == "elias_fano"
    ascending = None  # the carried positions, sorted (Elias-Fano)
    if coded:
        assert positions is not None
        if wire_order is None:
            if not all(flags):
                raise ValueError("Elias-Fano positions with segments that carry none (position groups) need wire_order: "
                                 "each row's order that sorts its (or its carrier's) positions")
            ascending, wire_order = positions.reshape(-1, k).sort(dim=1)
        else:
            ascending = positions.reshape(-1, k).sort(dim=1).values
    parts, decoded = _encode_values(values, value_format, per_segment, head_share, wire_order if coded else None)
    if any(flags):
        carried = tuple(n for n, f in zip(per_segment, flags) if f)
        assert positions is not None
        if positions.numel() != sum(carried):
            raise ValueError(f"positions hold {positions.numel()} entries, the segments that carry them {sum(carried)}")
        if ascending is not None:
            positions = ascending
        parts.insert(0, _pack_positions(positions, k, tile_numel, carried, position_format))
    buf = torch.cat(parts) if len(parts) > 1 else parts[0]
    interleave = _interleave_index(counts, k, tile_numel, value_format, flags, buf.device, head_share, position_format)
    return (buf if interleave is None else buf[interleave]), decoded


def unpack_segments(
    buf: Tensor, tiles: Sequence[int], k: int, tile_numel: int, value_format: ValueFormat, with_positions: bool | Sequence[bool],
    head_share: float = DEFAULT_HEAD_SHARE, position_format: PositionFormat = "packed",
) -> tuple[Tensor | None, Tensor]:
    """Inverse of :func:`pack_segments`: ``(positions or None, values as fp32)``; values are
    ``(sum(tiles), k)``, positions the rows of the segments that carry them (``with_positions``: a
    bool for every segment, or one flag per segment)."""
    _check_format(value_format)
    counts = tuple(int(t) for t in tiles)
    flags = _position_flags(counts, with_positions)
    n_tiles = sum(counts)
    expected = sum(segment_nbytes(t, k, tile_numel, value_format, f, head_share, position_format) for t, f in zip(counts, flags))
    if buf.numel() != expected:
        raise ValueError(f"segment{'s' if len(counts) > 1 else ''} of {counts} tiles x {k} hold {buf.numel()} bytes, expected {expected}")
    order = _interleave_index(counts, k, tile_numel, value_format, flags, buf.device, head_share, position_format)
    if order is not None:
        fields = torch.empty_like(buf)
        fields[order] = buf
        buf = fields
    sizes = [sum(f) for f in _field_sizes(counts, k, tile_numel, value_format, flags, head_share, position_format)]
    chunks = list(torch.split(buf, sizes))
    positions = None
    per_segment = tuple(t * k for t in counts)
    if any(flags):
        carried = tuple(n for n, f in zip(per_segment, flags) if f)
        positions = _unpack_positions(chunks.pop(0), k, tile_numel, carried, position_format)
    if value_format in _FLOAT_FORMATS:
        return positions, _from_bytes(chunks[0], _FLOAT_FORMATS[value_format]).to(torch.float32).view(n_tiles, k)
    if value_format in _SCALED_FORMATS:
        return positions, _unpack_scaled(chunks[0], chunks[1], value_format, n_tiles, k)
    if value_format == "mixed":
        h = head_count(k, head_share)
        head = _from_bytes(chunks[0], torch.float16).to(torch.float32).view(n_tiles, h)
        return positions, torch.cat([head, _unpack_scaled(chunks[1], chunks[2], "int8", n_tiles, k - h)], dim=1)
    scale = _from_bytes(chunks[0], torch.float32).view(n_tiles, 1)
    signs = _unpack_bit_fields(chunks[1], 1, per_segment).view(n_tiles, k)
    return positions, _decode_sign(scale, signs.bool())


def _unpack_scaled(scales: Tensor, codes: Tensor, value_format: str, n_tiles: int, k: int) -> Tensor:
    scale = _from_bytes(scales, torch.float32).view(n_tiles, 1)
    return _decode_scaled(scale, _from_bytes(codes, _SCALED_FORMATS[value_format][0]).view(n_tiles, k))
