"""The choice of tile transform (``transform="dct" | "haar" | "identity"``): each basis against an
oracle written here, the matrix-layout transform against the naive per-tile product, the exchange's
error feedback written out coefficient-wise for each, checkpoints across transforms, and replicas
bitwise equal on two real processes."""

from __future__ import annotations

import math
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.fft
import torch
from torch import nn

from demo_lightning import DeMoFabricStrategy, DeMoStrategy, DesLocFabricStrategy, DesLocStrategy
from demo_lightning.algorithms import CodecConfig, DeMoExchange, TensorSettings
from demo_lightning.algorithms.compressed_mean import CompressedMean
from demo_lightning.algorithms.stages import build_plan
from demo_lightning.codec import (
    TRANSFORMS,
    dct_basis,
    haar_basis,
    inverse_tile_transform,
    lowpass_positions,
    plan_tiles,
    tile_transform,
    to_tiles,
    transform_basis,
)
from demo_lightning.codec.transform import accumulate_spectrum, inverse_spectrum, tile_view
from demo_lightning.comm import Communicator

from exchange_inputs import unclipped, unclipped_of
from dist_helpers import IdenticalWorkers, run_workers, tensor_hash

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------------------- oracles
def haar_kronecker(n: int) -> np.ndarray:
    """The textbook recursion for ``n = 2^L``: ``H_1 = [1]``, ``H_2m = [H_m (x) [1, 1]; I_m (x) [1, -1]] / sqrt 2``."""
    if n == 1:
        return np.ones((1, 1))
    m = n // 2
    h = haar_kronecker(m)
    return np.vstack([np.kron(h, [1.0, 1.0]), np.kron(np.eye(m), [1.0, -1.0])]) / math.sqrt(2.0)


