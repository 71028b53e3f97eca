"""Codec oracles: scipy's DCT, orthonormality, exact round trips, lossless top-k, exact packing,
saturation and finite decoding at the edges of every value format, and when a mean is exact."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch

from demo_lightning.codec import (
    VALUE_FORMATS,
    coefficients_per_tile,
    dct2,
    dct_basis,
    from_tiles,
    idct2,
    index_bits,
    lowpass_positions,
    pack_bits,
    pack_segment,
    pack_segments,
    plan_tiles,
    quantize_values,
    segment_nbytes,
    select,
    to_tiles,
    unpack_bits,
    unpack_segment,
    unpack_segments,
)
from dist_helpers import IdenticalWorkers

SHAPES = [(), (1,), (7,), (64,), (127,), (3, 5), (64, 64), (127, 131), (128, 192), (5, 3, 3, 3), (2, 3, 4, 5, 6)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16, 64, 97])
def test_basis_matches_scipy_dct_ortho(n: int) -> None:
    # column j of the DCT-II matrix is the transform of the j-th unit vector
    expected = scipy.fft.dct(np.eye(n), norm="ortho", axis=0)
    np.testing.assert_allclose(dct_basis(n, torch.float64).numpy(), expected, rtol=0, atol=1e-13)


def test_basis_golden_values_and_orthonormality() -> None:
    np.testing.assert_allclose(dct_basis(4, torch.float64)[:, 0].numpy(), [0.5, 0.6532815, 0.5, 0.2705981], atol=1e-7)
    for n in (1, 5, 64):
        c = dct_basis(n, torch.float64)
        torch.testing.assert_close(c @ c.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-13)


def test_basis_is_cached_per_size_dtype_device() -> None:
    assert dct_basis(8) is dct_basis(8)
    assert dct_basis(8, torch.float64) is not dct_basis(8)
    assert dct_basis(8).dtype == torch.float32 and dct_basis(8, torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match="size"):
        dct_basis(0)


def test_dct2_matches_scipy_dctn() -> None:
    tiles = torch.randn(3, 8, 5, dtype=torch.float64)
    expected = np.stack([scipy.fft.dctn(t.numpy(), norm="ortho") for t in tiles])
    np.testing.assert_allclose(dct2(tiles).numpy(), expected, atol=1e-12)
    torch.testing.assert_close(idct2(dct2(tiles)), tiles, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_tiling_round_trip_every_shape_class(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=torch.float64)
    layout = plan_tiles(x.shape, chunk=64)
    tiles = to_tiles(x, layout)
    assert tiles.shape == (layout.n_tiles, layout.tile_rows, layout.tile_cols)
    assert torch.equal(from_tiles(tiles, layout), x)
    torch.testing.assert_close(from_tiles(idct2(dct2(tiles)), layout), x, rtol=0, atol=1e-12)


def test_prime_and_nd_sizes_pad_instead_of_degenerating() -> None:
    prime = plan_tiles((127,), 64)
    assert (prime.tile_rows, prime.tile_cols, prime.padded_cols, prime.n_tiles) == (1, 64, 128, 2)
    matrix = plan_tiles((127, 131), 64)
    assert matrix.tile_shape == (64, 64) and (matrix.padded_rows, matrix.padded_cols) == (128, 192)
    conv = plan_tiles((64, 32, 3, 3), 64)
    assert (conv.rows, conv.cols, conv.tile_shape) == (64, 288, (64, 64))
    small = plan_tiles((3, 5), 64)
    assert small.tile_shape == (3, 5) and small.n_tiles == 1
    scalar = plan_tiles((), 64)
    assert scalar.tile_shape == (1, 1)


def test_padding_is_zero_and_cropped() -> None:
    x = torch.ones(127)
    layout = plan_tiles(x.shape, 64)
    tiles = to_tiles(x, layout)
    assert tiles.reshape(-1)[127:].abs().sum() == 0
    assert from_tiles(tiles, layout).shape == (127,)


@pytest.mark.parametrize("shape", [(127,), (64, 64), (100, 70), (6, 4, 3, 3)])
def test_topk_with_k_equal_tile_size_is_lossless(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=torch.float64)
    layout = plan_tiles(x.shape, 64)
    coeffs = dct2(to_tiles(x, layout))
    positions, values = select(coeffs, layout.tile_numel, "topk")
    rebuilt = torch.zeros_like(coeffs).view(coeffs.shape[0], -1).scatter_(1, positions, values)
    torch.testing.assert_close(from_tiles(idct2(rebuilt.view_as(coeffs)), layout), x, rtol=0, atol=1e-12)


def test_topk_selects_largest_magnitudes() -> None:
    coeffs = torch.tensor([[[0.1, -5.0], [3.0, 0.2]]])
    positions, values = select(coeffs, 2, "topk")
    assert sorted(positions[0].tolist()) == [1, 2]
    assert sorted(values[0].tolist()) == [-5.0, 3.0]


def test_lowpass_takes_lowest_frequencies_in_fixed_order() -> None:
    assert lowpass_positions(4, 4, 3).tolist() == [0, 1, 4]  # (0,0), (0,1), (1,0)
    assert lowpass_positions(1, 64, 5).tolist() == [0, 1, 2, 3, 4]
    coeffs = torch.randn(2, 4, 4)
    positions, values = select(coeffs, 3, "lowpass")
    assert positions.tolist() == [[0, 1, 4], [0, 1, 4]]
    assert torch.equal(values, coeffs.reshape(2, 16)[:, [0, 1, 4]])


def test_strength_topk_or_keep_ratio() -> None:
    assert coefficients_per_tile(4096, 32, None) == 32
    assert coefficients_per_tile(64, 100, None) == 64
    assert coefficients_per_tile(4096, None, 1 / 128) == 32
    assert coefficients_per_tile(64, None, 0.001) == 1
    assert coefficients_per_tile(10, None, 1.0) == 10
    with pytest.raises(ValueError, match="not both"):
        coefficients_per_tile(64, 4, 0.5)
    with pytest.raises(ValueError, match="topk"):
        coefficients_per_tile(64, 0, None)
    with pytest.raises(ValueError, match="keep_ratio"):
        coefficients_per_tile(64, None, 1.5)


@pytest.mark.parametrize("bits", [1, 2, 3, 7, 8, 12, 13, 16, 17, 31, 32])
def test_pack_bits_round_trip(bits: int) -> None:
    values = torch.randint(0, 2**bits, (1001,), dtype=torch.int64)
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, 1001), values)


def test_index_width_is_the_narrowest_that_holds_the_tile() -> None:
    assert [index_bits(n) for n in (1, 2, 3, 4, 64, 65, 4096, 4097)] == [1, 1, 2, 2, 6, 7, 12, 13]


@pytest.mark.parametrize("value_format", VALUE_FORMATS)
@pytest.mark.parametrize("tile_numel", [1, 3, 64, 4096, 65536, 2**20])
@pytest.mark.parametrize("with_positions", [True, False])
def test_pack_unpack_is_exact(value_format: str, tile_numel: int, with_positions: bool) -> None:
    n_tiles, k = 7, min(5, tile_numel)
    values = torch.randn(n_tiles, k) * 10
    positions = torch.randint(0, tile_numel, (n_tiles, k))
    buf, decoded = pack_segment(positions if with_positions else None, values, tile_numel, value_format)
    assert buf.dtype == torch.uint8 and buf.numel() == segment_nbytes(n_tiles, k, tile_numel, value_format, with_positions)
    got_positions, got_values = unpack_segment(buf, n_tiles, k, tile_numel, value_format, with_positions)
    assert torch.equal(got_values, decoded)
    assert torch.equal(decoded, quantize_values(values, value_format))
    if with_positions:
        assert torch.equal(got_positions, positions)
    else:
        assert got_positions is None


def test_lossless_formats_are_exact_for_their_own_data() -> None:
    values = torch.randn(4, 6)
    assert torch.equal(quantize_values(values, "fp32"), values)
    narrow = values.to(torch.bfloat16).float()
    assert torch.equal(quantize_values(narrow, "bf16"), narrow)
    half = values.to(torch.float16).float()
    assert torch.equal(quantize_values(half, "fp16"), half)


def test_lossy_formats_error_bounds() -> None:
    values = torch.randn(16, 32)
    int8 = quantize_values(values, "int8")
    step = values.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((int8 - values).abs() <= step / 2 + 1e-6).all())
    sign = quantize_values(values, "sign")
    torch.testing.assert_close(sign.abs(), values.abs().mean(dim=1, keepdim=True).expand_as(sign))
    assert bool((torch.sign(sign) == torch.where(values >= 0, 1.0, -1.0)).all())
    zeros = quantize_values(torch.zeros(2, 3), "int8")
    assert torch.equal(zeros, torch.zeros(2, 3))


def test_bytes_per_coefficient() -> None:
    # 12-bit positions + bf16 values: 3.5 bytes per coefficient (the reference: int64 + fp32 = 12)
    assert segment_nbytes(1000, 32, 4096, "bf16", True) == 1000 * 32 * 3.5
    assert segment_nbytes(1000, 32, 4096, "sign", True) == 1000 * (32 * 12 // 8 + 4 + 4)
    assert segment_nbytes(10, 32, 4096, "int8", False) == 10 * (4 + 32)


def test_bad_value_format_is_named() -> None:
    with pytest.raises(ValueError, match="value_format"):
        quantize_values(torch.zeros(1, 1), "fp8")


@pytest.mark.parametrize("value_format", VALUE_FORMATS)
@pytest.mark.parametrize("with_positions", [True, False])
@pytest.mark.parametrize(("tiles", "k", "tile_numel"), [((3, 1, 4), 5, 4096), ((2, 2), 64, 4096), ((1, 7, 2, 3), 3, 65), ((5,), 7, 64)])
def test_pack_segments_equals_concatenated_single_segments(
    value_format: str, with_positions: bool, tiles: tuple[int, ...], k: int, tile_numel: int
) -> None:
    # oracle: one pack_segment per segment, concatenated; odd k and odd tile counts leave bit
    # fields that end mid-byte, which must stay padded per segment
    gen = torch.Generator().manual_seed(sum(tiles) * k)
    n = sum(tiles)
    values = torch.randn(n, k, generator=gen) * 10
    positions = torch.randint(0, tile_numel, (n, k), generator=gen)
    expected, expected_decoded = [], []
    for rows in torch.split(torch.arange(n), list(tiles)):
        buf, decoded = pack_segment(positions[rows] if with_positions else None, values[rows], tile_numel, value_format)
        expected.append(buf)
        expected_decoded.append(decoded)
    buf, decoded = pack_segments(positions if with_positions else None, values, tiles, tile_numel, value_format)
    assert torch.equal(buf, torch.cat(expected))
    assert torch.equal(decoded, torch.cat(expected_decoded))
    assert buf.numel() == sum(segment_nbytes(t, k, tile_numel, value_format, with_positions) for t in tiles)
    got_positions, got_values = unpack_segments(buf, tiles, k, tile_numel, value_format, with_positions)
    assert torch.equal(got_values, decoded)
    if with_positions:
        assert torch.equal(got_positions, positions)
    else:
        assert got_positions is None
    with pytest.raises(ValueError, match="expected"):
        unpack_segments(buf[:-1], tiles, k, tile_numel, value_format, with_positions)


# ---------------------------------------------------------------------------- range: saturation, zero and huge tiles
_F32_MAX = torch.finfo(torch.float32).max
_BF16_MAX = torch.finfo(torch.bfloat16).max
# every case: a hostile tile, an all-zero tile (scales of 0: exact zeros, no 0/0) and an ordinary one
_HOSTILE = {
    "beyond-fp16": [7.0e4, -1.0e5, 65519.0, 65520.0, 1.0, 0.0],  # fp16: inf without saturation
    "near-fp32-max": [_F32_MAX, -_F32_MAX, 0.999 * _F32_MAX, 3.39e38, 1.0, 0.0],  # bf16 rounds to inf; int8's
    # 127 * (max / 127) and sign's sum of |v| overflow fp32
    "tiny": [1e-40, -3e-41, 1e-45, -1e-45, 0.0, 0.0],  # subnormal: int8's max / 127 underflows
}


def _hostile(case: str) -> torch.Tensor:
    return torch.tensor([_HOSTILE[case], [0.0] * 6, [0.5, -2.0, 3.0, -4.0, 0.25, 1.0]])


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)  # bit for bit: -0.0 differs from 0.0, NaN payloads count


@pytest.mark.parametrize("value_format", VALUE_FORMATS)
@pytest.mark.parametrize("case", sorted(_HOSTILE))
@pytest.mark.parametrize("with_positions", [True, False])
def test_finite_values_of_any_size_decode_finite_and_exactly_as_unpacked(value_format: str, case: str, with_positions: bool) -> None:
    values = _hostile(case)
    n_tiles, k = values.shape
    positions = torch.arange(k).repeat(n_tiles, 1)
    buf, decoded = pack_segment(positions if with_positions else None, values, 64, value_format)
    _, got = unpack_segment(buf, n_tiles, k, 64, value_format, with_positions)
    assert bool(torch.isfinite(decoded).all()), (value_format, decoded)
    assert torch.equal(_bits(got), _bits(decoded))
    assert torch.equal(_bits(quantize_values(values, value_format)), _bits(decoded))
    assert torch.equal(decoded[1], torch.zeros(k)) and not bool(torch.signbit(decoded[1]).any())  # the all-zero tile
    # many segments (one tile, then two): the same decoded values
    many, many_decoded = pack_segments(positions if with_positions else None, values, (1, 2), 64, value_format)
    assert torch.equal(_bits(many_decoded), _bits(decoded))
    _, many_got = unpack_segments(many, (1, 2), k, 64, value_format, with_positions)
    assert torch.equal(_bits(many_got), _bits(decoded))


def test_float_formats_saturate_at_their_largest_finite_value() -> None:
    values = torch.tensor([[7.0e4, -1.0e5, 65519.0, 65520.0, 3.39e38, -_F32_MAX, 1.5, -0.0]])
    assert quantize_values(values, "fp16")[0].tolist() == [65504.0, -65504.0, 65504.0, 65504.0, 65504.0, -65504.0, 1.5, -0.0]
    bf16 = quantize_values(values, "bf16")
    assert bf16[0, 4:6].tolist() == [_BF16_MAX, -_BF16_MAX]
    assert torch.equal(bf16[0, :4], values[0, :4].to(torch.bfloat16).float())  # in range: plain rounding
    assert torch.equal(quantize_values(values, "fp32"), values)
    # int8 and sign: finite scales whose decoded values stay below fp32's max
    huge = torch.tensor([[_F32_MAX, -_F32_MAX, _F32_MAX]])
    assert quantize_values(huge, "int8").abs().max() <= _F32_MAX
    torch.testing.assert_close(quantize_values(huge, "sign"), huge, rtol=1e-6, atol=0)



@pytest.mark.parametrize("value_format", VALUE_FORMATS)
def test_float64_values_beyond_fp32_range_saturate_too(value_format: str) -> None:
    # float64 parameters: a coefficient beyond fp32's range must not become inf on the way to any format
    values = torch.tensor([[1e39, -1e300, 2.0, 0.0]], dtype=torch.float64)
    buf, decoded = pack_segment(None, values, 64, value_format)
    assert bool(torch.isfinite(decoded).all()), decoded
    assert torch.equal(_bits(unpack_segment(buf, 1, 4, 64, value_format, False)[1]), _bits(decoded))
    assert bool(torch.isfinite(values - decoded.double()).all())  # the residual keeps the excess

@pytest.mark.parametrize("value_format", VALUE_FORMATS)
def test_non_finite_inputs_are_not_disguised(value_format: str) -> None:
    # the non-finite guard stops these before any exchange; the codec must not turn them into numbers
    values = torch.tensor([[math.inf, 1.0, 2.0], [math.nan, 1.0, 2.0], [1.0, -2.0, 3.0]])
    decoded = quantize_values(values, value_format)
    assert not bool(torch.isfinite(decoded[0]).all()) and not bool(torch.isfinite(decoded[1]).all())
    assert bool(torch.isfinite(decoded[2]).all())
    if value_format in ("fp32", "bf16", "fp16"):
        assert decoded[0, 0] == math.inf and math.isnan(decoded[1, 0])


@pytest.mark.parametrize("selection", ["topk", "lowpass"])
def test_fp16_coefficient_beyond_65504_gives_a_finite_mean_and_keeps_the_excess(selection: str) -> None:
    from demo_lightning.algorithms.compressed_mean import CodecConfig, CompressedMean
    from demo_lightning.comm import Communicator

    # a constant 64x64 tile of 2000 has one DCT coefficient, 64 * 2000 = 128000 > 65504
    x = torch.full((64, 64), 2000.0)
    codec = CompressedMean(CodecConfig(chunk=64, topk=4, selection=selection, value_format="fp16", dense_below=0, dense_vectors=False), Communicator())
    assert codec.config.all_reduces == (selection == "lowpass")
    (mean,), (sent,) = codec([x], "test")
    assert bool(torch.isfinite(mean).all()) and bool(torch.isfinite(sent).all())
    assert torch.equal(mean, sent)  # one worker: the mean is what it sent
    residual = x - sent  # error feedback: the sender keeps exactly what the wire could not carry
    assert bool(torch.isfinite(residual).all())
    torch.testing.assert_close(sent, torch.full_like(x, 65504.0 / 64), rtol=1e-6, atol=1e-3)
    torch.testing.assert_close(residual, torch.full_like(x, (128000.0 - 65504.0) / 64), rtol=1e-6, atol=1e-3)


@pytest.mark.parametrize("value_format", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("summands", [1, 2, 3, 7, 8, 64, 1000])
def test_saturated_values_of_w_workers_sum_without_overflow(value_format: str, summands: int) -> None:
    from demo_lightning.codec.packing import saturate, saturation_limit

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[value_format]
    top = torch.finfo(dtype).max
    limit = saturation_limit(value_format, summands)
    assert limit == torch.tensor(limit, dtype=torch.float64).to(dtype).item()  # a value of the format
    # the bound |sum| <= (1 + u)^(W - 1) * W * limit stays finite, and limit is the largest value that keeps it
    growth = (1 + torch.finfo(dtype).eps / 2) ** (summands - 1)
    assert limit == top if summands == 1 else top / summands / growth / (1 + torch.finfo(dtype).eps) < limit <= top / summands / growth
    # the worst case: every worker saturated, summed in the wire format in rank order and pairwise
    narrow = saturate(torch.tensor([1e300, -1e300, 5.0], dtype=torch.float64), value_format, summands)
    assert narrow.dtype == dtype and narrow.tolist() == [limit, -limit, 5.0]
    column = narrow[:1].expand(summands).clone()
    total = column[0]
    for v in column[1:]:
        total = total + v
    assert math.isfinite(total.item())
    while column.numel() > 1:
        column = torch.cat([column[0::2][: column.numel() // 2] + column[1::2], column[column.numel() // 2 * 2 :]])
    assert math.isfinite(column.item())


def test_saturate_passes_non_finite_values_and_names_bad_arguments() -> None:
    from demo_lightning.codec.packing import saturate, saturation_limit

    got = saturate(torch.tensor([math.inf, -math.inf, math.nan, 1e6]), "fp16")
    assert got[:2].tolist() == [math.inf, -math.inf] and math.isnan(got[2]) and got[3] == 65504
    # any input dtype: bf16 (which cannot hold 65504), fp16 summed by 2 workers, integers
    assert saturate(torch.tensor([1e5, -3.0]).to(torch.bfloat16), "fp16").tolist() == [65504.0, -3.0]
    assert saturate(torch.tensor([6e4, 1.0]).half(), "fp16", 2).tolist() == [32736.0, 1.0]
    assert saturate(torch.tensor([70000, -2]), "fp16").tolist() == [65504.0, -2.0]
    with pytest.raises(ValueError, match="float formats"):
        saturation_limit("int8")
    with pytest.raises(ValueError, match="summands"):
        saturation_limit("fp16", 0)


# ---------------------------------------------------------------------------- identical workers: when the mean is exact
def test_sum_in_rank_order_divided_by_w_is_exact_only_for_w_1_2_4() -> None:
    # the arithmetic of the mean: contributions added in rank order into zeros, then divided by W
    def mean_of_copies(a: torch.Tensor, world_size: int) -> torch.Tensor:
        total = torch.zeros_like(a)
        for _ in range(world_size):
            total = total + a
        return total / world_size

    every = (torch.arange(2**23, dtype=torch.int64) + 0x3F800000).to(torch.int32).view(torch.float32)  # all of [1, 2)
    for world_size in (1, 2, 4):
        assert torch.equal(mean_of_copies(every, world_size), every), world_size
    for world_size in (3, 5, 8):
        assert not torch.equal(mean_of_copies(every, world_size), every), world_size
    assert mean_of_copies(torch.tensor(0.9), 3) != torch.tensor(0.9)
    assert mean_of_copies(torch.tensor(0.1), 8) != torch.tensor(0.1)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_identical_inputs_give_one_workers_mean_bitwise_only_for_w_1_2_4(world_size: int) -> None:
    from demo_lightning.algorithms.compressed_mean import CodecConfig, CompressedMean
    from demo_lightning.comm import Communicator

    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    config = CodecConfig(chunk=64, keep_ratio=1.0, value_format="fp32", dense_below=0, dense_vectors=False)
    (single,), _ = CompressedMean(config, Communicator())([x], "t")
    (mean,), (sent,) = CompressedMean(config, IdenticalWorkers(world_size))([x], "t")  # type: ignore[arg-type]
    assert torch.equal(sent, single)
    if world_size in (1, 2, 4):
        assert torch.equal(mean, single)
    else:
        assert not torch.equal(mean, single)
        torch.testing.assert_close(mean, single, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- fp8 and mixed
FP8 = {"fp8_e4m3": (448.0, 3, -6), "fp8_e5m2": (57344.0, 2, -14)}  # largest finite, mantissa bits, min normal exponent


@pytest.mark.parametrize("value_format", sorted(FP8))
def test_fp8_rounds_to_its_grid_within_half_a_spacing_and_saturates_at_the_tile_peak(value_format: str) -> None:
    """Oracle: the float8 grid written out from its definition (mantissa bits, exponent range), not torch's cast."""
    top, mantissa, min_exp = FP8[value_format]
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(64, 48, generator=gen, dtype=torch.float64) * torch.logspace(-6, 2, 48, dtype=torch.float64)
    decoded = quantize_values(values.float(), value_format).double()
    scale = values.float().abs().amax(dim=1, keepdim=True).double() / top
    x = values / scale  # in code units: |x| <= top
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** min_exp))).clamp_min(min_exp)
    spacing = 2.0 ** (exponent - mantissa)  # normal numbers; below 2**min_exp the subnormal spacing 2**(min_exp - mantissa)
    assert bool(((decoded / scale - x).abs() <= spacing / 2 + 1e-9).all())
    peak = values.abs().argmax(dim=1, keepdim=True)
    torch.testing.assert_close(decoded.gather(1, peak).abs(), (scale * top), rtol=1e-6, atol=0)
    assert bool(torch.isfinite(decoded).all())


