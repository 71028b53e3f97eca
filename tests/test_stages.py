"""Each stage of the exchange alone: the matrix-layout transform, the plan, encode's selection,
the transports behind one protocol, decode's rank-order sum; and the step participants."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import scipy.fft
import torch

from demo_lightning.algorithms import CodecConfig
from demo_lightning.algorithms.participants import StepContext, run_step
from demo_lightning.algorithms.stages import (
    AllGatherTransport,
    AllReduceTransport,
    Outgoing,
    Workspace,
    accumulate,
    build_plan,
    inverse,
    select,
    transform_into,
    transport_for,
    zeroed_means,
)
from demo_lightning.codec import dct2, plan_tiles, to_tiles
from demo_lightning.codec.transform import accumulate_spectrum, flat_index, inverse_spectrum, tile_origins, tile_view
from demo_lightning.comm import Communicator
from dist_helpers import IdenticalWorkers

SHAPES = [(128, 192), (40, 72), (100,), (7, 3, 3, 3), (), (1, 5)]


# ---------------------------------------------------------------------------------------- transform
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matrix_layout_transform_equals_the_tile_dct_and_inverts(shape: tuple[int, ...]) -> None:
    layout = plan_tiles(shape, 32)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = torch.full((layout.padded_rows, layout.padded_cols), float("nan"), dtype=torch.float64)  # not read at decay 0
    scratch, padded = torch.empty_like(out), torch.zeros_like(out)
    accumulate_spectrum(x, layout, out, 0.0, scratch, padded)
    tiles = tile_view(out, layout).reshape(-1, layout.tile_rows, layout.tile_cols)
    torch.testing.assert_close(tiles, dct2(to_tiles(x, layout)), rtol=0, atol=1e-12)
    # the decay is fused: decay * K + DCT(x)
    again = accumulate_spectrum(x, layout, out.clone(), 0.5, scratch, padded)
    torch.testing.assert_close(again, 1.5 * out, rtol=0, atol=1e-12)
    back = inverse_spectrum(out, layout, torch.empty_like(out), torch.empty_like(out), scale=0.25)
    torch.testing.assert_close(back[: layout.rows, : layout.cols].reshape(shape), 0.25 * x, rtol=0, atol=1e-12)
    # a tile's element (i, j) sits at origin + i * Cp + j
    positions = torch.randint(0, layout.tile_numel, (layout.n_tiles, 3), generator=torch.Generator().manual_seed(1))
    offsets = flat_index(positions, tile_origins(layout), layout.padded_cols, layout.tile_cols)
    torch.testing.assert_close(out.reshape(-1)[offsets], torch.gather(tiles.reshape(layout.n_tiles, -1), 1, positions))


def test_matrix_layout_transform_matches_scipy_on_one_tile() -> None:
    x = np.random.default_rng(0).standard_normal((32, 32))
    layout = plan_tiles((32, 32), 32)
    out = torch.empty(32, 32, dtype=torch.float64)
    accumulate_spectrum(torch.tensor(x), layout, out, 0.0, torch.empty_like(out))
    np.testing.assert_allclose(out.numpy(), scipy.fft.dctn(x, norm="ortho"), atol=1e-12)


# ---------------------------------------------------------------------------------------- plan
def test_plan_groups_families_runs_and_dense_tensors() -> None:
    tensors = [torch.zeros(64, 64), torch.zeros(10), torch.zeros(64, 128), torch.zeros(40, 72), torch.zeros(64, 64, dtype=torch.float64)]
    plan = build_plan(CodecConfig(chunk=32, topk=4, dense_below=100, bucket_cap_mb=1.0), tensors)
    assert [t.dense for t in plan.tensors] == [False, True, False, False, False]
    assert list(plan.dense_groups) == [(torch.float32, torch.device("cpu"))]
    (f32, f64) = plan.families.values()  # the fp64 tensor has its own family
    assert [m.position for m in f32.members] == [0, 2, 3] and [m.position for m in f64.members] == [4]
    assert f32.n_tiles == 4 + 8 + 2 * 3 and f32.numel == 4096 + 8192 + 64 * 96
    # tiles are numbered in the family's storage order; origins point at each tile's first element
    assert f32.origins[4].item() == 4096 and f32.origins[5].item() == 4096 + 32
    assert f32.strides[:4].tolist() == [64] * 4 and f32.strides[-1].item() == 96
    # consecutive members of one family in a bucket form one run
    assert [[len(run.members) for run in bucket] for bucket in plan.buckets] == [[3, 1]]
    assert plan.coefficients == (f32.n_tiles + f64.n_tiles) * 4
    with pytest.raises(ValueError, match="one per tensor"):
        build_plan(CodecConfig(), tensors, [None])


# ---------------------------------------------------------------------------------------- encode
@pytest.mark.parametrize("selection", ["topk", "lowpass"])
def test_select_keeps_the_k_largest_or_lowest_coefficients_of_every_tile(selection: str) -> None:
    x = [torch.randn(64, 96, generator=torch.Generator().manual_seed(2)), torch.randn(40, 72, generator=torch.Generator().manual_seed(3))]
    config = CodecConfig(chunk=32, topk=5, selection=selection, dense_below=0, dense_vectors=False)  # type: ignore[arg-type]
    plan = build_plan(config, x)
    workspace = Workspace(plan)
    (family,) = plan.families.values()
    storage = {family.key: torch.empty(family.numel)}
    transform_into(plan, x, storage, workspace)
    chosen = select(family, storage[family.key], config.selection, workspace.family(family))
    reference = torch.cat([dct2(to_tiles(t, plan_tiles(tuple(t.shape), 32))).reshape(-1, 1024) for t in x])
    torch.testing.assert_close(chosen.values, torch.gather(reference, 1, chosen.positions), rtol=0, atol=1e-5)
    if selection == "topk":
        kth = reference.abs().topk(5, dim=1).values[:, -1:]
        assert bool((chosen.values.abs() >= kth - 1e-5).all())
    else:
        assert torch.equal(chosen.positions.sort(1).values[0], torch.tensor([0, 1, 2, 32, 33]))
    assert torch.equal(storage[family.key].take(chosen.offsets), chosen.values)


# ---------------------------------------------------------------------------------------- transport + decode
@pytest.mark.parametrize("config", [
    CodecConfig(chunk=32, topk=5, value_format="fp32", dense_below=0, dense_vectors=False),
    CodecConfig(chunk=32, topk=5, value_format="sign", dense_below=0, dense_vectors=False),
    CodecConfig(chunk=32, topk=5, selection="lowpass", value_format="bf16", dense_below=0, dense_vectors=False),
    CodecConfig(chunk=32, topk=5, selection="lowpass", value_format="int8", dense_below=0, dense_vectors=False),
    CodecConfig(chunk=32, topk=5, value_format="fp8_e4m3", dense_below=0, dense_vectors=False),
    CodecConfig(chunk=32, topk=6, value_format="mixed", fp16_share=0.5, dense_below=0, dense_vectors=False),
    CodecConfig(chunk=32, topk=5, selection="lowpass", value_format="mixed", dense_below=0, dense_vectors=False),
], ids=["topk-fp32", "topk-sign", "lowpass-allreduce", "lowpass-int8-gather", "topk-fp8", "topk-mixed", "lowpass-mixed"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_transports_share_one_protocol_and_decode_gives_the_mean_of_what_was_sent(config: CodecConfig, world_size: int) -> None:
    x = [torch.randn(64, 96, generator=torch.Generator().manual_seed(4)), torch.randn(40, 72, generator=torch.Generator().manual_seed(5))]
    comm = IdenticalWorkers(world_size)
    transport = transport_for(config, comm)  # type: ignore[arg-type]
    assert isinstance(transport, AllReduceTransport if config.all_reduces else AllGatherTransport)
    plan = build_plan(config, x)
    workspace = Workspace(plan)
    storage = {key: torch.empty(f.numel) for key, f in plan.families.items()}
    transform_into(plan, x, storage, workspace)
    chosen = {key: select(f, storage[key], config.selection, workspace.family(f), config.strongest_first) for key, f in plan.families.items()}
    pending = [transport.start([Outgoing(run, chosen[run.family.key].positions[run.rows], chosen[run.family.key].values[run.rows])
                                for run in bucket], "t") for bucket in plan.buckets]
    assert comm.ledger.total_payload_bytes == sum(config.payload_bytes(tuple(t.shape)) for t in x)
    means = zeroed_means(plan, workspace)
    for waiting in pending:
        accumulate(means, waiting.contributions(), chosen)
    out: dict[int, torch.Tensor] = {}
    inverse(plan, means, workspace, 1.0 / world_size, lambda item, q: out.__setitem__(item.position, q.reshape(item.shape).clone()))
    # what one worker sent, decoded alone: every identical worker sent it, so the mean is it (W = 1, 2, 4: bitwise)
    sent = {key: torch.zeros(f.numel) for key, f in plan.families.items()}
    for bucket, waiting in zip(plan.buckets, pending):
        for run, values in zip(bucket, waiting.sent):
            sent[run.family.key].index_copy_(0, chosen[run.family.key].offsets[run.rows].reshape(-1), values.reshape(-1))
    single: dict[int, torch.Tensor] = {}
    inverse(plan, sent, workspace, 1.0, lambda item, q: single.__setitem__(item.position, q.reshape(item.shape).clone()))
    for i in range(len(x)):
        assert torch.equal(out[i], single[i]), i
    if config.value_format == "fp32":  # exact values: what was sent is the DCT's selection itself
        torch.testing.assert_close(torch.cat([v.reshape(-1) for v in waiting.sent]), chosen[next(iter(chosen))].values.reshape(-1))


# ---------------------------------------------------------------------------------------- participants
class _Recorder:
    def __init__(self, log: list[str], name: str, skip: bool = False) -> None:
        self.log, self.name, self.skip = log, name, skip

    def before_update(self, step: StepContext) -> None:
        self.log.append(f"{self.name}.before")
        step.skip = step.skip or self.skip

    def after_update(self, step: StepContext) -> None:
        self.log.append(f"{self.name}.after")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        return None


def test_run_step_calls_participants_in_order_and_a_skip_stops_the_update() -> None:
    log: list[str] = []
    result = run_step([_Recorder(log, "a"), _Recorder(log, "b")], lambda: log.append("update") or "done")
    assert result == "done" and log == ["a.before", "b.before", "update", "a.after", "b.after"]
    log.clear()
    step = StepContext()
    assert run_step([_Recorder(log, "guard", skip=True), _Recorder(log, "b")], lambda: log.append("update"), step) is None
    assert step.skip and log == ["guard.before"]


def test_the_exchange_and_the_guard_are_participants_of_a_plain_loop() -> None:
    from demo_lightning.algorithms import DeMoConfig, DeMoExchange
    from demo_lightning.algorithms.guard import NonFiniteGuard
    from demo_lightning.algorithms.participants import StepParticipant

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = Communicator()
    exchange = DeMoExchange(opt, DeMoConfig(CodecConfig(topk=8, dense_below=0, dense_vectors=False)), comm)
    guard = NonFiniteGuard(lambda: list(model.parameters()), comm, "skip", exchange)
    assert isinstance(exchange, StepParticipant) and isinstance(guard, StepParticipant)
    before = model.weight.detach().clone()
    model(torch.randn(4, 64)).sum().backward()
    step = StepContext(loss=torch.tensor(1.0))
    run_step([guard, exchange], opt.step, step)
    assert step.plan_agreed and not step.skip and exchange.stats.steps == 1
    assert not torch.equal(model.weight, before)
    model(torch.randn(4, 64)).sum().backward()
    after_first = model.weight.detach().clone()
    run_step([guard, exchange], opt.step, StepContext(loss=torch.tensor(float("nan"))))
    assert torch.equal(model.weight, after_first) and exchange.stats.steps == 1 and guard.skipped_steps == 1
    assert guard.state_dict() == {"skipped_steps": 1}


@pytest.mark.parametrize("value_format", ["sign", "fp32", "int8", "fp8_e5m2", "mixed"])
def test_an_exchange_step_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch, value_format: str) -> None:
    """No ``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``float(t)`` or ``.numpy()`` in the step
    (each would synchronise with a GPU), unless energy is requested."""
    from demo_lightning.algorithms import DeMoConfig, DeMoExchange

    model = torch.nn.Sequential(torch.nn.Linear(72, 40), torch.nn.Linear(40, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exchange = DeMoExchange(opt, DeMoConfig(CodecConfig(chunk=32, topk=4, value_format=value_format, dense_below=100)))
    model(torch.randn(3, 72)).sum().backward()
    exchange.step()  # the first step builds the plan (its caches are made once)
    model(torch.randn(3, 72)).sum().backward()

    def refuse(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"host read in the exchange step: Tensor.{name}")
        return call

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    exchange.step(plan_agreed=True)
    monkeypatch.undo()
    exchange.request_energy()
    with pytest.raises(AssertionError, match="host read"):  # negative control: energy is read back on request
        for name in ("tolist",):
            monkeypatch.setattr(torch.Tensor, name, refuse(name))
        exchange.step(plan_agreed=True)


def test_the_stages_run_inside_named_profiler_ranges() -> None:
    """``torch.profiler`` (and so Lightning's PyTorchProfiler) shows the exchange's stages and the guard by name."""
    from torch.profiler import profile

    from demo_lightning.algorithms import DeMoConfig, DeMoExchange
    from demo_lightning.algorithms.guard import NonFiniteGuard

    model = torch.nn.Sequential(torch.nn.Linear(72, 40), torch.nn.Linear(40, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = Communicator()
    exchange = DeMoExchange(opt, DeMoConfig(CodecConfig(chunk=32, topk=4, dense_below=100)), comm)
    guard = NonFiniteGuard(lambda: list(model.parameters()), comm, "skip", exchange)
    model(torch.randn(3, 72)).sum().backward()
    from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig

    averager = DesLocAverager(opt, DesLocConfig(param_sync_every=1, state_sync_every={}), comm)
    with profile() as prof:
        run_step([guard, averager, exchange], opt.step, StepContext(loss=torch.tensor(1.0)))
    names = {event.name for event in prof.events()}
    expected = {"guard/nonfinite", "demo/encode", "demo/transport", "demo/decode", "desloc/sync"}
    assert expected <= names, sorted(n for n in names if "/" in n)