def haar_closed_form(n: int) -> np.ndarray:
    """``h_0 = 1/sqrt(n)``; ``h_{2^p+q}`` = ``+-sqrt(2^p / n)`` on the two halves of segment ``q`` of ``2^p``."""
    h = np.zeros((n, n))
    h[0] = 1 / math.sqrt(n)
    p = 0
    while 2**p < n:
        width = n // 2**p
        for q in range(2**p):
            h[2**p + q, q * width : q * width + width // 2] = math.sqrt(2**p / n)
            h[2**p + q, q * width + width // 2 : (q + 1) * width] = -math.sqrt(2**p / n)
        p += 1
    return h


def haar_unbalanced(n: int) -> np.ndarray:
    """Any ``n``, written as a depth-first recursion and then ordered breadth-first: a segment of
    ``L = a + b`` points (``a = ceil(L / 2)``) gives the row ``sqrt(b / (a L))`` on its first ``a``,
    ``-sqrt(a / (b L))`` on its last ``b``; then both halves recurse."""
    details: list[tuple[int, int, np.ndarray]] = []

    def split(start: int, length: int, depth: int) -> None:
        if length < 2:
            return
        a = -(-length // 2)
        b = length - a
        row = np.zeros(n)
        row[start : start + a] = math.sqrt(b / (a * length))
        row[start + a : start + length] = -math.sqrt(a / (b * length))
        details.append((depth, start, row))
        split(start, a, depth + 1)
        split(start + a, b, depth + 1)

    split(0, n, 0)
    return np.vstack([np.full(n, 1 / math.sqrt(n))] + [row for _, _, row in sorted(details, key=lambda d: (d[0], d[1]))])


def basis_oracle(transform: str, n: int) -> np.ndarray:
    if transform == "dct":
        return scipy.fft.dct(np.eye(n), norm="ortho", axis=0)  # column j = DCT of e_j: the matrix C
    if transform == "haar":
        return haar_unbalanced(n)
    return np.eye(n)


def tiles_naive(x: np.ndarray, tile: tuple[int, int], transform: str, inverse: bool = False) -> np.ndarray:
    """``B_r X B_c^T`` (or ``B_r^T K B_c``) of every ``tile`` of the padded matrix ``x``, in place of it."""
    br, bc = basis_oracle(transform, tile[0]), basis_oracle(transform, tile[1])
    out = np.zeros_like(x)
    for a in range(0, x.shape[0], tile[0]):
        for b in range(0, x.shape[1], tile[1]):
            block = x[a : a + tile[0], b : b + tile[1]]
            out[a : a + tile[0], b : b + tile[1]] = br.T @ block @ bc if inverse else br @ block @ bc.T
    return out


def padded(x: np.ndarray, layout: Any) -> np.ndarray:
    out = np.zeros((layout.padded_rows, layout.padded_cols))
    out[: layout.rows, : layout.cols] = x.reshape(layout.rows, layout.cols)
    return out


# ---------------------------------------------------------------------------------------- bases
@pytest.mark.parametrize("transform", ["dct", "haar"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 48, 50, 63, 64])
def test_every_basis_is_orthonormal(transform: str, n: int) -> None:
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        b = transform_basis(transform, n, dtype)
        assert b is not None and b.shape == (n, n) and b.dtype == dtype
        torch.testing.assert_close(b @ b.T, torch.eye(n, dtype=dtype), rtol=0, atol=tol)
        torch.testing.assert_close(b.T @ b, torch.eye(n, dtype=dtype), rtol=0, atol=tol)
    assert transform_basis(transform, n) is transform_basis(transform, n)  # cached


def test_identity_has_no_basis_and_the_tile_functions_copy() -> None:
    assert transform_basis("identity", 8) is None
    tiles = torch.randn(3, 4, 5, dtype=torch.float64)
    forward = tile_transform(tiles, "identity")
    assert torch.equal(forward, tiles) and forward.data_ptr() != tiles.data_ptr()
    assert torch.equal(inverse_tile_transform(tiles, "identity"), tiles)
    with pytest.raises(ValueError, match=r"transform must be one of \('dct', 'haar', 'identity'\)"):
        transform_basis("wavelet", 8)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128])
def test_haar_matrix_for_powers_of_two_is_the_textbook_recursion_and_the_closed_form(n: int) -> None:
    ours = haar_basis(n, torch.float64).numpy()
    np.testing.assert_allclose(ours, haar_kronecker(n), rtol=0, atol=1e-14)
    np.testing.assert_allclose(ours, haar_closed_form(n), rtol=0, atol=1e-14)


@pytest.mark.parametrize("n", [4, 8, 16, 64])
def test_haar_matrix_equals_pywavelets_multilevel_periodized_haar(n: int) -> None:
    pywt = pytest.importorskip("pywt")  # not a dependency: runs where PyWavelets is installed
    expected = np.stack([np.concatenate(pywt.wavedec(e, "haar", mode="periodization")) for e in np.eye(n)]).T
    np.testing.assert_allclose(haar_basis(n, torch.float64).numpy(), expected, rtol=0, atol=1e-14)


def test_haar_matrix_for_other_sides_is_the_unbalanced_haar_basis() -> None:
    # n = 3 by hand: the mean, the split 2 + 1, then the split of the pair
    s = math.sqrt
    by_hand = np.array([[1 / s(3)] * 3, [1 / s(6), 1 / s(6), -2 / s(6)], [1 / s(2), -1 / s(2), 0.0]])
    np.testing.assert_allclose(haar_basis(3, torch.float64).numpy(), by_hand, rtol=0, atol=1e-15)
    for n in (3, 5, 6, 7, 12, 48, 50, 63):
        h = haar_basis(n, torch.float64).numpy()
        np.testing.assert_allclose(h, haar_unbalanced(n), rtol=0, atol=1e-14)
        np.testing.assert_allclose(h[0], np.full(n, 1 / math.sqrt(n)), atol=1e-15)  # the mean first
        np.testing.assert_allclose(h[1:].sum(axis=1), 0, atol=1e-13)  # every detail has zero mean
        supports = (np.abs(h[1:]) > 0).sum(axis=1)
        # coarse to fine: a row's support is never shorter than a later one's by more than the one point
        # a level's segments differ in (a halving of L gives ceil and floor of L / 2)
        assert all(supports[i] >= supports[i + 1 :].max() - 1 for i in range(len(supports) - 1)), supports
        assert all(len(np.unique(np.round(row[row != 0], 12))) == 2 for row in h[1:])  # two constant pieces


def test_dct_basis_unchanged_by_the_choice() -> None:
    assert transform_basis("dct", 16) is dct_basis(16)
    np.testing.assert_allclose(dct_basis(16, torch.float64).numpy(), basis_oracle("dct", 16), atol=1e-13)


# ---------------------------------------------------------------------------------------- the matrix-layout transform
SHAPES = [(128, 192), (40, 72), (100,), (7, 3, 3, 3), (), (1, 5), (12, 50)]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matrix_layout_transform_is_the_naive_tile_product_and_inverts(transform: str, shape: tuple[int, ...]) -> None:
    layout = plan_tiles(shape, 32)  # tile sides 32, 7, 12, 18 (from 50: padded), 1, 5: powers of two and not
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = torch.full((layout.padded_rows, layout.padded_cols), float("nan"), dtype=torch.float64)  # not read at decay 0
    scratch, pad = torch.empty_like(out), torch.zeros_like(out)
    accumulate_spectrum(x, layout, out, 0.0, scratch, pad, transform=transform)
    expected = tiles_naive(padded(x.numpy(), layout), layout.tile_shape, transform)
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-12)
    # the tile-major form agrees
    tiles = tile_view(out, layout).reshape(-1, *layout.tile_shape)
    torch.testing.assert_close(tiles, tile_transform(to_tiles(x, layout), transform), rtol=0, atol=1e-12)
    torch.testing.assert_close(inverse_tile_transform(tiles, transform), to_tiles(x, layout), rtol=0, atol=1e-12)
    # decay fused: decay * K + T(x)
    again = accumulate_spectrum(x, layout, out.clone(), 0.5, scratch, pad, transform=transform)
    torch.testing.assert_close(again, 1.5 * out, rtol=0, atol=1e-12)
    back = inverse_spectrum(out, layout, torch.empty_like(out), torch.empty_like(out), scale=0.25, transform=transform)
    np.testing.assert_allclose(back.numpy(), 0.25 * tiles_naive(out.numpy(), layout.tile_shape, transform, inverse=True), atol=1e-12)
    torch.testing.assert_close(back[: layout.rows, : layout.cols].reshape(shape), 0.25 * x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(64, 96), (40, 72)], ids=["exact", "padded"])
