"""Position groups (``position_group_size``, seed 000 §7): tensors of one shape share their top-k positions.

Oracle (scipy's orthonormal DCT-II and numpy, not our transform or selection): at every step each
worker's spectrum of tensor ``m`` is ``M_m = decay * R_m + DCT(g_m)`` tile by tile; the tensors of one
shape are cut, in order, into groups of ``G``; per group and tile index the worker keeps the ``k``
positions of largest ``sum_m |M_m|^2`` and zeroes them in every member's residual (fp32 values go
out exactly); the shared update of each tensor is ``IDCT(mean over workers of its values at its
worker's positions)``. Bytes: the group's first tensor sends positions and values, the others values
only, so the ledger's all-gather equals ``(W - 1)`` times that payload.
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

from demo_lightning.algorithms import CodecConfig, DeMoConfig, DeMoExchange
from demo_lightning.algorithms.stages import build_plan
from demo_lightning.codec import index_bits, pack_segment, pack_segments, unpack_segments
from demo_lightning.comm import Communicator

from exchange_inputs import unclipped_of

from dist_helpers import run_workers

pytestmark = pytest.mark.timeout(240)
K, DECAY, STEPS, G, TILE = 6, 0.9, 3, 2, 32
# A (2 tiles) x3, B (1 tile) x2 interleaved as consecutive blocks would be, and a small dense tensor
SHAPES = [(32, 64), (32, 32), (32, 64), (32, 32), (32, 64), (10,)]
GROUPS = [[0, 2], [4], [1, 3]]  # per shape, in order, G at a time
LEADER = {0: 0, 2: 0, 4: 4, 1: 1, 3: 1}


def _config(group: int, value_format: str = "fp32") -> DeMoConfig:
    return unclipped_of(chunk=TILE, topk=K, value_format=value_format, dense_below=64, decay=DECAY, update="raw",
                         position_group_size=group, dense_format="fp32",  # the hand counts: the dense tensor in fp32,
                         position_format="packed")  # fixed-width positions (with Elias-Fano: tests/test_position_format.py)


def _run(rank: int, world: int, group: int, value_format: str) -> dict[str, Any]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    exchange = DeMoExchange(torch.optim.SGD(params, lr=0.0), _config(group, value_format), Communicator())
    out: dict[str, list] = {"grads": [], "residuals": [], "updates": []}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        out["grads"].append(grads)
        exchange.step()
        out["updates"].append([p.grad.clone() for p in params])
        out["residuals"].append([exchange.momentum(p).clone() for p in params])
    out["sent"] = exchange.comm.ledger.last_step.sent_bytes  # type: ignore[union-attr]
    return out


def _tiles(x: np.ndarray) -> list[tuple[slice, slice]]:
    return [(slice(0, TILE), slice(c, c + TILE)) for c in range(0, x.shape[1], TILE)]


def _spectrum(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for t in _tiles(x):
        out[t] = dctn(x[t], norm="ortho")
    return out


def _inverse(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for t in _tiles(x):
        out[t] = idctn(x[t], norm="ortho")
    return out


def _payload_bytes(group_size: int) -> int:
    """One worker's bytes per step by hand: per compressed tensor a fp32 value per kept coefficient,
    plus its bit-packed positions unless a group's earlier member sends them; the dense tensor in fp32
    goes by an all-reduce (not in this count)."""
    bits = index_bits(TILE * TILE)
    total = 0
    for i, shape in enumerate(SHAPES[:-1]):
        n_tiles = shape[1] // TILE
        carrier = group_size == 1 or LEADER[i] == i
        total += n_tiles * K * 4 + (math.ceil(n_tiles * K * bits / 8) if carrier else 0)
    return total


@pytest.fixture(scope="module")
def three_workers(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(_run, 3, tmp_path_factory.mktemp("groups"), G, "fp32")


def test_three_workers_follow_the_summed_energy_oracle(three_workers: list[dict[str, Any]]) -> None:
    ranks, world = three_workers, 3
    compressed = range(len(SHAPES) - 1)
    residual = [[np.zeros(s) for s in SHAPES[:-1]] for _ in range(world)]
    for step in range(STEPS):
        spectra = [[DECAY * residual[r][i] + _spectrum(ranks[r]["grads"][step][i].double().numpy()) for i in compressed]
                   for r in range(world)]
        mean = [np.zeros(s) for s in SHAPES[:-1]]
        for r in range(world):
            for members in GROUPS:
                for t in _tiles(spectra[r][members[0]]):
                    energy = sum(spectra[r][m][t] ** 2 for m in members).reshape(-1)
                    mask = np.zeros(TILE * TILE, dtype=bool)
                    mask[np.argsort(-energy, kind="stable")[:K]] = True
                    mask = mask.reshape(TILE, TILE)
                    for m in members:
                        mean[m][t] += np.where(mask, spectra[r][m][t], 0.0) / world
                        spectra[r][m][t] = np.where(mask, 0.0, spectra[r][m][t])
        for r in range(world):
            residual[r] = spectra[r]
            for i in compressed:
                got = ranks[r]["residuals"][step][i].double().numpy()
                np.testing.assert_allclose(got, _inverse(spectra[r][i]), rtol=1e-4, atol=1e-5,
                                           err_msg=f"step {step} rank {r} tensor {i}: residual (parameter space)")
                np.testing.assert_allclose(ranks[r]["updates"][step][i].double().numpy(), _inverse(mean[i]), rtol=1e-4,
                                           atol=1e-5, err_msg=f"step {step} rank {r} tensor {i}: update")
                assert torch.equal(ranks[r]["updates"][step][i], ranks[0]["updates"][step][i])  # bitwise everywhere
    dense = 2 * (world - 1) / world * 4 * 10  # ring all-reduce of the fp32 dense tensor
    for r in range(world):
        assert ranks[r]["sent"] == pytest.approx((world - 1) * _payload_bytes(G) + dense)
    bits = index_bits(TILE * TILE)  # the followers: tensor 2 (two tiles) and tensor 3 (one tile) send no positions
    assert _payload_bytes(1) - _payload_bytes(G) == math.ceil(2 * K * bits / 8) + math.ceil(K * bits / 8)


def test_members_of_a_group_share_their_workers_positions(tmp_path: Path) -> None:
    """In coefficient space the residual is zero exactly where the worker sent: the same positions
    for every member of a group, not the same across groups or workers."""
    ranks = run_workers(_run_spectra, 2, tmp_path)
    for r, spectra in enumerate(ranks):
        for members in GROUPS:
            zeros = [spectra[m] == 0 for m in members]
            for z in zeros[1:]:
                assert torch.equal(z, zeros[0]), (r, members)
            assert int(zeros[0].sum()) == K * (SHAPES[members[0]][1] // TILE)
        assert not torch.equal(spectra[0] == 0, spectra[4] == 0)  # a group of its own chose its own
    assert not torch.equal(ranks[0][0] == 0, ranks[1][0] == 0)  # each worker chooses from its own momentum


def _run_spectra(rank: int, world: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    exchange = DeMoExchange(torch.optim.SGD(params, lr=0.0), _config(G), Communicator())
    gen = torch.Generator().manual_seed(7 + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    exchange.step()
    return [s.clone() for s in exchange.averaged_state().values()][: len(SHAPES) - 1]


@pytest.mark.parametrize("value_format", ["sign", "int8", "mixed"])
def test_ledger_counts_the_positions_once_per_group(tmp_path: Path, value_format: str) -> None:
    """The all-gather's bytes equal the hand count; a group of two saves its second member's positions."""
    grouped = run_workers(_run, 2, tmp_path / "g", G, value_format)
    alone = run_workers(_run, 2, tmp_path / "a", 1, value_format)
    plan_g = build_plan(_config(G, value_format).codec, [torch.empty(s) for s in SHAPES])
    plan_1 = build_plan(_config(1, value_format).codec, [torch.empty(s) for s in SHAPES])
    saved = sum(math.ceil(SHAPES[i][1] // TILE * K * index_bits(TILE * TILE) / 8) for i in (2, 3))  # followers' positions
    payload_1 = sum(run.nbytes for bucket in plan_1.buckets for run in bucket)
    payload_g = sum(run.nbytes for bucket in plan_g.buckets for run in bucket)
    assert payload_1 - payload_g == saved
    dense = 2 * (2 - 1) / 2 * 4 * 10  # ring all-reduce of the fp32 dense tensor (the exchange alone: no guard)
    for r in range(2):
        assert grouped[r]["sent"] == pytest.approx((2 - 1) * payload_g + dense)
        assert alone[r]["sent"] == pytest.approx((2 - 1) * payload_1 + dense)


def test_pack_segments_leaves_out_the_positions_of_segments_that_share() -> None:
    """Byte for byte the concatenation of the segments packed one by one, each with or without its positions."""
    gen = torch.Generator().manual_seed(3)
    tiles, flags, numel, k = (2, 1, 3, 2), (True, False, True, False), 64, 5
    values = torch.randn(sum(tiles), k, generator=gen)
    positions = torch.randint(0, numel, (sum(tiles), k), generator=gen)
    for value_format in ("fp32", "bf16", "int8", "fp8_e4m3", "mixed", "sign"):
        rows = np.cumsum((0,) + tiles)
        carried = torch.cat([positions[rows[i] : rows[i + 1]] for i in range(len(tiles)) if flags[i]])
        buf, decoded = pack_segments(carried, values, tiles, numel, value_format, positioned=flags)
        one_by_one = [pack_segment(positions[rows[i] : rows[i + 1]] if flags[i] else None, values[rows[i] : rows[i + 1]], numel,
                                   value_format)[0] for i in range(len(tiles))]
        assert torch.equal(buf, torch.cat(one_by_one)), value_format
        got_positions, got_values = unpack_segments(buf, tiles, k, numel, value_format, flags)
        assert torch.equal(got_positions, carried) and torch.equal(got_values, decoded), value_format
    with pytest.raises(ValueError, match="one per segment"):
        unpack_segments(buf, tiles, k, numel, "sign", (True, False))


def test_group_size_one_is_the_plain_exchange_bitwise() -> None:
    def run(config: DeMoConfig) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
        exchange = DeMoExchange(torch.optim.SGD(params, lr=0.0), config)
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            exchange.step()
        return [p.grad for p in params]

    plain = unclipped_of(chunk=TILE, topk=K, value_format="fp32", dense_below=64, decay=DECAY, update="raw", dense_format="fp32")
    for a, b in zip(run(plain), run(_config(1))):
        assert torch.equal(a, b)
    # and a group changes what is sent (the negative control)
    assert not all(torch.equal(a, b) for a, b in zip(run(plain), run(_config(G))))


def test_groups_stay_inside_a_run_and_the_plan_digest_names_the_setting() -> None:
    config = CodecConfig(chunk=TILE, topk=K, dense_below=64, position_group_size=3)
    alone = CodecConfig(chunk=TILE, topk=K, dense_below=64).payload_bytes((32, 64))
    plan = build_plan(CodecConfig(chunk=TILE, topk=K, dense_below=64, position_group_size=3, bucket_cap_mb=2.5 * alone / 2**20),
                      [torch.empty(32, 64) for _ in range(5)])
    for bucket in plan.buckets:
        for run in bucket:
            members = set(id(m) for m in run.members)
            assert run.members[0].shares_with is None  # every run starts a group of its own
            assert all(m.shares_with is None or id(m.shares_with) in members for m in run.members)
    assert len(plan.buckets) > 1  # the small cap split them
    assert len(build_plan(config, [torch.empty(32, 64) for _ in range(5)]).buckets) == 1
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(32, 64))]
    digests = {g: DeMoExchange(torch.optim.SGD(params, lr=0.1), _config(g)).plan_digest() for g in (1, 2)}
    assert digests[1] != digests[2]  # ranks with different group sizes fail the per-step plan check
    named = []
    for name in ("blocks.0.fc.weight", "head.weight"):  # the same tensors, named differently on two ranks
        exchange = DeMoExchange(torch.optim.SGD(params, lr=0.1), _config(2))
        exchange.set_parameter_names({params[0]: name})
        named.append(exchange.plan_digest())
    assert named[0] != named[1] != digests[2]  # the roles decide the wire layout, so they are in the digest


def test_on_the_bundled_gpt_groups_join_the_same_projection_of_consecutive_blocks() -> None:
    """With the module's names, a group is one projection across blocks (``blocks.#.qkv.weight``), never the
    position embedding with the attention output projection, which have the same shape; in groups of 2 a
    4-block model sends each projection's positions twice per step instead of four times."""
    from demo_lightning.algorithms.stages import block_role
    from demo_lightning.models import GPTLightningModule

    assert block_role("model.blocks.12.attn.qkv.weight") == "model.blocks.#.attn.qkv.weight"
    assert block_role("0.weight") == "#.weight" and block_role("layer10x.w3") == "layer10x.w3"
    module = GPTLightningModule(block_size=64, d_model=64, n_layer=4, n_head=2, optimizer="sgd")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    exchange = DeMoExchange(optimizer, unclipped_of(chunk=TILE, position_group_size=2, update="raw"))
    names = {p: n for n, p in module.named_parameters()}
    exchange.set_parameter_names(names)
    params = exchange.parameters()
    for p in params:
        p.grad = torch.randn_like(p)
    exchange.step()
    plan = exchange._momentum.plan  # the plan the step ran on
    assert plan is not None
    groups: dict[str, list[str]] = {}
    for item in plan.tensors:
        if not item.dense:
            leader = item.shares_with or item
            groups.setdefault(names[params[leader.position]], []).append(names[params[item.position]])
    for leader, members in groups.items():
        assert len({block_role(m) for m in members}) == 1, members  # one role per group
        assert len(members) <= 2
    by_role = {block_role(m) for members in groups.values() for m in members if ".blocks." in m}
    assert all(sum(1 for ms in groups.values() if block_role(ms[0]) == role) == 2 for role in by_role)  # 4 blocks / 2
    pos = next(n for n in names.values() if "pos" in n)
    assert groups.get(pos) == [pos]  # the position embedding shares with nobody
    # without the names, shape alone decides, and the same-shape tensors of different roles do group
    unnamed = DeMoExchange(torch.optim.SGD(module.parameters(), lr=0.1), unclipped_of(chunk=TILE, position_group_size=2, update="raw"))
    unnamed.step()
    assert unnamed._momentum.plan is not None
    mixed = [item for item in unnamed._momentum.plan.tensors if item.shares_with is not None
             and block_role(names[params[item.position]]) != block_role(names[params[item.shares_with.position]])]
    assert mixed


