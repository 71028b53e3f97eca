"""DeMo exchange in one process: equals the algorithm computed directly (scipy DCT), state handling, config errors."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.fft
import torch
from torch import nn

from demo_lightning.algorithms import DeMoConfig, DeMoExchange

from exchange_inputs import unclipped_of


def _direct_step(m: np.ndarray, g: np.ndarray, decay: float, chunk: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The paper's step for one 2-D tensor whose sides are multiples of ``chunk``, written out with numpy/scipy.

    Returns (new residual momentum, shared direction Q) for a single worker (bf16 values on the wire).
    """
    m = decay * m + g
    rows, cols = m.shape
    sent = np.zeros_like(m)
    for r in range(0, rows, chunk):
        for c in range(0, cols, chunk):
            coeffs = scipy.fft.dctn(m[r : r + chunk, c : c + chunk], norm="ortho")
            flat = coeffs.reshape(-1)
            keep = np.argsort(-np.abs(flat), kind="stable")[:k]
            sparse = np.zeros_like(flat)
            sparse[keep] = torch.tensor(flat[keep]).to(torch.bfloat16).double().numpy()
            sent[r : r + chunk, c : c + chunk] = scipy.fft.idctn(sparse.reshape(chunk, chunk), norm="ortho")
    return m - sent, sent  # one worker: the mean of the sent parts is its own


def test_world_size_one_equals_direct_computation() -> None:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(128, 192, dtype=torch.float64))
    opt = torch.optim.SGD([weight], lr=0.1)
    exchange = DeMoExchange(opt, unclipped_of(chunk=64, topk=16, decay=0.9, update="raw", dense_below=0, dense_vectors=False, value_format="bf16"))
    m = np.zeros((128, 192))
    for _ in range(3):
        g = torch.randn_like(weight)
        weight.grad = g.clone()
        exchange.step()
        m, q = _direct_step(m, g.numpy(), 0.9, 64, 16)
        np.testing.assert_allclose(weight.grad.numpy(), q, atol=1e-9)
        np.testing.assert_allclose(exchange.momentum(weight).numpy(), m, atol=1e-9)
    # the sign rule writes sign(Q)
    sign_opt = torch.optim.SGD([weight], lr=0.1)
    DeMoExchange(sign_opt, unclipped_of(chunk=64, topk=16, decay=0.9, update="sign", dense_below=0, dense_vectors=False)).step()
    assert set(torch.unique(weight.grad).tolist()) <= {-1.0, 0.0, 1.0}


def test_normalized_update_is_the_shared_direction_over_its_rms() -> None:
    # the same gradients through update="raw" and update="normalized": Q, and Q / sqrt(mean(Q^2)) per tensor
    torch.manual_seed(2)
    shapes = [(96, 80), (40,)]
    raw_params = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    norm_params = [nn.Parameter(p.detach().clone()) for p in raw_params]
    settings = dict(chunk=32, topk=6, decay=0.9, dense_below=0)
    raw = DeMoExchange(torch.optim.SGD(raw_params, lr=0.1), unclipped_of(update="raw", **settings))
    norm = DeMoExchange(torch.optim.SGD(norm_params, lr=0.1), unclipped_of(update="normalized", **settings))
    for _ in range(3):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for p, q, g in zip(raw_params, norm_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        raw.step()
        norm.step()
        for p, q in zip(raw_params, norm_params):
            expected = p.grad / p.grad.pow(2).mean().sqrt()
            torch.testing.assert_close(q.grad, expected, rtol=1e-12, atol=0)
            assert abs(q.grad.pow(2).mean().item() - 1.0) < 1e-12
    # a zero direction stays zero (no division by zero)
    zero = nn.Parameter(torch.zeros(64, 64, dtype=torch.float64))
    ex = DeMoExchange(torch.optim.SGD([zero], lr=0.1), unclipped_of(update="normalized", **settings))
    zero.grad = torch.zeros_like(zero)
    ex.step()
    assert torch.equal(zero.grad, torch.zeros_like(zero))


def test_dense_tensors_send_everything_in_fp32() -> None:  # bf16, the default: tests/test_dense_format.py
    bias = nn.Parameter(torch.zeros(10))
    opt = torch.optim.SGD([bias], lr=1.0)
    exchange = DeMoExchange(opt, unclipped_of(update="raw", dense_below=100, dense_format="fp32"))
    g = torch.randn(10)
    bias.grad = g.clone()
    stats = exchange.step()
    assert torch.equal(bias.grad, g)
    assert torch.equal(exchange.momentum(bias), torch.zeros(10))
    assert stats.payload_bytes == 40


def test_full_topk_raw_update_equals_plain_momentum_sgd_at_world_size_one() -> None:
    # keep every coefficient and decay 0: the shared direction is the gradient itself
    torch.manual_seed(1)
    a = nn.Linear(70, 50, dtype=torch.float64)
    b = nn.Linear(70, 50, dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    exchange = DeMoExchange(opt_a, unclipped_of(keep_ratio=1.0, decay=0.0, update="raw", dense_below=0, dense_vectors=False, value_format="fp32"))
    for _ in range(3):
        x = torch.randn(8, 70, dtype=torch.float64)
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
        exchange.step()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        # the wire carries fp32 values, so each coefficient is rounded to 24 bits once per step
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-9)


def test_adam_initialises_its_own_state_next_to_the_momentum() -> None:
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    exchange = DeMoExchange(opt, unclipped_of(update="raw", dense_below=100))
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
        exchange.step()
        opt.step()
        opt.zero_grad()
    for p in model.parameters():
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}  # the momentum is the exchange's own state
        assert exchange.has_momentum(p)
    assert set(exchange.state_dict()["momentum"]["momenta"]) == {0, 1}


