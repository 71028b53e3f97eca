"""The momentum kept as DCT coefficients: the algorithm written out in coefficient space (scipy),
padded tiles, re-tiling on per-tensor setting changes (one process and on every rank), the state's
layout version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.fft
import torch
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoExchange, TensorSettings
from demo_lightning.comm import Communicator

from exchange_inputs import unclipped
from tests.dist_helpers import run_workers, tensor_hash


def _tiles(shape: tuple[int, int], tile: tuple[int, int]) -> list[tuple[slice, slice]]:
    return [(slice(a, a + tile[0]), slice(b, b + tile[1])) for a in range(0, shape[0], tile[0]) for b in range(0, shape[1], tile[1])]


class _CoefficientOracle:
    """DeMo in coefficient space for one worker, written out with scipy (float64, fp32 values on the wire)::

        M <- decay M + DCT(pad(g));  I = top-k |M| per tile;  V = fp32(M[I]);  M[I] <- M[I] - V;  Q = IDCT(scatter(I, V))

    ``M`` is the padded matrix of spectra: the padding's residual stays in it (nothing is cropped)."""

    def __init__(self, shape: tuple[int, int], chunk: int, k: int, decay: float) -> None:
        self.rows, self.cols = shape
        self.tile = (min(chunk, self.rows), min(chunk, self.cols))
        self.padded = (-(-self.rows // self.tile[0]) * self.tile[0], -(-self.cols // self.tile[1]) * self.tile[1])
        self.k, self.decay = k, decay
        self.M = np.zeros(self.padded)

    def step(self, g: np.ndarray) -> np.ndarray:
        G = np.zeros(self.padded)
        G[: self.rows, : self.cols] = g
        sparse = np.zeros(self.padded)
        for rs, cs in _tiles(self.padded, self.tile):
            self.M[rs, cs] = self.decay * self.M[rs, cs] + scipy.fft.dctn(G[rs, cs], norm="ortho")
            flat = self.M[rs, cs].reshape(-1).copy()
            keep = np.argsort(-np.abs(flat), kind="stable")[: self.k]
            values = flat[keep].astype(np.float32).astype(np.float64)
            s = np.zeros_like(flat)
            s[keep] = values
            flat[keep] -= values
            self.M[rs, cs] = flat.reshape(self.tile)
            sparse[rs, cs] = s.reshape(self.tile)
        q = np.zeros(self.padded)
        for rs, cs in _tiles(self.padded, self.tile):
            q[rs, cs] = scipy.fft.idctn(sparse[rs, cs], norm="ortho")
        return q[: self.rows, : self.cols]

    def dense(self) -> np.ndarray:
        out = np.zeros(self.padded)
        for rs, cs in _tiles(self.padded, self.tile):
            out[rs, cs] = scipy.fft.idctn(self.M[rs, cs], norm="ortho")
        return out[: self.rows, : self.cols]


@pytest.mark.parametrize("shape", [(40, 72), (64, 96), (1, 100)], ids=["padded", "exact", "one-row-padded"])
def test_world_size_one_equals_the_coefficient_space_algorithm_written_out(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(shape, dtype=torch.float64))
    opt = torch.optim.SGD([weight], lr=0.1)
    exchange = DeMoExchange(opt, unclipped(CodecConfig(chunk=32, topk=5, value_format="fp32", dense_below=0, dense_vectors=False), decay=0.9, update="raw"))
    oracle = _CoefficientOracle(shape, 32, 5, 0.9)
    for _ in range(4):
        g = torch.randn(shape, dtype=torch.float64)
        weight.grad = g.clone()
        exchange.step()
        q = oracle.step(g.numpy())
        np.testing.assert_allclose(weight.grad.numpy(), q, atol=1e-10)
        np.testing.assert_allclose(exchange.momentum(weight).numpy(), oracle.dense(), atol=1e-10)
        np.testing.assert_allclose(exchange.averaged_state()[weight].numpy(), oracle.M, atol=1e-10)  # the stored spectra
    # the padding's residual is kept: nonzero exactly when the shape does not tile
    padding = np.ones(oracle.padded, dtype=bool)
    padding[: shape[0], : shape[1]] = False
    dense_padded = np.zeros(oracle.padded)
    for rs, cs in _tiles(oracle.padded, oracle.tile):
        dense_padded[rs, cs] = scipy.fft.idctn(oracle.M[rs, cs], norm="ortho")
    kept = float(np.abs(dense_padded[padding]).max()) if padding.any() else 0.0
    assert (kept > 1e-3) == (shape != (64, 96))


def test_the_parameter_space_form_differs_only_where_the_padding_residual_is_kept() -> None:
    # the previous layout cropped the residual every step; for an exactly tiled shape both forms agree
    def parameter_space(shape: tuple[int, int], steps: list[np.ndarray]) -> np.ndarray:
        m = np.zeros(shape)
        oracle = _CoefficientOracle(shape, 32, 5, 0.9)
        for g in steps:
            oracle.M = np.zeros(oracle.padded)  # m is re-padded with zeros each step ...
            m = 0.9 * m + g
            q = oracle.step(m)  # ... so the spectrum of the cropped m is selected from
            m = m - q
        return q

    for shape, equal in (((64, 96), True), ((40, 72), False)):
        steps = [np.random.default_rng(s).standard_normal(shape) for s in range(3)]
        ours = _CoefficientOracle(shape, 32, 5, 0.9)
        q = [ours.step(g) for g in steps][-1]
        assert np.allclose(q, parameter_space(shape, steps), atol=1e-9) == equal


def test_retiling_on_chunk_and_dense_changes_keeps_each_momentum() -> None:
    torch.manual_seed(1)
    exact = nn.Parameter(torch.randn(64, 64, dtype=torch.float64))
    padded = nn.Parameter(torch.randn(40, 72, dtype=torch.float64))
    opt = torch.optim.SGD([exact, padded], lr=0.1)
    exchange = DeMoExchange(opt, unclipped(CodecConfig(chunk=32, topk=6, value_format="fp32", dense_below=0, dense_vectors=False, dense_format="fp32"),
                                            decay=0.9, update="raw"))  # fp32: a dense tensor sends everything

    def step() -> None:
        exact.grad, padded.grad = torch.randn_like(exact), torch.randn_like(padded)
        exchange.step()

    for _ in range(3):
        step()
    changes = [TensorSettings(chunk=16), TensorSettings(chunk=16, topk=9), TensorSettings(dense=True), TensorSettings(dense=False), None]
    for settings in changes:
        before = {p: exchange.momentum(p) for p in (exact, padded)}
        for p in (exact, padded):
            exchange.set_tensor_settings(p, settings)
        exact.grad, padded.grad = torch.zeros_like(exact), torch.zeros_like(padded)
        exchange.step()  # re-tiles, then decays the converted momentum by 0.9 and sends k of it
        sent_exact = exact.grad.clone()
        # one worker: what was sent is the shared direction; the rest stayed, 0.9 times what it was
        dense_now = exchange.momentum(exact)
        torch.testing.assert_close(dense_now + sent_exact, 0.9 * before[exact], atol=1e-10, rtol=0)
        torch.testing.assert_close(exchange.momentum(padded) + padded.grad, 0.9 * before[padded], atol=1e-10, rtol=0)
        if settings is not None and settings.dense:
            assert torch.equal(dense_now, torch.zeros_like(exact))  # dense: everything sent
        else:
            tile = settings.chunk if settings is not None and settings.chunk else 32
            assert exchange.averaged_state()[exact].shape == (64, 64)
            assert exchange.averaged_state()[padded].shape == (48, 80) if tile == 16 else (64, 96)


def _retile_on_every_rank(rank: int, world: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(72, 40), nn.Tanh(), nn.Linear(40, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    exchange = DeMoExchange(opt, unclipped(CodecConfig(chunk=32, topk=8, dense_below=100, dense_format="fp32")), Communicator())
    schedule = {2: TensorSettings(chunk=16), 4: TensorSettings(dense=True), 5: TensorSettings(dense=False, topk=3), 6: None}
    params, momenta = [], []
    for step in range(steps):
        if step in schedule:
            exchange.set_tensor_settings(model[0].weight, schedule[step])  # every rank, the same step
        gen = torch.Generator().manual_seed(10 * step + rank)
        opt.zero_grad()
        model(torch.randn(16, 72, generator=gen)).pow(2).mean().backward()
        exchange.step()
        opt.step()
        params.append([tensor_hash(p) for p in model.parameters()])
        momenta.append(tensor_hash(exchange.momentum(model[0].weight)))
    return {"params": params, "momenta": momenta}


def test_retiling_runs_identically_on_every_rank_and_replicas_stay_bitwise_equal(tmp_path: Path) -> None:
    r0, r1 = run_workers(_retile_on_every_rank, 2, tmp_path, 8, timeout=120)
    assert r0["params"] == r1["params"]
    differ = [a != b for a, b in zip(r0["momenta"], r1["momenta"])]
    assert differ[4] is False  # dense (fp32) at step 4: both residuals cleared
    assert sum(differ) >= 6  # negative control: the ranks' own momenta differ at the compressed steps


def test_state_dict_round_trip_resumes_the_same_trajectory_bitwise() -> None:
    def run(state: Any, start: int, stop: int) -> tuple[DeMoExchange, list[torch.Tensor]]:
        torch.manual_seed(2)
        model = nn.Linear(72, 40)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        exchange = DeMoExchange(opt, unclipped(CodecConfig(chunk=32, topk=4, dense_below=0, dense_vectors=False)))
        if state is not None:
            exchange.load_state_dict(state)
        grads = []
        for s in range(start, stop):
            model.weight.grad = torch.randn(40, 72, generator=torch.Generator().manual_seed(s))
            model.bias.grad = torch.randn(40, generator=torch.Generator().manual_seed(100 + s))
            exchange.step()
            grads.append(model.weight.grad.clone())
        return exchange, grads

    straight, updates = run(None, 0, 4)
    first, _ = run(None, 0, 2)
    saved = first.state_dict()
    assert saved["momentum"]["version"] == 2
    assert saved["momentum"]["momenta"][0]["value"].shape == (64, 96)  # spectra, the padding's residual included
    assert saved["momentum"]["momenta"][0]["layout"] == [40, 72, 32, 32]
    resumed, resumed_updates = run(saved, 2, 4)
    assert all(torch.equal(a, b) for a, b in zip(updates[2:], resumed_updates))
    for i in (0, 1):
        assert torch.equal(resumed.state_dict()["momentum"]["momenta"][i]["value"], straight.state_dict()["momentum"]["momenta"][i]["value"])
