"""The DeMo exchange on real processes (gloo): replicas, oracles, byte accounting, awkward models."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from demo_lightning.algorithms import DeMoConfig, DeMoExchange
from demo_lightning.codec import segment_nbytes
from demo_lightning.comm import Communicator

from dist_helpers import run_workers, tensor_hash

pytestmark = pytest.mark.timeout(240)


class _Net(nn.Module):
    """2-D weights with sides that are multiples of 64, a prime-sized one, a conv, small dense tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 67)
        self.conv = nn.Conv1d(4, 8, 3)
        self.side = nn.Linear(64, 64, bias=False)  # used only on rank 0 when branch=True

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        out = self.b(h).sum() + self.conv(x.view(x.shape[0], 4, 16)).sum()
        if branch:
            out = out + self.side(x).pow(2).sum()
        return out


def _train(rank: int, world: int, steps: int, same_data: bool, config: dict, branch_rank0: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    exchange = DeMoExchange(opt, DeMoConfig.of(**config), Communicator())
    param_hashes, momentum_hashes = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + (0 if same_data else rank))
        x = torch.randn(8, 64, generator=gen)
        opt.zero_grad()
        model(x, branch=branch_rank0 and rank == 0).backward()
        exchange.step()
        opt.step()
        param_hashes.append([tensor_hash(p) for p in model.parameters()])
        momentum_hashes.append([tensor_hash(exchange.momentum(p)) for p in model.parameters()])
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "param_hashes": param_hashes,
        "momentum_hashes": momentum_hashes,
        "payload": exchange.comm.ledger.total_payload_bytes,
        "sent": exchange.comm.ledger.total_sent_bytes,
        "last_step": exchange.comm.ledger.last_step,
    }


CONFIGS = {
    "topk-bf16": {"topk": 8, "dense_below": 100, "value_format": "bf16"},
    "topk-int8": {"topk": 8, "dense_below": 100, "value_format": "int8"},
    "topk-sign": {"keep_ratio": 0.05, "dense_below": 100, "value_format": "sign", "update": "raw"},
    "lowpass-fp32": {"topk": 8, "dense_below": 100, "selection": "lowpass", "value_format": "fp32"},
    "lowpass-int8": {"topk": 8, "dense_below": 100, "selection": "lowpass", "value_format": "int8"},
    "shared-bf16": {"topk": 8, "dense_below": 100, "selection": "shared", "value_format": "bf16"},
    "topk-fp8": {"topk": 8, "dense_below": 100, "value_format": "fp8_e4m3"},
    "topk-compensated": {"topk": 8, "dense_below": 100, "value_format": "sign", "compensation": 0.2},
    "topk-smoothed": {"topk": 8, "dense_below": 100, "value_format": "sign", "gradient_ema": 0.9},
    "topk-mixed": {"topk": 8, "dense_below": 100, "value_format": "mixed"},
    "lowpass-fp8": {"topk": 8, "dense_below": 100, "selection": "lowpass", "value_format": "fp8_e5m2"},
}


def _train_each(rank: int, world: int, steps: int, same_data: bool, names: list[str]) -> dict[str, dict[str, Any]]:
    """``_train`` for several configurations in the same worker processes (one spawn, one import)."""
    return {name: _train(rank, world, steps, same_data, CONFIGS[name]) for name in names}


def test_two_ranks_with_identical_data_equal_one_rank_bitwise(tmp_path: Path) -> None:
    names = ["topk-bf16", "lowpass-fp32", "shared-bf16"]
    one = run_workers(_train_each, 1, tmp_path / "w1", 4, True, names)[0]
    two = run_workers(_train_each, 2, tmp_path / "w2", 4, True, names)
    for name in names:
        for result in two:
            for p1, p2 in zip(one[name]["params"], result[name]["params"]):
                assert torch.equal(p1, p2), name
            assert result[name]["momentum_hashes"] == one[name]["momentum_hashes"], name


def test_replicas_stay_bitwise_identical_while_momenta_differ_for_every_codec_configuration(tmp_path: Path) -> None:
    ranks = run_workers(_train_each, 2, tmp_path, 4, False, sorted(CONFIGS))
    for name in CONFIGS:
        assert ranks[0][name]["param_hashes"] == ranks[1][name]["param_hashes"], name  # after every step
        # negative control: with different data the local momenta (residuals) differ
        assert ranks[0][name]["momentum_hashes"][-1] != ranks[1][name]["momentum_hashes"][-1], name


def test_branch_used_on_one_rank_only_completes_in_sync(tmp_path: Path) -> None:
    ranks = run_workers(_train, 2, tmp_path, 3, False, CONFIGS["topk-bf16"], True, timeout=120)
    assert ranks[0]["param_hashes"] == ranks[1]["param_hashes"]
    side_before = _Net().side.weight  # the seed-0 init
    assert not torch.equal(ranks[1]["params"][-1], side_before)  # rank 1 moved it too (shared update)


