"""``position_format="elias_fano"``: each tile's top-k positions sorted and Elias-Fano coded.

Oracles: a code worked out by hand; the information-theoretic minimum ``log2 C(n, k)`` (the code
stays within two bits a position of it); the fixed-width packing (``"packed"``), which the same
training must match bit for bit, on the bytes the formula says.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange
from demo_lightning.codec import (
    VALUE_FORMATS,
    elias_fano_bits,
    elias_fano_decode,
    elias_fano_encode,
    index_bits,
    pack_segments,
    position_bits,
    position_coding,
    segment_nbytes,
    unpack_segments,
)
from demo_lightning.comm import Communicator
from demo_lightning.strategies import DeMoStrategy

from dist_helpers import run_workers

pytestmark = pytest.mark.timeout(240)


def _sorted_rows(rows: int, k: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=gen)[:k].sort().values for _ in range(rows)])


def test_a_code_worked_out_by_hand() -> None:
    # n 16, k 4: L = floor(log2(16 / 4)) = 2; low parts 1, 1, 2, 3 (two bits each, least significant first);
    # high parts 0, 1, 1, 3 -> set bits 0, 2, 3, 6 of an upper vector of 4 + (15 >> 2) + 1 = 8 bits
    bits = elias_fano_encode(torch.tensor([[1, 5, 6, 15]]), 16)
    assert bits.tolist() == [[1, 0, 1, 0, 0, 1, 1, 1] + [1, 0, 1, 1, 0, 0, 1, 0]]
    assert elias_fano_bits(4, 16) == 16 and elias_fano_decode(bits, 4, 16).tolist() == [[1, 5, 6, 15]]


@pytest.mark.parametrize(("k", "n"), [(32, 4096), (64, 4096), (256, 4096), (4096, 4096), (3, 3072), (7, 10), (1, 1), (5, 9)])
def test_the_code_round_trips_within_two_bits_a_position_of_the_minimum(k: int, n: int) -> None:
    rows = _sorted_rows(40, k, n, seed=k + n)
    edges = torch.stack([torch.arange(k), torch.arange(n - k, n)])  # the first and the last k positions
    for positions in (rows, edges):
        bits = elias_fano_encode(positions, n)
        assert bits.shape == (positions.shape[0], elias_fano_bits(k, n)) and set(bits.unique().tolist()) <= {0, 1}
        assert torch.equal(elias_fano_decode(bits, k, n), positions)
    assert elias_fano_bits(k, n) <= math.log2(math.comb(n, k)) + 2 * k + 1


def test_the_bits_a_tile_and_the_fixed_width_where_that_is_smaller() -> None:
    # a 64 x 64 tile: 9, 8 and 6 bits a position at k 32, 64 and 256, against 12
    assert [position_bits(k, 4096, "elias_fano") for k in (32, 64, 256)] == [32 * 9, 64 * 8, 256 * 6]
    assert [position_bits(k, 4096) for k in (32, 64, 256)] == [32 * 12, 64 * 12, 256 * 12]
    assert elias_fano_bits(1, 4096) == 14 > index_bits(4096)  # one position: the fixed width is kept
    assert position_coding(1, 4096, "elias_fano") == "packed" and position_bits(1, 4096, "elias_fano") == 12
    with pytest.raises(ValueError, match="position_format must be one of"):
        position_bits(4, 16, "gamma")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must lie in"):
        elias_fano_bits(17, 16)


def _dense(positions: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """Each row's values at its positions in a zeroed tile: what a receiver decodes, whatever their order."""
    return torch.zeros(positions.shape[0], n).scatter_(1, positions, values)