@pytest.mark.parametrize("value_format", sorted(FP8))
def test_fp8_takes_a_byte_a_value_and_a_scale_a_tile(value_format: str) -> None:
    assert segment_nbytes(10, 32, 4096, value_format, False) == 10 * (4 + 32)
    assert segment_nbytes(10, 32, 4096, value_format, True) == 10 * (4 + 32) + math.ceil(10 * 32 * 12 / 8)


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5, 0.99])
def test_mixed_sends_the_first_share_in_fp16_and_the_rest_in_int8_with_their_own_scale(share: float) -> None:
    from demo_lightning.codec import head_count

    gen = torch.Generator().manual_seed(4)
    values = torch.randn(9, 20, generator=gen) * 5
    h = head_count(20, share)
    assert h == math.ceil(share * 20)
    decoded = quantize_values(values, "mixed", head_share=share)
    assert torch.equal(decoded[:, :h], values[:, :h].half().float())  # fp16, round to nearest even
    tail = values[:, h:]
    if h < 20:  # share 0.99: every value in the head, an empty tail (its scale still sent)
        step = tail.abs().amax(dim=1, keepdim=True) / 127  # the tail's own scale, not the head's
        assert bool(((decoded[:, h:] - tail).abs() <= step / 2 + 1e-6).all())
    assert segment_nbytes(9, 20, 4096, "mixed", False, share) == 9 * (2 * h + 4 + (20 - h))
    buf, sent = pack_segment(None, values, 4096, "mixed", share)
    assert torch.equal(unpack_segment(buf, 9, 20, 4096, "mixed", False, share)[1], sent) and torch.equal(sent, decoded)


