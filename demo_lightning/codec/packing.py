"""Wire formats: selected coefficients packed into one ``uint8`` byte buffer.

A segment for ``T`` tiles with ``k`` coefficients each is laid out as

    [positions: T*k indices, bit-packed at ceil(log2(tile_numel)) bits]   (only when sent)
    [values: T*k values in the chosen value format (+ per-tile scales for int8 and sign)]

Index width: a tile of 4096 elements needs 12 bits, not the 64 of an int64 (the DeMo reference
spends 8 of its 12 bytes per coefficient on indices).

Value formats:

=========  ===========================================================  ===========
format     encoding                                                     lossless?
=========  ===========================================================  ===========
``fp32``   IEEE float32                                                 yes
``bf16``   bfloat16 (round to nearest even)                             for bf16 data
``fp16``   float16 (values beyond +-65504 saturate)                     for fp16 data
``int8``   per-tile scale ``s = max|v| / 127`` (fp32) and ``round(v/s)``  no
``sign``   per-tile scale ``s = mean|v|`` (fp32) and one bit ``v >= 0``  no
=========  ===========================================================  ===========

:func:`pack_segment` also returns the values a receiver will decode, so a sender can subtract
exactly what it sent (error feedback keeps the quantisation error). Unpacking returns those
decoded values bit for bit; for ``fp32`` (and ``bf16``/``fp16`` data in their own format) they
equal the input exactly.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "VALUE_FORMATS",
    "ValueFormat",
    "index_bits",
    "pack_bits",
    "unpack_bits",
    "quantize_values",
    "values_nbytes",
    "segment_nbytes",
    "pack_segment",
    "unpack_segment",
]

ValueFormat = Literal["fp32", "bf16", "fp16", "int8", "sign"]
VALUE_FORMATS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8", "sign")
_FLOAT_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SCALE_BYTES = 4


def _check_format(value_format: str) -> None:
    if value_format not in VALUE_FORMATS:
        raise ValueError(f"value_format must be one of {VALUE_FORMATS}, got {value_format!r}")


def index_bits(tile_numel: int) -> int:
    """Narrowest bit width that holds every flat index of a tile of ``tile_numel`` elements."""
    if tile_numel < 1:
        raise ValueError(f"tile_numel must be >= 1, got {tile_numel}")
    return max(1, math.ceil(math.log2(tile_numel)))


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


def _encode_values(values: Tensor, value_format: ValueFormat) -> tuple[list[Tensor], Tensor]:
    """Encode ``values`` ``(T, k)``: the wire bytes and the fp32 values a receiver will decode."""
    _check_format(value_format)
    values = values.to(torch.float32)
    if value_format in _FLOAT_FORMATS:
        narrow = values.to(_FLOAT_FORMATS[value_format])
        return [_as_bytes(narrow)], narrow.to(torch.float32)
    if value_format == "int8":
        scale = values.abs().amax(dim=1, keepdim=True) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(values / safe).clamp_(-127, 127).to(torch.int8)
        return [_as_bytes(scale), _as_bytes(codes)], _decode_int8(scale, codes)
    scale = values.abs().mean(dim=1, keepdim=True)
    positive = values >= 0
    return [_as_bytes(scale), pack_bits(positive, 1)], _decode_sign(scale, positive)


def _decode_int8(scale: Tensor, codes: Tensor) -> Tensor:
    return codes.to(torch.float32) * scale


def _decode_sign(scale: Tensor, positive: Tensor) -> Tensor:
    return torch.where(positive, scale, -scale)


def quantize_values(values: Tensor, value_format: ValueFormat) -> Tensor:
    """Round ``values`` ``(T, k)`` through ``value_format``; return what a receiver decodes (fp32)."""
    return _encode_values(values, value_format)[1]


def values_nbytes(n_tiles: int, k: int, value_format: ValueFormat) -> int:
    """Bytes taken by ``n_tiles * k`` values (and their scales) in ``value_format``."""
    _check_format(value_format)
    count = n_tiles * k
    if value_format in _FLOAT_FORMATS:
        return count * _FLOAT_FORMATS[value_format].itemsize
    if value_format == "int8":
        return n_tiles * _SCALE_BYTES + count
    return n_tiles * _SCALE_BYTES + math.ceil(count / 8)


def segment_nbytes(n_tiles: int, k: int, tile_numel: int, value_format: ValueFormat, with_positions: bool) -> int:
    """Bytes of one packed segment (see the module docstring for the layout)."""
    position_bytes = math.ceil(n_tiles * k * index_bits(tile_numel) / 8) if with_positions else 0
    return position_bytes + values_nbytes(n_tiles, k, value_format)


def _as_bytes(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.uint8).reshape(-1)


def _from_bytes(buf: Tensor, dtype: torch.dtype) -> Tensor:
    # a slice of a bigger buffer may be misaligned for dtype: copy before reinterpreting
    return buf.clone().view(dtype)


def pack_segment(
    positions: Tensor | None, values: Tensor, tile_numel: int, value_format: ValueFormat
) -> tuple[Tensor, Tensor]:
    """Pack positions (optional) and values ``(T, k)`` into one ``uint8`` buffer.

    Returns:
        ``(buffer, decoded)``: the bytes, and the fp32 values that :func:`unpack_segment` will
        return for them (bit for bit), for the sender's error feedback.
    """
    parts, decoded = _encode_values(values, value_format)
    if positions is not None:
        parts.insert(0, pack_bits(positions, index_bits(tile_numel)))
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), decoded


def unpack_segment(
    buf: Tensor, n_tiles: int, k: int, tile_numel: int, value_format: ValueFormat, with_positions: bool
) -> tuple[Tensor | None, Tensor]:
    """Inverse of :func:`pack_segment`: ``(positions or None, values as fp32)``, both ``(T, k)``."""
    _check_format(value_format)
    expected = segment_nbytes(n_tiles, k, tile_numel, value_format, with_positions)
    if buf.numel() != expected:
        raise ValueError(f"segment holds {buf.numel()} bytes, expected {expected}")
    count = n_tiles * k
    offset = 0
    positions = None
    if with_positions:
        bits = index_bits(tile_numel)
        nbytes = math.ceil(count * bits / 8)
        positions = unpack_bits(buf[:nbytes], bits, count).view(n_tiles, k)
        offset = nbytes
    body = buf[offset:]
    if value_format in _FLOAT_FORMATS:
        values = _from_bytes(body, _FLOAT_FORMATS[value_format]).to(torch.float32).view(n_tiles, k)
    elif value_format == "int8":
        scale = _from_bytes(body[: n_tiles * _SCALE_BYTES], torch.float32).view(n_tiles, 1)
        codes = _from_bytes(body[n_tiles * _SCALE_BYTES :], torch.int8).view(n_tiles, k)
        values = _decode_int8(scale, codes)
    else:
        scale = _from_bytes(body[: n_tiles * _SCALE_BYTES], torch.float32).view(n_tiles, 1)
        signs = unpack_bits(body[n_tiles * _SCALE_BYTES :], 1, count).view(n_tiles, k)
        values = _decode_sign(scale, signs.bool())
    return positions, values