@pytest.mark.parametrize("value_format", [f for f in VALUE_FORMATS if f != "mixed"])
@pytest.mark.parametrize(("k", "n"), [(32, 4096), (3, 3072), (1, 4096)])
def test_segments_round_trip_on_the_bytes_the_formula_says(value_format: str, k: int, n: int) -> None:
    """Positions in the selection's order (not sorted) go sorted, each value beside its own; the scales
    and the decoded values the sender keeps are the fixed width's, bit for bit."""
    tiles = (3, 5, 2)
    gen = torch.Generator().manual_seed(k)
    positions = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(sum(tiles))])  # unsorted
    values = torch.randn(sum(tiles), k, generator=gen)
    coded = position_coding(k, n, "elias_fano") == "elias_fano"  # k 3 of 3,072 and k 1: the fixed width is not larger
    received = positions.sort(dim=1).values if coded else positions  # each row's positions as they arrive
    for flags in (None, (True, False, True)):  # position groups: the middle segment carries none
        carried = positions if flags is None else torch.cat([positions[:3], positions[8:]])
        wire_order = None if flags is None else positions.argsort(dim=1)  # the member rows: here their own order
        packed, decoded = pack_segments(carried, values, tiles, n, value_format, positioned=flags)
        buf, decoded_ef = pack_segments(carried, values, tiles, n, value_format, positioned=flags, position_format="elias_fano",
                                        wire_order=wire_order)
        assert torch.equal(decoded_ef, decoded)  # the sender's error feedback: unchanged
        marks = flags or (True,) * len(tiles)
        assert buf.numel() == sum(segment_nbytes(t, k, n, value_format, f, position_format="elias_fano") for t, f in zip(tiles, marks))
        got_positions, got_values = unpack_segments(buf, tiles, k, n, value_format, list(marks), position_format="elias_fano")
        assert torch.equal(got_positions, received if flags is None else torch.cat([received[:3], received[8:]]))
        assert torch.equal(_dense(received, got_values, n), _dense(positions, decoded, n))  # every value beside its position
        if coded:
            assert buf.numel() < packed.numel()
        else:
            assert torch.equal(buf, packed)
    if coded:
        with pytest.raises(ValueError, match="need wire_order"):
            pack_segments(torch.cat([positions[:3], positions[8:]]), values, tiles, n, value_format, positioned=(True, False, True),
                          position_format="elias_fano")