def test_mixed_head_count_and_share_are_checked() -> None:
    from demo_lightning.codec import head_count

    assert [head_count(k) for k in (1, 2, 4, 5, 64)] == [1, 1, 1, 2, 16]
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="head_share must lie in"):
            head_count(8, bad)


def test_the_exchange_selection_hands_mixed_its_strongest_coefficients_first() -> None:
    """The fp16 head of "mixed" must be each tile's strongest picks: the selection orders them for it."""
    from demo_lightning.algorithms import CodecConfig
    from demo_lightning.algorithms.stages.plan import build_plan
    from demo_lightning.algorithms.stages.encode import Workspace, select, transform_into

    config = CodecConfig(topk=12, chunk=16, value_format="mixed", dense_below=0, dense_vectors=False)
    assert config.strongest_first and not CodecConfig(topk=12).strongest_first
    x = torch.randn(48, 40, generator=torch.Generator().manual_seed(5))
    plan = build_plan(config, [x])
    workspace = Workspace(plan)
    spectra = {key: torch.empty(f.numel, dtype=f.dtype) for key, f in plan.families.items()}
    transform_into(plan, [x], spectra, workspace)
    for key, family in plan.families.items():
        picked = select(family, spectra[key], "topk", workspace.family(family), config.strongest_first)
        magnitudes = picked.values.abs()
        assert bool((magnitudes[:, :-1] >= magnitudes[:, 1:]).all())
        unordered = select(family, spectra[key], "topk", workspace.family(family))
        assert torch.equal(picked.values.abs().sort(dim=1).values, unordered.values.abs().sort(dim=1).values)
