"""The exchange's early phase (issue 18): while fewer than ``early_steps`` exchanges have run, an
exchange keeps more coefficients per tile; left unset, the phase keeps 256 a tile for
``clamp(80 // W, 20, 40)`` exchanges over ``W`` workers for the default k and is off for an explicit
strength; set, ``early_steps`` applies to any k (4x an explicit one, or ``early_topk_factor`` times);
per-tensor strengths keep theirs; the count is checkpointed, so a resume continues inside or after
the phase; every rank agrees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange, TensorSettings, default_early_steps
from demo_lightning.comm import Communicator

from dist_helpers import run_workers

pytestmark = pytest.mark.timeout(240)


def test_the_default_phase_keeps_256_a_tile_for_fewer_exchanges_as_workers_grow() -> None:
    config = DeMoConfig()
    assert (config.early_steps, config.early_topk_factor, config.has_early_phase) == (None, None, True)
    assert [config.early_exchanges_for(w) for w in (1, 2, 3, 4, 8, 16)] == [40, 40, 26, 20, 20, 20]
    assert [default_early_steps(w) for w in (1, 2, 3, 4, 5, 64)] == [40, 40, 26, 20, 20, 20]
    assert [config.early_codec_for(w).topk for w in (1, 2, 3, 4, 8, 16)] == [256] * 6  # the steady k: 64 64 42 32 16 8
    assert DeMoConfig.of(selection="shared", value_format="bf16").early_codec_for(8).topk == 256  # all-reduced: 4 x 64
    assert DeMoConfig.of(early_steps=7).early_exchanges_for(4) == 7 and DeMoConfig.of(early_topk_factor=1).early_exchanges_for(2) == 0
    assert DeMoConfig.of(early_topk_factor=4).early_codec_for(4).topk == 128  # a given factor multiplies the k of W workers
    # ... for 40 exchanges at any W, as before the phase followed W (the stored early_topk_factor=8 runs re-run as they were)
    assert [DeMoConfig.of(early_topk_factor=8).early_exchanges_for(w) for w in (2, 4, 8)] == [40, 40, 40]
    assert DeMoConfig.of(topk=64).early_codec_for(4) is None
    assert CodecConfig().for_workers(2, 4).topk == 256 and CodecConfig().for_workers(4, 4).topk == 128
    with pytest.raises(ValueError, match="workers"):
        default_early_steps(0)


@pytest.mark.parametrize("settings", [{"topk": 64}, {"keep_ratio": 0.02}, {"early_steps": 0}, {"early_topk_factor": 1}])
def test_an_explicit_strength_or_a_switched_off_phase_has_none(settings: dict[str, Any]) -> None:
    config = DeMoConfig.of(**settings)
    assert not config.has_early_phase
    model = nn.Linear(64, 128, bias=False)
    ex = DeMoExchange(torch.optim.SGD(model.parameters(), lr=0.1), config, Communicator())
    k = ex.k_of(model.weight)
    model.weight.grad = torch.randn(128, 64)
    ex.step()
    assert not ex.in_early_phase and ex.k_of(model.weight) == k and ex.stats.coefficients == 2 * k


@pytest.mark.parametrize(("settings", "early", "steady"), [({}, 256, 64), ({"early_steps": 2}, 256, 64), ({"topk": 64}, 64, 64)])
def test_the_exchange_keeps_the_phase_it_was_given(settings: dict[str, Any], early: int, steady: int) -> None:
    """At 1 worker the default k is 64: the unset phase (40 exchanges) survives the k's resolution."""
    model = nn.Linear(64, 128, bias=False)
    ex = DeMoExchange(torch.optim.SGD(model.parameters(), lr=0.1), DeMoConfig.of(**settings), Communicator())
    assert ex.config.early_steps == DeMoConfig.of(**settings).early_exchanges_for(1)
    ks = []
    for _ in range(3):
        ks.append(ex.k_of(model.weight))
        model.weight.grad = torch.randn(128, 64)
        ex.step()
    assert ks == ([early] * 3 if not settings else [early, early, steady])
    assert ex.k_of(model.weight, steady=True) == steady


def test_the_strategy_passes_early_steps_through() -> None:
    from demo_lightning import DeMoStrategy

    assert DeMoStrategy().demo_config.early_exchanges_for(2) == 40
    assert DeMoStrategy().demo_config.early_exchanges_for(4) == 20
    assert DeMoStrategy(topk=64).demo_config.early_exchanges_for(2) == 0
    assert DeMoStrategy(topk=64, early_steps=40).demo_config.early_exchanges_for(4) == 40
    assert DeMoStrategy(early_topk_factor=8).demo_config.early_codec_for(4).topk == 256