@pytest.mark.parametrize(("settings", "message"), [
    ({"position_format": "gamma"}, "position_format must be one of"),
    ({"position_format": "elias_fano", "selection": "lowpass"}, "selection='lowpass' sends no positions"),
    ({"position_format": "elias_fano", "selection": "shared", "value_format": "bf16"}, "broadcast bit-packed"),
    ({"position_format": "elias_fano", "value_format": "mixed"}, "strongest first"),
])
def test_bad_settings_name_the_argument_and_the_fix(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CodecConfig(**settings)
    with pytest.raises(ValueError, match="position_format"):
        DeMoStrategy(**settings)


def test_the_payload_counts_the_coded_positions() -> None:
    # a 256 x 256 weight: 16 tiles; sign values: k bits and a 4-byte scale a tile
    packed, coded = CodecConfig(topk=32, position_format="packed"), CodecConfig(topk=32, position_format="elias_fano")
    assert packed.payload_bytes((256, 256)) == 16 * (32 * 12 + 32 + 32) // 8
    assert coded.payload_bytes((256, 256)) == 16 * (32 * 9 + 32 + 32) // 8


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(128, 256, bias=False), nn.Linear(128, 256, bias=False)  # 8 tiles of 64 x 64 each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(x)


def _dense(positions: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """Each row's values at its positions in a zeroed tile: what a receiver decodes, whatever their order."""
    return torch.zeros(positions.shape[0], n).scatter_(1, positions, values)


def _steps(rank: int, world: int, settings: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _TwoBlocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ex = DeMoExchange(opt, DeMoConfig.of(**settings), Communicator())
    gen = torch.Generator().manual_seed(rank)
    sent = []
    for _ in range(steps):
        model(torch.randn(4, 128, generator=gen)).pow(2).sum().backward()
        ex.step()
        opt.step()
        opt.zero_grad()
        sent.append(ex.comm.ledger.last_step.sent_bytes)
    return {"sent": sent, "weights": [p.detach().clone() for p in model.parameters()],
            "momenta": list(ex.state_dict()["momentum"]["momenta"].values())}


def _same(a: Any, b: Any) -> bool:
    """Equal, tensors bit for bit, through nested dicts."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("settings", [{"early_steps": 2}, {"topk": 32, "position_group_size": 2}])
def test_three_gloo_workers_train_the_same_on_fewer_bytes(tmp_path: Path, settings: dict[str, Any]) -> None:
    """The coding is lossless and leaves the training alone: every replica ends on the weights and
    residuals of ``"packed"`` bit for bit (sign values: the per-tile scales are computed in the
    selection's order either way), and each step's all-gather is smaller by the formula's difference
    (the default: 256 a tile for 2 exchanges, then the 3-worker k of 42; position groups: the second
    block sends values only)."""
    packed = run_workers(_steps, 3, tmp_path / "packed", {**settings, "position_format": "packed"})
    coded = run_workers(_steps, 3, tmp_path / "coded", settings)  # the default, "auto": Elias-Fano here
    groups = settings.get("position_group_size", 1)
    ks = [settings["topk"]] * 4 if "topk" in settings else [256, 256, 42, 42]
    for p, c in zip(packed, coded):
        assert all(torch.equal(got, want) for got, want in zip(c["weights"], p["weights"]))
        assert len(c["momenta"]) == 2 and all(_same(got, want) for got, want in zip(c["momenta"], p["momenta"]))
        saved = [2 * 8 * (position_bits(k, 4096) - position_bits(k, 4096, "elias_fano")) // 8 // groups for k in ks]
        assert [a - b for a, b in zip(p["sent"], c["sent"])] == [2 * s for s in saved]  # the all-gather: 2 peers' payloads
        assert all(s > 0 for s in saved)
    assert all(torch.equal(r["weights"][0], coded[0]["weights"][0]) for r in coded)
    assert not torch.equal(packed[0]["weights"][0], run_workers(_steps, 3, tmp_path / "other", {**settings, "decay": 0.9})[0]["weights"][0])


@pytest.mark.parametrize(("settings", "coding"), [
    ({}, "elias_fano"),
    ({"value_format": "fp32"}, "elias_fano"),
    ({"position_group_size": 2}, "elias_fano"),
    ({"value_format": "mixed"}, "packed"),
    ({"selection": "lowpass"}, "packed"),
    ({"selection": "shared", "value_format": "bf16"}, "packed"),
    ({"position_format": "packed"}, "packed"),
    ({"position_format": "elias_fano", "value_format": "int8"}, "elias_fano"),
])
def test_auto_is_elias_fano_wherever_it_applies(settings: dict[str, Any], coding: str) -> None:
    """The default, ``"auto"``, resolves when the config is made: Elias-Fano where each worker sends its
    own positions in any order (``"topk"``, values other than ``"mixed"``), the fixed width elsewhere
    (where an explicit ``"elias_fano"`` is refused); an explicit coding stays as given. The strategies
    and ``demo-lightning plan`` take the same setting."""
    assert CodecConfig(**settings).position_format == coding
    assert CodecConfig(**settings).payload_bytes((256, 256)) == CodecConfig(**{**settings, "position_format": coding}).payload_bytes((256, 256))
    assert DeMoStrategy(**settings).demo_config.codec.position_format == coding


def test_des_locs_compressed_parameter_mean_takes_the_coding_too() -> None:
    """``DesLocStrategy(compress_params=True, position_format="elias_fano")``'s codec: the same mean and
    error feedback as ``"packed"`` (fp32 values: bit for bit) on a payload smaller by the formula's difference."""
    from demo_lightning.algorithms.compressed_mean import CompressedMean

    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))  # 8 tiles of 64 x 64
    out = {}
    for position_format in ("packed", "elias_fano"):
        comm = Communicator()
        config = CodecConfig(topk=32, value_format="fp32", dense_below=0, position_format=position_format)  # type: ignore[arg-type]
        (mean,), (sent,) = CompressedMean(config, comm)([x], "t")
        out[position_format] = (mean, sent, comm.ledger.total_payload_bytes)
    assert torch.equal(out["packed"][0], out["elias_fano"][0]) and torch.equal(out["packed"][1], out["elias_fano"][1])
    assert out["packed"][2] - out["elias_fano"][2] == 8 * (32 * 12 - 32 * 9) // 8


def test_the_plan_models_the_coded_positions(capsys: pytest.CaptureFixture[str]) -> None:
    """``demo-lightning plan --position-format elias_fano``: the flat exchange's bytes fall, the shared
    methods' (whose positions are one worker's, broadcast bit-packed) stay."""
    from demo_lightning.cli import plan_main

    rows = {}
    for position_format in ("packed", "elias_fano"):
        plan_main(["--params", "2e6", "--nodes", "2", "--devices-per-node", "2", "--position-format", position_format])
        out = capsys.readouterr().out
        assert ("Elias-Fano positions" in out) == (position_format == "elias_fano")
        rows[position_format] = {line.split()[0]: line.split()[-1] for line in out.splitlines()
                                 if line.split() and line.split()[0] in ("flat", "shared")}
    ratio = {fmt: {m: float(r.rstrip("x")) for m, r in by.items()} for fmt, by in rows.items()}
    assert ratio["elias_fano"]["flat"] > 1.2 * ratio["packed"]["flat"]
    assert ratio["elias_fano"]["shared"] == ratio["packed"]["shared"]
