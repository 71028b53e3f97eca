"""Collectives take their tensors on the communicator's device (NCCL, which Lightning uses on GPUs,
refuses CPU tensors): the device a Communicator derives or is given, the check every collective
makes, the guard's flag byte without a host read before its gather, and a real 2-process gloo fit
(strategy, AdaptiveKeepRatio, CommunicationMonitor, a checkpoint) in which a control tensor built
without ``device=communicator.device`` would fail (tests/device_run.py explains how, on CPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from demo_lightning.algorithms import gather_nonfinite
from demo_lightning.algorithms.guard import GUARD_TAG
from demo_lightning.comm import CollectiveWork, Communicator

from dist_helpers import clean_env, free_port, run_workers

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent


# ---------------------------------------------------------------------------- the device itself
def test_communicator_device_without_a_group_and_overridden() -> None:
    assert Communicator().device == torch.device("cpu")
    assert Communicator(device="meta").device == torch.device("meta")
    assert Communicator(device=torch.device("cuda", 1)).device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"Communicator device must be a torch.device.*got 'gpu0'"):
        Communicator(device="gpu0")


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu")), ("cpu:gloo,cuda:nccl", torch.device("cuda", 3))],
)
def test_communicator_device_follows_the_groups_backend(monkeypatch: pytest.MonkeyPatch, backend: str, expected: torch.device) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert Communicator().device == expected
    assert Communicator(device="cpu").device == torch.device("cpu")  # the override wins


# ---------------------------------------------------------------------------- the check, on 2 gloo ranks
def _off_device_worker(rank: int, world_size: int) -> dict[str, Any]:
    comm = Communicator()
    out: dict[str, Any] = {"device": str(comm.device)}
    meta = torch.zeros(8, dtype=torch.uint8, device="meta")
    calls = {  # tag: (op named in the error, the call)
        "t/gather": ("all_gather", lambda: comm.all_gather_bytes(meta, "t/gather").wait()),
        "t/reduce": ("all_reduce", lambda: comm.all_reduce_sum_(meta.float(), "t/reduce").wait()),
        "t/broadcast": ("broadcast", lambda: comm.broadcast_(meta.float(), "t/broadcast").wait()),
        "t/tensors": ("broadcast", lambda: comm.broadcast_tensors_([meta.float()], "t/tensors")),
    }
    out["errors"] = {}
    for tag, (op, call) in calls.items():
        try:
            call()
            out["errors"][tag] = (op, "no error")
        except ValueError as error:
            out["errors"][tag] = (op, str(error))
    # a communicator told its collectives run elsewhere refuses the CPU tensors callers hand it
    elsewhere = Communicator(device="meta")
    try:
        elsewhere.all_reduce_sum_(torch.ones(2), "t/elsewhere").wait()
        out["elsewhere"] = "no error"
    except ValueError as error:
        out["elsewhere"] = str(error)
    # nothing was sent: the ranks are still aligned and a correct collective works
    out["after"] = comm.all_reduce_sum_(torch.ones(2), "t/ok").wait().tolist()
    out["tags"] = sorted(comm.ledger.totals)
    return out


def test_every_collective_refuses_a_tensor_off_the_communicators_device(tmp_path: Path) -> None:
    results = run_workers(_off_device_worker, 2, tmp_path, timeout=120, collective_timeout=30)
    for rank, r in enumerate(results):
        assert r["device"] == "cpu"
        for tag, (op, message) in r["errors"].items():
            assert f"{op} '{tag}' on rank {rank} got a tensor on meta" in message, message
            assert "run on cpu" in message and "device=communicator.device" in message and "Communicator(device=...)" in message
        assert f"all_reduce 't/elsewhere' on rank {rank} got a tensor on cpu" in r["elsewhere"] and "run on meta" in r["elsewhere"]
        assert r["after"] == [2.0, 2.0]
        assert r["tags"] == ["t/ok"]  # a refused collective is not recorded either


# ---------------------------------------------------------------------------- the guard
class _Recording(Communicator):
    """A communicator whose all-gather records the buffer it is handed and returns zeros on the CPU
    (every rank finite), standing in for a backend: its device is whatever the test says."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)  # no process group: nothing checks it but this recorder
        self.handed: list[tuple[str, torch.device, torch.dtype, int]] = []

    def all_gather_bytes(
        self, buffer: torch.Tensor, tag: str, per_step: bool = True, *, group: Any = None,
    ) -> CollectiveWork[list[torch.Tensor]]:
        self.handed.append((tag, buffer.device, buffer.dtype, buffer.numel()))
        return CollectiveWork.completed([torch.zeros(buffer.numel(), dtype=torch.uint8) for _ in range(2)])