@pytest.mark.parametrize(("settings", "early", "steady"), [
    ({"topk": 16, "early_steps": 2}, 64, 16),
    ({"topk": 2000, "early_steps": 2}, 4096, 2000),  # 8,000 is past the 64 x 64 tile: the whole tile
    ({"keep_ratio": 0.01, "early_steps": 2, "early_topk_factor": 3}, 123, 41),  # ceil(0.03 * 4096), ceil(0.01 * 4096)
    ({"keep_ratio": 0.3, "early_steps": 2}, 4096, 1229),  # 1.2 capped at 1
])
def test_an_explicit_strength_with_early_steps_given_has_the_phase(settings: dict[str, Any], early: int, steady: int) -> None:
    config = DeMoConfig.of(**settings)
    assert config.has_early_phase and config.early_exchanges_for(4) == 2
    model = nn.Linear(64, 128, bias=False)  # two 64 x 64 tiles
    ex = DeMoExchange(torch.optim.SGD(model.parameters(), lr=0.1), config, Communicator())
    ks, sent = [], []
    for _ in range(3):
        ks.append(ex.k_of(model.weight))
        model.weight.grad = torch.randn(128, 64)
        ex.step()
        sent.append(ex.stats.coefficients)
    assert ks == [early, early, steady] and sent == [2 * early, 2 * early, 2 * steady]
    assert ex.k_of(model.weight, steady=True) == steady


def test_an_explicit_k_in_the_phase_equals_the_larger_k_set_by_hand() -> None:
    """Oracle: ``topk=16, early_steps=2`` against k 64 given per tensor for 2 steps, then 16."""
    torch.manual_seed(0)
    model = nn.Linear(128, 64, bias=False)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    twin = nn.Linear(128, 64, bias=False)
    twin.load_state_dict(start)
    early = DeMoExchange(torch.optim.SGD(model.parameters(), lr=0.1), DeMoConfig.of(topk=16, early_steps=2, update="raw"),
                         Communicator())
    by_hand = DeMoExchange(torch.optim.SGD(twin.parameters(), lr=0.1), DeMoConfig.of(topk=16, update="raw"), Communicator())

    def set_k(step: int) -> None:
        by_hand.set_tensor_settings(twin.weight, TensorSettings(topk=64) if step < 2 else None)

    got = _train(early, model, 5, seed=4)
    want = _train(by_hand, twin, 5, seed=4, before_step=set_k)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(early.momentum(model.weight), by_hand.momentum(twin.weight))
    # a control: the same explicit k without early_steps sends 16 from the first step, so its first update differs
    plain = nn.Linear(128, 64, bias=False)
    plain.load_state_dict(start)
    control = _train(DeMoExchange(torch.optim.SGD(plain.parameters(), lr=0.1), DeMoConfig.of(topk=16, update="raw"),
                                  Communicator()), plain, 1, seed=4)
    assert not torch.equal(control[0], got[0])