def test_identity_runs_no_gemm_and_stores_the_tensor_exactly(shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gemm(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("transform='identity' ran a GEMM")

    for name in ("addmm", "bmm", "matmul", "mm"):
        monkeypatch.setattr(torch, name, no_gemm)
    layout = plan_tiles(shape, 32)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out = torch.full((layout.padded_rows, layout.padded_cols), float("nan"))
    accumulate_spectrum(x, layout, out, 0.0, torch.empty_like(out), transform="identity")
    assert torch.equal(out[: shape[0], : shape[1]], x) and torch.equal(out[shape[0]:], torch.zeros_like(out[shape[0]:]))
    assert not out[:, shape[1]:].any()
    back = inverse_spectrum(out, layout, torch.empty_like(out), torch.empty_like(out), transform="identity")
    assert torch.equal(back[: shape[0], : shape[1]], x)
    half = inverse_spectrum(out, layout, torch.empty_like(out), torch.empty_like(out), scale=0.5, transform="identity")
    assert torch.equal(half, out * 0.5)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_monitor_histograms_hold_the_exchanges_own_coefficients(transform: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from demo_lightning.callbacks import CommunicationMonitor, communication_monitor

    w = nn.Parameter(torch.randn(64, 64))
    exchange = _exchange(transform, w)
    w.grad = torch.randn_like(w)
    exchange.step()
    written: dict[str, torch.Tensor] = {}

    class _Writer:
        def add_histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
            written[tag] = values

    monitor = CommunicationMonitor(histogram_every=1)
    monkeypatch.setattr(monitor, "_writers", lambda trainer: [_Writer()])
    monkeypatch.setattr(communication_monitor, "exchanges_of", lambda trainer: [exchange])
    monitor._histograms(None, 1)  # type: ignore[arg-type]
    layout = plan_tiles((64, 64), exchange.config.codec.chunk)  # the monitor tiles by the config's chunk
    coefficients = tile_transform(to_tiles(exchange.momentum(w), layout), transform).abs().reshape(-1)
    torch.testing.assert_close(written["demo/dct_abs/other"], coefficients)


# ---------------------------------------------------------------------------------------- settings
def test_config_validates_transform_naming_it() -> None:
    assert CodecConfig().transform == "dct"
    with pytest.raises(ValueError, match=r"transform must be one of \('dct', 'haar', 'identity'\)"):
        CodecConfig(transform="wavelet")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"transform='identity'.*selection='lowpass'.*keep_ratio=1\.0"):
        CodecConfig(transform="identity", selection="lowpass")
    CodecConfig(transform="identity", selection="lowpass", keep_ratio=1.0)  # every element: defined
    CodecConfig(transform="identity", selection="shared", value_format="bf16")
    CodecConfig(transform="haar", selection="lowpass", chunk=48)  # other sides: the unbalanced basis
    # a per-tensor setting that keeps fewer than all under identity + lowpass is refused when planned
    config = CodecConfig(transform="identity", selection="lowpass", keep_ratio=1.0, dense_below=0, dense_vectors=False)
    from demo_lightning.algorithms.config import TensorCodec

    with pytest.raises(ValueError, match=r"transform='identity' and selection='lowpass'"):
        build_plan(config, [torch.zeros(64, 64)], [TensorCodec(topk=8)])


@pytest.mark.parametrize("cls", [DeMoStrategy, DeMoFabricStrategy, DesLocStrategy, DesLocFabricStrategy])
def test_strategies_take_a_typed_transform_and_pass_it_to_the_codec(cls: Any) -> None:
    from demo_lightning.strategies.options import DeMoOptions, DesLocOptions

    for options in (DeMoOptions, DesLocOptions):
        hint = typing.get_type_hints(options.__init__)["transform"]
        assert typing.get_args(hint) == ("dct", "haar", "identity")
    kwargs = {"compress_params": True} if cls in (DesLocStrategy, DesLocFabricStrategy) else {}
    strategy = cls(transform="haar", **kwargs)
    codec = strategy.demo_config.codec if cls in (DeMoStrategy, DeMoFabricStrategy) else strategy.desloc_config.codec
    assert codec.transform == "haar"
    assert cls(**kwargs).__class__ is cls  # the default: dct
    with pytest.raises(ValueError, match=r"\btransform\b"):
        cls(transform="fft", **kwargs)


# ---------------------------------------------------------------------------------------- the exchange
class _Workers(IdenticalWorkers):
    """``IdenticalWorkers`` whose exchange group has ``world_size`` ranks (this one rank 0)."""

    def world_size_of(self, group: Any) -> int:
        return self.world_size

    def rank_in(self, group: Any) -> int:
        return 0


CASES = [(t, s, f) for t in TRANSFORMS for s in ("topk", "lowpass") for f in ("fp32", "sign") if not (t == "identity" and s == "lowpass")]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("transform,selection,value_format", CASES, ids=["-".join(c) for c in CASES])
def test_error_feedback_is_exact_coefficient_wise_for_every_transform(transform: str, selection: str, value_format: str, world_size: int) -> None:
    """Per step: residual + sent == decay * old + T(pad(g)), with ``sent`` k-sparse per tile at the
    chosen positions (top-k of the new momentum, or the fixed low ones), fp32 values exactly what the
    momentum held there, and the update the inverse transform of ``sent`` (identical workers: the
    mean is what one sent)."""
    shapes = [(40, 72), (64, 96), (12, 50)]  # padded; exact; row tiles of 12 (not a power of two)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    opt = torch.optim.SGD(params, lr=0.1)
    codec = CodecConfig(chunk=32, topk=5, selection=selection, value_format=value_format, dense_below=0, dense_vectors=False, transform=transform)  # type: ignore[arg-type]
    exchange = DeMoExchange(opt, unclipped(codec, decay=0.9, update="raw"), _Workers(world_size))  # type: ignore[arg-type]
    layouts = [plan_tiles(s, 32) for s in shapes]
    old = [np.zeros((lay.padded_rows, lay.padded_cols)) for lay in layouts]
    for step in range(3):
        grads = [torch.randn(s, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + i)) for i, s in enumerate(shapes)]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        exchange.step()
        state = exchange.averaged_state()
        for p, g, lay, m_old, i in zip(params, grads, layouts, old, range(len(shapes))):
            new = 0.9 * m_old + tiles_naive(padded(g.numpy(), lay), lay.tile_shape, transform)
            residual = state[p].numpy()
            sent = new - residual  # what error feedback took out
            tr, tc = lay.tile_shape
            for a in range(0, lay.padded_rows, tr):
                for b in range(0, lay.padded_cols, tc):
                    tile_new, tile_sent = new[a : a + tr, b : b + tc].reshape(-1), sent[a : a + tr, b : b + tc].reshape(-1)
                    k = min(5, tile_new.size)
                    if selection == "topk":
                        chosen = np.argsort(-np.abs(tile_new), kind="stable")[:k]
                    else:
                        chosen = lowpass_positions(tr, tc, k).numpy()
                    others = np.setdiff1d(np.arange(tile_new.size), chosen)
                    np.testing.assert_allclose(tile_sent[others], 0, atol=1e-10)  # the rest stayed in the momentum
                    if value_format == "fp32":
                        np.testing.assert_allclose(tile_sent[chosen], tile_new[chosen].astype(np.float32), rtol=0, atol=1e-10)
            # the update is the inverse transform of what was sent (the mean of identical workers)
            q = tiles_naive(sent, lay.tile_shape, transform, inverse=True)[: lay.rows, : lay.cols]
            np.testing.assert_allclose(p.grad.numpy(), q.reshape(p.shape), rtol=0, atol=1e-10)
            old[i] = residual.copy()


def test_identity_momentum_is_the_gradient_with_the_sent_elements_taken_out_bitwise() -> None:
    w = nn.Parameter(torch.zeros(40, 72))
    opt = torch.optim.SGD([w], lr=0.1)
    exchange = DeMoExchange(opt, unclipped(CodecConfig(chunk=32, topk=5, value_format="fp32", dense_below=0, dense_vectors=False, transform="identity"),
                                            decay=0.9, update="raw"))
    g = torch.randn(40, 72, generator=torch.Generator().manual_seed(3))
    w.grad = g.clone()
    exchange.step()
    layout = plan_tiles((40, 72), 32)
    tiles = to_tiles(g, layout).reshape(layout.n_tiles, -1)
    top = tiles.abs().topk(5, dim=1).indices
    kept = torch.zeros_like(tiles).scatter_(1, top, tiles.gather(1, top))
    residual = tiles - kept
    stored = tile_view(exchange.averaged_state()[w], layout).reshape(layout.n_tiles, -1)
    assert torch.equal(stored, residual)  # the momentum as it is, in its own (padded) layout
    assert torch.equal(exchange.momentum(w), g - w.grad)
    assert torch.equal(to_tiles(w.grad, layout).reshape(layout.n_tiles, -1), kept)  # sent exactly the top-5 elements


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_compressed_mean_sends_the_inverse_of_the_top_k_of_the_transform(transform: str, world_size: int) -> None:
    x = torch.randn(40, 72, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    config = CodecConfig(chunk=32, topk=7, value_format="fp32", dense_below=0, dense_vectors=False, transform=transform)  # type: ignore[arg-type]
    (mean,), (sent,) = CompressedMean(config, IdenticalWorkers(world_size))([x], "t")  # type: ignore[arg-type]
    layout = plan_tiles((40, 72), 32)
    k_ = tiles_naive(padded(x.numpy(), layout), layout.tile_shape, transform)
    kept = np.zeros_like(k_)
    for a in range(0, layout.padded_rows, 32):
        for b in range(0, layout.padded_cols, 32):
            tile = k_[a : a + 32, b : b + 32].reshape(-1)
            keep = np.argsort(-np.abs(tile), kind="stable")[:7]
            out = np.zeros_like(tile)
            out[keep] = tile[keep].astype(np.float32)
            kept[a : a + 32, b : b + 32] = out.reshape(32, 32)
    expected = tiles_naive(kept, layout.tile_shape, transform, inverse=True)[:40, :72]
    np.testing.assert_allclose(sent.numpy(), expected, rtol=0, atol=1e-10)
    assert torch.equal(mean, sent)  # identical workers, W = 1, 2, 4: bitwise one worker's


# ---------------------------------------------------------------------------------------- checkpoints across transforms
def _exchange(transform: str, w: nn.Parameter) -> DeMoExchange:
    opt = torch.optim.SGD([w], lr=0.1)
    return DeMoExchange(opt, unclipped(CodecConfig(chunk=32, topk=6, value_format="fp32", dense_below=0, dense_vectors=False, transform=transform),  # type: ignore[arg-type]
                                        decay=0.9, update="raw"))


@pytest.mark.parametrize("saved,loaded", [("dct", "haar"), ("haar", "identity"), ("identity", "dct"), ("dct", None)])
def test_a_momentum_saved_in_one_transform_is_converted_when_loaded_in_another(saved: str, loaded: str | None) -> None:
    torch.manual_seed(2)
    w = nn.Parameter(torch.randn(40, 72, dtype=torch.float64))
    source = _exchange(saved, w)
    for _ in range(3):
        w.grad = torch.randn_like(w)
        source.step()
    state = source.state_dict()
    assert all(entry["transform"] == saved for entry in state["momentum"]["momenta"].values())
    if loaded is None:  # a checkpoint from before the choice: no record, read as DCT
        for entry in state["momentum"]["momenta"].values():
            del entry["transform"]
        loaded = "dct"
    before = source.momentum(w)
    target = _exchange(loaded, w)
    target.load_state_dict(state)
    torch.testing.assert_close(target.momentum(w), before, rtol=0, atol=1e-12)  # still in the saved transform
    w.grad = torch.zeros_like(w)
    target.step()  # converted, then decayed by 0.9 and k of it sent
    torch.testing.assert_close(target.momentum(w) + w.grad, 0.9 * before, rtol=0, atol=1e-10)
    assert all(entry["transform"] == loaded for entry in target.state_dict()["momentum"]["momenta"].values())


def test_retiling_keeps_the_momentum_under_haar_and_identity() -> None:
    for transform in ("haar", "identity"):
        torch.manual_seed(1)
        w = nn.Parameter(torch.randn(40, 72, dtype=torch.float64))
        exchange = _exchange(transform, w)
        for _ in range(2):
            w.grad = torch.randn_like(w)
            exchange.step()
        for settings in (TensorSettings(chunk=16), TensorSettings(dense=True), None):
            before = exchange.momentum(w)
            exchange.set_tensor_settings(w, settings)
            w.grad = torch.zeros_like(w)
            exchange.step()
            torch.testing.assert_close(exchange.momentum(w) + w.grad, 0.9 * before, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------- two real processes
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 67)  # rows 67: padded tiles
        self.c = nn.Linear(67, 48, bias=False)  # rows 48: a Haar side that is not a power of two

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))).sum()