@pytest.mark.parametrize("digest", [None, -(2**62) + 5])
def test_guard_builds_its_byte_on_the_communicators_device_without_reading_it_back_first(digest: Any) -> None:
    """Parameters, gradients and loss on ``meta``, where no value can be read: the guard completes, so
    it makes no host read before the all-gather (whose result is its one read per step)."""
    comm = _Recording(device="meta")
    params = [torch.nn.Parameter(torch.zeros(4, 4, device="meta")) for _ in range(3)]
    for p in params:
        p.grad = torch.zeros_like(p)
    flags = gather_nonfinite(params, torch.zeros((), device="meta"), comm, GUARD_TAG, **({} if digest is None else {"digest": digest}))
    assert comm.handed == [(GUARD_TAG, torch.device("meta"), torch.uint8, 1 if digest is None else 9)]
    assert not flags and flags.per_rank == (0, 0)
    # gradients on the CPU, the communicator elsewhere: the byte still goes where the collectives run
    comm = _Recording(device="meta")
    cpu_params = [torch.nn.Parameter(torch.zeros(4))]
    cpu_params[0].grad = torch.ones(4)
    gather_nonfinite(cpu_params, 1.0, comm)
    assert comm.handed[0][1] == torch.device("meta")


# ---------------------------------------------------------------------------- a real 2-process fit
def test_two_process_fit_and_checkpoint_hand_every_collective_tensors_on_the_communicators_device(tmp_path: Path) -> None:
    env = clean_env()
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(HERE / "device_run.py"), "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["device"] == "cpu" and r["global_step"] == 4
        # every tensor torch.distributed got was on the communicator's device
        assert r["seen"] and all(devices == [r["device"]] for devices in r["seen"].values()), r["seen"]
        assert {"all_gather", "all_reduce", "broadcast"} <= set(r["seen"])
        # ... including those of every control path run with the default device set to meta
        # (check_same: DES-LOC's layout check at every sync; the exchange's plan rides in the guard's all-gather)
        for tag in ("desloc/layout", "demo/topk", "demo/dense", "guard/nonfinite", "adaptive/k", "monitor/reduce", "monitor/divergence"):
            assert tag in r["tags"], (tag, r["tags"])
        # saving a checkpoint runs no collective: every rank writes its own shard
        assert not any(t.startswith("checkpoint/") for t in r["tags"]), r["tags"]
        assert any(t.startswith("desloc/") for t in r["tags"]), r["tags"]


# ---------------------------------------------------------------------------- state follows the parameters
def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, participant: Any, first: int, count: int) -> None:
    for step in range(first, first + count):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        participant(opt)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 67))


def test_an_exchange_that_follows_its_parameters_keeps_its_momenta_and_its_trajectory_bitwise() -> None:
    """``follow_parameters`` (what the strategies call after Lightning moved the model off the GPU)
    re-lays the momenta out from a copy: values, the compensation's previous gradients, the gradient
    averages and the early phase's count survive, and the run continues exactly as one that never called it."""
    from demo_lightning.algorithms import DeMoConfig, DeMoExchange

    runs = []
    for follow in (False, True):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        exchange = DeMoExchange(opt, DeMoConfig.of(dense_below=100, compensation=0.2, gradient_ema=0.9, early_steps=4), Communicator())

        def step(o: torch.optim.Optimizer, exchange: DeMoExchange = exchange) -> None:
            exchange.step()
            o.step()

        _steps(model, opt, step, 0, 3)
        before = [exchange.momentum(p) for p in model.parameters()]
        if follow:
            exchange.follow_parameters()
            assert all(torch.equal(b, exchange.momentum(p)) for b, p in zip(before, model.parameters()))
            assert exchange.in_early_phase  # 3 of 4 early exchanges done: the count survived
        _steps(model, opt, step, 3, 3)
        runs.append(([p.detach().clone() for p in model.parameters()], [exchange.momentum(p) for p in model.parameters()]))
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert torch.equal(a, b)


def test_an_averager_that_follows_its_parameters_keeps_its_compressed_sync_state_bitwise() -> None:
    from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig

    runs = []
    for follow in (False, True):
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        averager = DesLocAverager(opt, DesLocConfig(param_sync_every=2, compress_params=True), Communicator()).attach()
        _steps(model, opt, lambda o: o.step(), 0, 3)
        if follow:
            residuals = [averager._residual[p].clone() for p in model.parameters()]
            assert any(r.abs().sum() > 0 for r in residuals)  # a sync left unsent changes: there is state to keep
            averager.follow_parameters()
            assert all(torch.equal(r, averager._residual[p]) for r, p in zip(residuals, model.parameters()))
        _steps(model, opt, lambda o: o.step(), 3, 4)
        assert averager.stats.syncs.get("params", 0) == 3
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