@pytest.mark.parametrize(("settings", "message"), [
    ({"early_steps": -1}, "early_steps"), ({"early_steps": 2.5}, "early_steps"), ({"early_steps": True}, "early_steps"),
    ({"early_topk_factor": 0}, "early_topk_factor"), ({"early_topk_factor": 1.5}, "early_topk_factor"),
])
def test_bad_early_settings_name_the_argument(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeMoConfig.of(**settings)


def _train(ex: DeMoExchange, model: nn.Module, steps: int, seed: int, before_step: Any = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        ex.step()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
    return grads


def test_the_phase_equals_the_larger_k_then_the_default_set_by_hand() -> None:
    """Oracle: the same exchange with k 256 given per tensor for the first 3 steps, then 64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 128, bias=False), nn.Linear(128, 64))  # padded tiles, a dense bias
    twin = nn.Sequential(nn.Linear(100, 128, bias=False), nn.Linear(128, 64))
    twin.load_state_dict(model.state_dict())
    early = DeMoExchange(torch.optim.SGD(model.parameters(), lr=0.1), DeMoConfig.of(early_steps=3, update="raw"), Communicator())
    by_hand = DeMoExchange(torch.optim.SGD(twin.parameters(), lr=0.1), DeMoConfig.of(early_steps=0, update="raw"), Communicator())
    compressed = [p for p in twin.parameters() if p.numel() >= 4096]

    def set_k(step: int) -> None:
        for p in compressed:
            by_hand.set_tensor_settings(p, TensorSettings(topk=256) if step < 3 else None)

    ks = []
    got = _train(early, model, 6, seed=1, before_step=lambda step: ks.append(early.k_of(model[0].weight)))
    want = _train(by_hand, twin, 6, seed=1, before_step=set_k)
    assert ks == [256, 256, 256, 64, 64, 64]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(early.momentum(p), by_hand.momentum(q)) for p, q in zip(model.parameters(), twin.parameters()))
    # a control: without the phase the first updates differ
    plain = nn.Sequential(nn.Linear(100, 128, bias=False), nn.Linear(128, 64))
    plain.load_state_dict(model.state_dict())
    control = _train(DeMoExchange(torch.optim.SGD(plain.parameters(), lr=0.1), DeMoConfig.of(early_steps=0, update="raw"),
                                  Communicator()), plain, 1, seed=1)
    assert not torch.equal(control[0], got[0])


@pytest.mark.parametrize("saved_at", [2, 5])
def test_a_resume_continues_inside_or_after_the_phase_bitwise(saved_at: int) -> None:
    torch.manual_seed(0)
    config = DeMoConfig.of(early_steps=3, update="raw")
    model = nn.Linear(128, 64, bias=False)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    straight = DeMoExchange(torch.optim.SGD(model.parameters(), lr=0.1), config, Communicator())
    gen_grads = _train(straight, model, 7, seed=3)

    first = nn.Linear(128, 64, bias=False)
    first.load_state_dict(start)
    ex = DeMoExchange(torch.optim.SGD(first.parameters(), lr=0.1), config, Communicator())
    _train(ex, first, saved_at, seed=3)
    saved = ex.state_dict()
    assert saved["exchanges"] == saved_at

    second = nn.Linear(128, 64, bias=False)
    resumed = DeMoExchange(torch.optim.SGD(second.parameters(), lr=0.1), config, Communicator())
    resumed.load_state_dict(saved)
    assert resumed.in_early_phase == (saved_at < 3)
    gen = torch.Generator().manual_seed(3)
    for step in range(7):
        g = torch.randn(second.weight.shape, generator=gen)
        if step < saved_at:
            continue
        second.weight.grad = g
        resumed.step()
        assert torch.equal(second.weight.grad.reshape(-1), gen_grads[step])


def _steps(rank: int, world: int, settings: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(128, 256, bias=False)  # 8 tiles of 64 x 64
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ex = DeMoExchange(opt, DeMoConfig.of(**settings), Communicator())
    gen = torch.Generator().manual_seed(rank)
    sent, ks = [], []
    for _ in range(steps):
        ks.append(ex.k_of(model.weight))
        model(torch.randn(4, 128, generator=gen)).pow(2).sum().backward()
        ex.step()
        opt.step()
        opt.zero_grad()
        sent.append(ex.comm.ledger.last_step.sent_bytes)
    return {"sent": sent, "k": ks, "weight": model.weight.detach().clone()}


def test_three_gloo_workers_send_the_early_k_then_the_default_and_stay_identical(tmp_path: Path) -> None:
    ranks = run_workers(_steps, 3, tmp_path, {"early_steps": 2})
    early = run_workers(_steps, 3, tmp_path / "early", {"topk": 256, "early_steps": 0})
    steady = run_workers(_steps, 3, tmp_path / "steady", {"topk": 42, "early_steps": 0})
    assert all(r["k"] == [256, 256, 42, 42] for r in ranks)  # 256 a tile, the default k of 3 workers after
    for r, e, s in zip(ranks, early, steady):
        assert r["sent"][:2] == e["sent"][:2] and r["sent"][2:] == s["sent"][2:]
        # 2 peers' payloads of 8 tiles each, by hand: Elias-Fano positions (the default), k L + k + (4095 >> L) + 1
        # bits a tile (k 256: L 4, 1,536 bits; k 42: L 6, 358), a bit a value and a 4-byte scale a tile
        payload = {k: 8 * bits // 8 + 8 * k // 8 + 8 * 4 for k, bits in ((256, 1536), (42, 358))}
        assert r["sent"][0] - s["sent"][0] == 2 * (payload[256] - payload[42]) == 2784
    assert all(torch.equal(r["weight"], ranks[0]["weight"]) for r in ranks)


def test_four_gloo_workers_default_phase_is_20_exchanges_of_256_the_same_as_given_by_hand(tmp_path: Path) -> None:
    """Oracle: the unset phase at 4 workers equals ``early_topk_factor=8, early_steps=20`` bitwise (8 x the
    default k of 32); the control, the factor of 2 workers (4: 128 a tile), sends fewer bytes and differs."""
    default = run_workers(_steps, 4, tmp_path, {}, 22)
    by_hand = run_workers(_steps, 4, tmp_path / "hand", {"early_topk_factor": 8, "early_steps": 20}, 22)
    control = run_workers(_steps, 4, tmp_path / "control", {"early_topk_factor": 4, "early_steps": 20}, 22)
    assert all(r["k"] == [256] * 20 + [32] * 2 for r in default)
    for d, h, c in zip(default, by_hand, control):
        assert d["sent"] == h["sent"] and torch.equal(d["weight"], h["weight"])
        assert c["sent"][0] < d["sent"][0] and c["sent"][20:] == d["sent"][20:]
    assert all(torch.equal(r["weight"], default[0]["weight"]) for r in default)
    assert not torch.equal(control[0]["weight"], default[0]["weight"])
