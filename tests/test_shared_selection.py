"""``selection="shared"`` (ScaleCom's cyclic local top-k) against an independent oracle on real processes.

Oracle (scipy's orthonormal DCT-II, not our transform): at exchange ``t`` every worker's momentum
spectrum is ``M_r = decay * R_r + DCT(g_r)`` tile by tile; the leader ``t mod W`` picks the ``k``
largest ``|M_leader|`` per tile; every worker's residual becomes ``M_r`` with those positions zeroed
(fp32 values go out exactly), and the shared update is ``IDCT(mean_r M_r at the positions)``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy.fft import dctn, idctn
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoExchange
from demo_lightning.algorithms.desloc import DesLocConfig
from demo_lightning.comm import Communicator

from exchange_inputs import unclipped_of

from dist_helpers import run_workers

pytestmark = pytest.mark.timeout(240)
K, DECAY, STEPS = 8, 0.9, 4
SHAPE = (64, 128)  # two 64x64 tiles side by side


def _shared_steps(rank: int, world: int, value_format: str = "fp32") -> dict[str, Any]:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(SHAPE))
    opt = torch.optim.SGD([w], lr=0.0)  # the parameters do not matter here: the grads and residuals do
    exchange = DeMoExchange(opt, unclipped_of(selection="shared", value_format=value_format, topk=K, dense_below=0, dense_vectors=False,
                                               decay=DECAY, update="raw"), Communicator())
    out: dict[str, list] = {"grads": [], "residuals": [], "updates": []}
    for step in range(STEPS):
        w.grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 * step + rank))
        out["grads"].append(w.grad.clone())
        exchange.step()
        out["updates"].append(w.grad.clone())
        out["residuals"].append(exchange.averaged_state()[w].clone())
    out["sent"] = exchange.comm.ledger.last_step.sent_bytes  # type: ignore[union-attr]
    out["tags"] = sorted(exchange.comm.ledger.totals)
    return out


def _tiles(x: np.ndarray) -> list[np.ndarray]:
    return [x[:, c : c + 64] for c in range(0, x.shape[1], 64)]


def test_three_workers_follow_the_cyclic_leader_oracle(tmp_path: Path) -> None:
    world = 3
    ranks = run_workers(_shared_steps, world, tmp_path)
    residual = [np.zeros(SHAPE) for _ in range(world)]
    for step in range(STEPS):
        leader = step % world
        spectra = [DECAY * residual[r] + np.hstack([dctn(t, norm="ortho") for t in _tiles(ranks[r]["grads"][step].double().numpy())])
                   for r in range(world)]
        mean = np.zeros(SHAPE)
        for c in range(0, SHAPE[1], 64):  # per tile: the leader's k largest magnitudes
            tile = spectra[leader][:, c : c + 64]
            chosen = np.argsort(-np.abs(tile).reshape(-1), kind="stable")[:K]
            mask = np.zeros(64 * 64, dtype=bool)
            mask[chosen] = True
            mask = mask.reshape(64, 64)
            for r in range(world):
                mean[:, c : c + 64] += np.where(mask, spectra[r][:, c : c + 64], 0.0) / world
                spectra[r][:, c : c + 64] = np.where(mask, 0.0, spectra[r][:, c : c + 64])
            for r in range(world):  # the zeros of every worker's residual are the leader's positions
                got = ranks[r]["residuals"][step][:, c : c + 64].numpy()
                assert np.array_equal(got == 0, mask), (step, r, c)
        update = np.hstack([idctn(t, norm="ortho") for t in _tiles(mean)])
        for r in range(world):
            residual[r] = spectra[r]
            np.testing.assert_allclose(ranks[r]["residuals"][step].double().numpy(), spectra[r], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(ranks[r]["updates"][step].double().numpy(), update, rtol=1e-4, atol=1e-5)
            assert torch.equal(ranks[r]["updates"][step], ranks[0]["updates"][step])  # bitwise the same everywhere
    assert ranks[0]["tags"] == ["demo/plan", "demo/positions", "demo/shared"]


def test_bytes_per_worker_do_not_grow_with_the_number_of_workers(tmp_path: Path) -> None:
    # mean over the workers of the last step's sent bytes
    sent = {w: sum(r["sent"] for r in run_workers(_shared_steps, w, tmp_path / f"w{w}", "bf16")) / w for w in (2, 4)}
    tiles = math.prod(SHAPE) // 4096
    values = tiles * K * 2  # bf16
    positions = math.ceil(tiles * K * 12 / 8)
    for w, got in sent.items():  # the all-reduce's 2 (W-1)/W of the values; the ring broadcast: every worker but one forwards the positions
        assert got == pytest.approx(2 * (w - 1) / w * values + (w - 1) / w * positions)
    assert sent[4] / sent[2] <= 1.5  # bounded by 2x at any W; an all-gather of the same payload takes (W - 1)x: 3x here
    assert CodecConfig(selection="shared", value_format="bf16", topk=K, dense_below=0, dense_vectors=False).payload_bytes(SHAPE) == values + positions


def test_one_worker_shared_equals_its_own_topk() -> None:
    def run(selection: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(70, 130))
        opt = torch.optim.SGD([w], lr=0.1)
        exchange = DeMoExchange(opt, unclipped_of(selection=selection, value_format="fp32", topk=K, dense_below=0, dense_vectors=False))
        updates = []
        for step in range(3):
            w.grad = torch.randn(70, 130, generator=torch.Generator().manual_seed(step))
            exchange.step()
            updates.append(w.grad.clone())
            opt.step()
        return updates + [exchange.momentum(w)]

    for a, b in zip(run("shared"), run("topk")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("value_format", ["sign", "int8"])
def test_shared_refuses_values_that_cannot_be_summed(value_format: str) -> None:
    with pytest.raises(ValueError, match=r"selection='shared'.*value_format='fp32', 'bf16' or 'fp16'"):
        CodecConfig(selection="shared", value_format=value_format)


def test_shared_is_refused_for_desloc_compressed_sync() -> None:
    with pytest.raises(ValueError, match="selection='shared' is for the DeMo exchange"):
        DesLocConfig(param_sync_every=4, compress_params=True, codec=CodecConfig(selection="shared", value_format="bf16"))