def test_groups_form_when_a_blocks_tensors_keep_different_k() -> None:
    """Per-kind keep ratios (a LayerPolicy preset) put a block's projections in different families; each
    family's tensors of a bucket still make one run, so the same projection of the two blocks groups."""
    from demo_lightning.algorithms.config import TensorCodec

    shapes = [(192, 64), (64, 64), (256, 64), (64, 256)] * 2
    ratios = [0.12, 0.08, 0.06, 0.06] * 2
    config = CodecConfig(chunk=64, dense_below=0, dense_vectors=False, position_group_size=2)
    plan = build_plan(config, [torch.empty(s) for s in shapes], [TensorCodec(keep_ratio=r) for r in ratios])
    shared = {(item.position, item.shares_with.position) for item in plan.tensors if item.shares_with is not None}
    assert shared == {(4, 0), (5, 1), (6, 2), (7, 3)}  # block 1's projections use block 0's positions
    for bucket in plan.buckets:
        assert len({id(run.family) for run in bucket}) == len(bucket)  # one run per family and bucket
        for run in bucket:
            assert [m.tile_offset for m in run.members] == sorted(m.tile_offset for m in run.members)
            rows = [r for m in run.members for r in range(m.tile_offset, m.tile_offset + m.n_tiles)]
            assert rows == list(range(run.rows.start, run.rows.stop))  # consecutive rows of the family