DIST_CONFIGS = {
    "dct": {"topk": 8, "dense_below": 100, "value_format": "sign"},
    "haar": {"topk": 8, "dense_below": 100, "value_format": "sign", "transform": "haar"},
    "identity": {"topk": 8, "dense_below": 100, "value_format": "sign", "transform": "identity"},
    "haar-lowpass-int8": {"topk": 8, "dense_below": 100, "selection": "lowpass", "value_format": "int8", "transform": "haar"},
    "identity-shared-bf16": {"topk": 8, "dense_below": 100, "selection": "shared", "value_format": "bf16", "transform": "identity"},
}


def _train(rank: int, world: int, steps: int, names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        torch.manual_seed(0)
        model = _Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        exchange = DeMoExchange(opt, unclipped_of(**DIST_CONFIGS[name]), Communicator())
        params, momenta = [], []
        for step in range(steps):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1000 * step + rank))  # different data per rank
            opt.zero_grad()
            model(x).backward()
            exchange.step()
            opt.step()
            params.append([tensor_hash(p) for p in model.parameters()])
            momenta.append([tensor_hash(exchange.momentum(p)) for p in model.parameters()])
        out[name] = {"params": params, "momenta": momenta}
    return out


def test_two_processes_keep_replicas_bitwise_equal_under_every_transform(tmp_path: Path) -> None:
    ranks = run_workers(_train, 2, tmp_path, 4, sorted(DIST_CONFIGS))
    for name in DIST_CONFIGS:
        assert ranks[0][name]["params"] == ranks[1][name]["params"], name  # after every step
        assert ranks[0][name]["momenta"][-1] != ranks[1][name]["momenta"][-1], name  # local momenta differ (negative control)
    # the transforms really differ: the same data gives other parameters under each
    finals = {name: tuple(ranks[0][name]["params"][-1]) for name in ("dct", "haar", "identity")}
    assert len(set(finals.values())) == 3