def _count_collective_bytes(rank: int, world: int, steps: int, config: dict) -> dict[str, Any]:
    handed: list[int] = []
    real_gather, real_reduce = dist.all_gather, dist.all_reduce

    def gather(out: list, tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        handed.append(tensor.numel() * tensor.element_size())
        return real_gather(out, tensor, *a, **k)

    def reduce(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        handed.append(tensor.numel() * tensor.element_size())
        return real_reduce(tensor, *a, **k)

    dist.all_gather, dist.all_reduce = gather, reduce
    try:
        torch.manual_seed(0)
        w1, w2 = nn.Parameter(torch.randn(128, 192)), nn.Parameter(torch.randn(64, 64))
        bias = nn.Parameter(torch.randn(50))
        opt = torch.optim.SGD([w1, w2, bias], lr=0.01)
        comm = Communicator()
        exchange = DeMoExchange(opt, DeMoConfig.of(**config), comm)
        for _ in range(steps):
            for p in (w1, w2, bias):
                p.grad = torch.randn_like(p)
            exchange.step()
        return {"handed": sum(handed), "ledger_payload": comm.ledger.total_payload_bytes, "last": comm.ledger.last_step}
    finally:
        dist.all_gather, dist.all_reduce = real_gather, real_reduce


# bytes per tile of the 32 values, by hand: bf16 2 each; fp8 1 each + a 4-byte scale; mixed (a quarter,
# 8 values, in fp16) 2 x 8 + a 4-byte scale + 24 int8 codes
VALUE_BYTES_PER_TILE = {"bf16": 32 * 2, "fp8_e4m3": 4 + 32, "mixed": 2 * 8 + 4 + 24}
# bits per tile of the 32 positions: Elias-Fano by default (L = floor(log2(4096 / 32)) = 7: 32 x 7 low bits and a unary
# part of 32 + (4095 >> 7) + 1 = 64), 12 each under "mixed" (its values go strongest first, so "auto" keeps the fixed width)
POSITION_BITS_PER_TILE = {"bf16": 32 * 7 + 64, "fp8_e4m3": 32 * 7 + 64, "mixed": 32 * 12}


@pytest.mark.parametrize("value_format", sorted(VALUE_BYTES_PER_TILE))
def test_ledger_equals_bytes_handed_to_collectives_and_the_formula(tmp_path: Path, value_format: str) -> None:
    config = {"topk": 32, "dense_below": 100, "value_format": value_format}
    ranks = run_workers(_count_collective_bytes, 2, tmp_path, 3, config)
    # closed form: 2-D tensors in 64x64 tiles, k=32, the positions + the values; bias: bf16 all-reduce (dense_format)
    n_2d = 128 * 192 + 64 * 64
    topk_payload = n_2d // 4096 * (POSITION_BITS_PER_TILE[value_format] // 8 + VALUE_BYTES_PER_TILE[value_format])
    dense_payload = 50 * 2
    coding = "packed" if value_format == "mixed" else "elias_fano"
    assert topk_payload == segment_nbytes(n_2d // 4096, 32, 4096, value_format, True, position_format=coding)
    for r in ranks:
        assert r["ledger_payload"] == r["handed"]  # every byte handed to a collective is in the ledger
        last = r["last"]
        assert last.payload_bytes == topk_payload + dense_payload
        assert last.sent_bytes == (2 - 1) * topk_payload + 2 * (2 - 1) / 2 * dense_payload
        assert last.ddp_bytes == 2 * (2 - 1) / 2 * 4 * (n_2d + 50)
        assert last.ratio_vs_ddp == pytest.approx(last.ddp_bytes / last.sent_bytes)


# ---------------------------------------------------------------- issue 13 regressions
MEAN_CONFIGS = {
    "topk-fp32": {"topk": 16, "dense_below": 100, "value_format": "fp32"},
    "topk-sign": {"topk": 16, "dense_below": 100, "value_format": "sign"},
    "topk-int8": {"topk": 16, "dense_below": 100, "value_format": "int8"},
    "lowpass-bf16": {"topk": 16, "dense_below": 100, "selection": "lowpass", "value_format": "bf16"},
}


def _mean_of_what_was_sent(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """Different inputs on every rank (several shapes, dense and compressed), through CompressedMean."""
    from demo_lightning.algorithms import CodecConfig, CompressedMean

    gen = torch.Generator().manual_seed(10 + rank)
    inputs = [torch.randn(128, 192, generator=gen), torch.randn(70, 33, generator=gen), torch.randn(50, generator=gen), torch.randn(3, 4, 5, 6, generator=gen)]
    out = {}
    for name in names:
        means, sent = CompressedMean(CodecConfig(**MEAN_CONFIGS[name]), Communicator())(inputs, "test")
        out[name] = {"means": means, "sent": sent}
    return out


def test_three_ranks_decode_every_ranks_contribution_to_the_fp64_mean_of_what_each_sent(tmp_path: Path) -> None:
    names = sorted(MEAN_CONFIGS)
    ranks = run_workers(_mean_of_what_was_sent, 3, tmp_path, names)
    for name in names:
        for i in range(4):
            oracle = sum(r[name]["sent"][i].double() for r in ranks) / 3
            assert not torch.equal(ranks[0][name]["sent"][i], ranks[1][name]["sent"][i])  # the ranks sent different things
            # the low-pass bf16 values, and the 50-vector under dense_below (dense_format bf16), are summed in bf16 by
            # the all-reduce: each partial sum rounds to 8 bits
            in_bf16 = name.endswith("bf16") or i == 2
            rtol, atol = (1e-5, 1e-6) if not in_bf16 else (2 * 2**-8, 2 * 2**-8 * float(oracle.abs().max()))
            for r in ranks:
                assert torch.equal(r[name]["means"][i], ranks[0][name]["means"][i])  # bitwise the same everywhere
                torch.testing.assert_close(r[name]["means"][i].double(), oracle, rtol=rtol, atol=atol, msg=f"{name} tensor {i}")


def _settings_diverge(rank: int, world: int, via: str) -> str:
    from demo_lightning.algorithms import TensorSettings
    from demo_lightning.algorithms.guard import gather_nonfinite

    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    exchange = DeMoExchange(opt, DeMoConfig.of(topk=8, dense_below=100), Communicator())
    try:
        for step in range(4):
            if step == 2 and rank == 1:
                exchange.set_tensor_settings(model.a.weight, TensorSettings(topk=4))  # on one rank only
            opt.zero_grad()
            model(torch.randn(8, 64), branch=False).backward()
            if via == "guard":  # as the strategies do: the digest travels in the guard's all-gather
                flags = gather_nonfinite(list(model.parameters()), None, exchange.comm, digest=exchange.plan_digest())
                if not flags.digests_agree:
                    exchange.check_plan()
                exchange.step(plan_agreed=True)
            else:
                exchange.step()
            opt.step()
    except RuntimeError as error:
        return f"step {step}: {error}"
    return "no error"


@pytest.mark.parametrize("via", ["exchange", "guard"])
def test_settings_changed_on_one_rank_raise_the_same_error_on_every_rank(tmp_path: Path, via: str) -> None:
    ranks = run_workers(_settings_diverge, 2, tmp_path, via, timeout=120, collective_timeout=30)
    for message in ranks:
        assert message.startswith("step 2: ") and "per-tensor codec settings" in message and "differs between rank 0 and rank(s) [1]" in message, message


def _ddp_bytes_by_dtype(rank: int, world: int) -> dict[str, float]:
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(128, 64).to(dtype)), nn.Parameter(torch.randn(40).to(dtype))]
        exchange = DeMoExchange(torch.optim.SGD(params, lr=0.1), DeMoConfig.of(topk=8, dense_below=100), Communicator())
        for p in params:
            p.grad = torch.randn_like(p)
        out[str(dtype)] = exchange.step().traffic.ddp_bytes
    return out


def test_ddp_baseline_counts_each_gradient_in_its_own_dtype(tmp_path: Path) -> None:
    n = 128 * 64 + 40
    for r in run_workers(_ddp_bytes_by_dtype, 2, tmp_path):
        assert r["torch.float32"] == 2 * (2 - 1) / 2 * 4 * n
        assert r["torch.bfloat16"] == r["torch.float16"] == 2 * (2 - 1) / 2 * 2 * n


def _codec_differs(rank: int, world: int, setting: str) -> str:
    """Rank 1 was given another global codec setting (a value format or transform of the same size on
    some tensors): without the check the collectives could even match in size while the receivers
    decode the bytes wrongly."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # the same bytes on both ranks: fp8 e4m3 against e5m2, or the DCT against Haar wavelets
    differs = {"fp8": ("value_format", ("fp8_e4m3", "fp8_e5m2")), "transform": ("transform", ("dct", "haar"))}
    name, values = differs[setting]
    options = {"topk": 8, "dense_below": 100, name: values[rank]}
    exchange = DeMoExchange(opt, DeMoConfig.of(**options), Communicator())
    try:
        opt.zero_grad()
        model(torch.randn(8, 64), branch=False).backward()
        exchange.step()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("setting", ["fp8", "transform"])
def test_a_codec_setting_that_differs_between_ranks_raises_on_every_rank_before_any_data_moves(tmp_path: Path, setting: str) -> None:
    ranks = run_workers(_codec_differs, 2, tmp_path, setting, timeout=120, collective_timeout=30)
    for message in ranks:
        assert "differs between rank 0 and rank(s) [1]" in message and "the codec's settings" in message, message
