"""The wire format of the tensors sent densely (``dense_format``, issue 18): bf16 by default, the
rounding error kept as the sender's residual momentum; fp32 exact; bytes as the codec, the planner
and the ledger say; every rank decodes the same mean."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange
from demo_lightning.algorithms.compressed_mean import CompressedMean
from demo_lightning.comm import Communicator
from demo_lightning.comm.topology import NodeTopology
from demo_lightning.planning import modeled_collectives

from exchange_inputs import unclipped_of

from dist_helpers import run_workers

pytestmark = pytest.mark.timeout(240)


def test_payload_is_two_bytes_an_element_in_bf16_four_in_fp32() -> None:
    assert CodecConfig().dense_format == "bf16"
    assert CodecConfig().payload_bytes((300,)) == 600
    assert CodecConfig(dense_format="fp32").payload_bytes((300,)) == 1200
    assert CodecConfig(dense_format="fp32").dense_dtype(torch.float64) == torch.float64
    assert CodecConfig().dense_dtype(torch.float64) == torch.bfloat16
    shapes = [(300,), (64, 64)]
    for fmt, width in (("bf16", 2), ("fp32", 4)):
        dense = [r for r in modeled_collectives(shapes, NodeTopology(2, 2), "flat", CodecConfig(dense_format=fmt)) if r.tag == "demo/dense"]
        assert [r.payload_bytes for r in dense] == [300 * width]


def test_bad_dense_format_names_the_argument() -> None:
    with pytest.raises(ValueError, match="dense_format"):
        CodecConfig(dense_format="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dense_format"):
        DeMoConfig.of(dense_format="int8")


def test_bf16_sends_the_rounded_momentum_and_keeps_the_rest_as_residual() -> None:
    """Oracle, one worker: ``m <- decay * r + g``, ``q = bf16(m)``, ``r <- m - q``, in float64 by hand."""
    bias = nn.Parameter(torch.zeros(300, dtype=torch.float64))
    ex = DeMoExchange(torch.optim.SGD([bias], lr=1.0), unclipped_of(update="raw", decay=0.9), Communicator())
    gen = torch.Generator().manual_seed(0)
    residual = torch.zeros(300, dtype=torch.float64)
    for _ in range(4):
        g = torch.randn(300, generator=gen, dtype=torch.float64)
        bias.grad = g.clone()
        stats = ex.step()
        m = 0.9 * residual + g
        q = m.to(torch.bfloat16).to(torch.float64)
        residual = m - q
        assert torch.equal(bias.grad, q)
        assert torch.equal(ex.momentum(bias), residual)
        assert residual.abs().max() > 0 and (residual.abs() <= m.abs() * 2**-8).all()  # half a bf16 spacing at most
        assert stats.payload_bytes == 600


def test_compressed_mean_returns_what_bf16_sent_for_the_callers_error_feedback() -> None:
    x = torch.randn(300)
    mean, sent = CompressedMean(CodecConfig(), Communicator())([x], "test")
    assert torch.equal(sent[0], x.to(torch.bfloat16).float()) and torch.equal(mean[0], sent[0])
    mean, sent = CompressedMean(CodecConfig(dense_format="fp32"), Communicator())([x], "test")
    assert torch.equal(sent[0], x) and torch.equal(mean[0], x)


def _dense_steps(rank: int, world: int, fmt: str) -> dict[str, Any]:
    bias = nn.Parameter(torch.zeros(500))
    ex = DeMoExchange(torch.optim.SGD([bias], lr=1.0), unclipped_of(update="raw", dense_format=fmt), Communicator())
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {"sent": [], "grad": [], "momentum": [], "g": []}
    for _ in range(2):
        g = torch.randn(500, generator=gen)
        bias.grad = g.clone()
        ex.step()
        out["g"].append(g)
        out["grad"].append(bias.grad.clone())
        out["momentum"].append(ex.momentum(bias))
        out["sent"].append(ex.comm.ledger.last_step.sent_bytes)
    return out


def test_two_gloo_workers_decode_the_mean_of_the_rounded_momenta(tmp_path: Path) -> None:
    ranks = run_workers(_dense_steps, 2, tmp_path, "bf16")
    exact = run_workers(_dense_steps, 2, tmp_path / "fp32", "fp32")
    assert [r["sent"] for r in ranks] == [[1000.0, 1000.0]] * 2  # ring all-reduce of 1,000 bytes over 2 ranks
    assert [r["sent"] for r in exact] == [[2000.0, 2000.0]] * 2
    # step 1 by hand: each worker's m = g rounded to bf16, their sum rounded once more, then / 2
    a, b = (r["g"][0] for r in ranks)
    want = (a.to(torch.bfloat16) + b.to(torch.bfloat16)).float() / 2
    assert torch.equal(ranks[0]["grad"][0], want) and torch.equal(ranks[1]["grad"][0], want)
    for r in ranks:
        assert torch.equal(r["momentum"][0], r["g"][0] - r["g"][0].to(torch.bfloat16).float())
    assert torch.equal(ranks[0]["grad"][1], ranks[1]["grad"][1])
    torch.testing.assert_close(exact[0]["grad"][0], (a + b) / 2)