def test_missing_grad_counts_as_zero_and_still_gets_the_update() -> None:
    used, unused = nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.SGD([used, unused], lr=0.1)
    exchange = DeMoExchange(opt, unclipped_of(update="raw", dense_below=0, dense_vectors=False))
    used.grad = torch.randn(64, 64)
    exchange.step()
    assert unused.grad is not None and torch.equal(unused.grad, torch.zeros(64, 64))
    assert torch.equal(exchange.momentum(unused), torch.zeros(64, 64))


def test_frozen_and_tied_parameters_are_exchanged_once_or_not_at_all() -> None:
    emb = nn.Embedding(100, 64)
    head = nn.Linear(64, 100, bias=False)
    head.weight = emb.weight
    frozen = nn.Linear(64, 64)
    frozen.requires_grad_(False)
    params = list(nn.ModuleList([emb, head, frozen]).parameters())
    assert len(params) == 3  # tied weight deduplicated
    opt = torch.optim.SGD([p for p in params if p.requires_grad], lr=0.1)
    exchange = DeMoExchange(opt, unclipped_of(dense_below=0, dense_vectors=False))
    emb.weight.grad = torch.randn(100, 64)
    stats = exchange.step()
    assert stats.n_trainable == 6400
    assert frozen.weight.grad is None


def test_local_state_round_trip_and_shape_check() -> None:
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exchange = DeMoExchange(opt, unclipped_of(dense_below=0, dense_vectors=False))
    model(torch.randn(2, 64)).sum().backward()
    exchange.step()
    before = [exchange.momentum(p) for p in model.parameters()]
    saved = exchange.state_dict()
    assert saved["momentum"]["version"] == 2 and set(saved["momentum"]["momenta"]) == {0, 1}
    exchange.clear_state()
    assert all(torch.equal(exchange.momentum(p), torch.zeros_like(p)) for p in model.parameters())
    exchange.load_state_dict(saved)
    assert all(torch.equal(exchange.momentum(p), b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match="different model"):
        exchange.load_state_dict({0: torch.zeros(3)})  # layout version 1 (parameter-shaped by index)
    with pytest.raises(ValueError, match="version"):
        exchange.load_state_dict({"momentum": {"version": 99, "momenta": {}}})


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"topk": 0}, "topk"),
        ({"topk": -3}, "topk"),
        ({"keep_ratio": 0.0}, "keep_ratio"),
        ({"keep_ratio": 1.5}, "keep_ratio"),
        ({"topk": 4, "keep_ratio": 0.1}, "not both"),
        ({"decay": 1.0}, "decay"),
        ({"decay": -0.1}, "decay"),
        ({"value_format": "fp8"}, "value_format"),
        ({"selection": "random"}, "selection"),
        ({"update": "adam"}, "update"),
        ({"chunk": 0}, "chunk"),
        ({"dense_below": -1}, "dense_below"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
    ],
)
def test_bad_config_names_the_argument(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        DeMoConfig.of(**kwargs)
