"""``Fabric(strategy="demo")`` and ``Fabric(strategy="desloc")``: the registry, the options, and a real
2-process Fabric loop under torchrun (tests/fabric_run.py) with gradient accumulation, ``fabric.save``
/ ``fabric.load`` of per-rank state, and the README's example."""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from dist_helpers import clean_env, run_launch

HERE = Path(__file__).parent
SCRIPT = HERE / "fabric_run.py"
EXAMPLE = HERE.parent / "examples" / "fabric_loop.py"
STEPS, SAVE_AT, CLOSURE_AT = 6, 3, 5


def test_fabric_registry_has_both_names_with_the_trainers_options() -> None:
    from lightning.fabric import Fabric

    import demo_lightning
    from demo_lightning import DeMoFabricStrategy, DeMoStrategy, DesLocFabricStrategy, DesLocStrategy

    assert isinstance(Fabric(accelerator="cpu", devices=1, strategy="demo").strategy, DeMoFabricStrategy)
    assert isinstance(Fabric(accelerator="cpu", devices=1, strategy="desloc").strategy, DesLocFabricStrategy)
    for fabric_cls, trainer_cls in ((DeMoFabricStrategy, DeMoStrategy), (DesLocFabricStrategy, DesLocStrategy)):
        assert inspect.signature(fabric_cls.__init__) == inspect.signature(trainer_cls.__init__)
        assert fabric_cls.__doc__ == trainer_cls.__doc__ and "Args:" in (fabric_cls.__doc__ or "")
    strategy = DeMoFabricStrategy(topk=8, decay=0.9, value_format="int8")
    assert (strategy.runtime.demo_config.codec.topk, strategy.runtime.demo_config.decay) == (8, 0.9)
    with pytest.raises(ValueError, match="topk"):
        DeMoFabricStrategy(topk=0)
    with pytest.raises(ValueError, match="param_sync_every"):
        DesLocFabricStrategy(param_sync_every=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hierarchy"):
        DeMoFabricStrategy(hierarchy="ring")  # type: ignore[arg-type]
    assert demo_lightning.DeMoFabricStrategy is DeMoFabricStrategy


def test_fabric_refuses_lbfgs_naming_the_fix() -> None:
    import torch

    from demo_lightning import DeMoFabricStrategy

    strategy = DeMoFabricStrategy()
    weight = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="LBFGS.*first-order optimizer"):
        strategy.setup_optimizer(torch.optim.LBFGS([weight]))


@pytest.fixture(scope="module")
def fabric_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fabric")
    env = clean_env()
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--out", str(out), "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--accumulate", "2", "--closure-at", str(CLOSURE_AT)]
    code, output = run_launch(cmd, env, out, SCRIPT, timeout=240)
    assert code == 0, output[-6000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.timeout(300)
def test_fabric_demo_keeps_replicas_identical_after_every_step_with_each_ranks_own_momenta(fabric_run: list[dict[str, Any]]) -> None:
    from demo_lightning.comm.ledger import ring_all_gather_bytes, ring_all_reduce_bytes

    r0, r1 = (run["demo"] for run in fabric_run)
    assert r0["strategy"] == "DeMoFabricStrategy"
    assert [s["step"] for s in r0["steps"]] == list(range(1, STEPS + 1))
    for a, b in zip(r0["steps"], r1["steps"]):
        assert a["params"] == b["params"], a["step"]  # every rank applied the same update
        assert a["momenta"] != b["momenta"], a["step"]  # from its own residual
    assert len({s["params"] for s in r0["steps"]}) == STEPS  # and the model moved at every step
    # one exchange per optimizer step, not per micro-batch (the first of two ran under no_backward_sync)
    assert [s["exchange_steps"] for s in r0["steps"]] == list(range(1, STEPS + 1))
    # optimizer.step(closure) at step 5: the closure ran once, before the exchange, and step() returned its loss
    closure = [s for s in r0["steps"] if s["closure"]]
    assert [s["step"] for s in closure] == [CLOSURE_AT] and closure[0]["returned"] == closure[0]["loss"]
    assert all(s["returned"] is None for s in r0["steps"] if not s["closure"])
    # the ledger's bytes per step against the payload formula: top-k all-gather, dense all-reduce, the guard's 9 bytes
    compressed = sum(payload for _, payload, tile in r0["layout"] if tile)
    dense = sum(payload for _, payload, tile in r0["layout"] if not tile)
    expected = ring_all_gather_bytes(compressed, 2) + ring_all_reduce_bytes(dense, 2) + ring_all_gather_bytes(9, 2)
    ddp = ring_all_reduce_bytes(4 * sum(numel for numel, _, _ in r0["layout"]), 2)
    for step in r0["steps"]:
        assert step["sent"] == expected and step["ddp"] == ddp
        assert step["tags"] == ["demo/dense", "demo/topk", "guard/nonfinite"]
        assert step["metrics"]["comm/bytes_sent_per_step"] == expected
        assert step["metrics"]["comm/ratio_vs_ddp"] == pytest.approx(ddp / expected)


@pytest.mark.timeout(300)
def test_fabric_save_and_load_continue_demo_bitwise_on_every_rank(fabric_run: list[dict[str, Any]]) -> None:
    for run in fabric_run:
        reference, resumed = run["demo"]["steps"], run["demo-resumed"]["steps"]
        assert [s["step"] for s in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
        for ref, res in zip(reference[SAVE_AT:], resumed):
            # started from other weights: parameters and this rank's momenta come from the checkpoint and its shard
            assert (res["params"], res["momenta"]) == (ref["params"], ref["momenta"]), res["step"]


@pytest.mark.timeout(300)
def test_fabric_desloc_averages_on_its_periods_and_resumes_each_ranks_replica(fabric_run: list[dict[str, Any]]) -> None:
    r0, r1 = (run["desloc"] for run in fabric_run)
    assert r0["strategy"] == "DesLocFabricStrategy"
    for a, b in zip(r0["steps"], r1["steps"]):
        synced = a["step"] % 2 == 0  # param_sync_every=2
        assert (a["params"] == b["params"]) is synced, a["step"]
        assert ("desloc/params" in a["tags"]) is synced
        assert ("desloc/state/exp_avg" in a["tags"]) is (a["step"] % 3 == 0)
        assert ("desloc/state/exp_avg_sq" in a["tags"]) is (a["step"] % 6 == 0)
    assert r0["final"] == r1["final"]  # final_sync()
    for run in fabric_run:  # each rank continues from its own replica, optimizer state and schedule
        reference, resumed = run["desloc"]["steps"], run["desloc-resumed"]["steps"]
        assert [(s["params"], s["tags"]) for s in resumed] == [(s["params"], s["tags"]) for s in reference[SAVE_AT:]]
        assert run["desloc-resumed"]["final"] == run["desloc"]["final"]


@pytest.mark.timeout(300)
def test_fabric_load_with_a_missing_shard_raises_on_every_rank(fabric_run: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(fabric_run):
        broken = run["broken"]
        assert broken["raised"] == "CheckpointShardError", rank
        assert "rank 1 cannot restore" in broken["message"] and "rank1.pt" in broken["message"] and "is missing" in broken["message"]
        assert "Fix: copy the checkpoint's shard directory" in broken["message"]


@pytest.mark.timeout(300)
def test_the_fabric_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    """The README's command, twice: the second run resumes from the first's checkpoint."""
    env = clean_env()
    ckpt = tmp_path / "loop.ckpt"
    outputs = []
    for steps in (6, 10):
        code, output = run_launch([sys.executable, str(EXAMPLE), "--max-steps", str(steps), "--checkpoint", str(ckpt)],
                                  env, tmp_path, EXAMPLE, timeout=200)
        assert code == 0, output[-4000:]
        outputs.append(output)
    for output, steps in zip(outputs, (6, 4)):
        hashes = re.findall(r"rank (\d): params (\w+), loss [\d.]+, [\d.]+x fewer bytes than DDP over this run's (\d+) steps", output)
        assert sorted(rank for rank, _, _ in hashes) == ["0", "1"], output[-2000:]
        assert len({h for _, h, _ in hashes}) == 1 and {n for _, _, n in hashes} == {str(steps)}
    assert "resumed from" in outputs[1] and "at step 6" in outputs[1]
    assert (tmp_path / "loop.ckpt.shards" / "rank1.pt").exists()


def test_a_second_fabric_setup_keeps_the_first_optimizer_driven_and_each_averager_gets_its_modules_buffers() -> None:
    """``fabric.setup`` twice (a GAN's two models) must not drop the first optimizer's exchange, and
    DES-LOC averages the buffers of the module that owns each optimizer's parameters, once."""
    import torch
    from torch import nn

    from demo_lightning import DeMoFabricStrategy, DesLocFabricStrategy

    demo = DeMoFabricStrategy(dense_below=0, dense_vectors=False)
    g, d = nn.Linear(8, 8), nn.Linear(8, 8)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    demo.setup_module_and_optimizers(g, [opt_g])
    demo.setup_module_and_optimizers(d, [opt_d])
    assert demo.runtime.manages(opt_g) and demo.runtime.manages(opt_d) and len(demo.exchanges) == 2

    desloc = DesLocFabricStrategy(param_sync_every=2)
    first, second = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    desloc.setup_module(first)
    desloc.setup_module(second)
    opt_second = desloc.setup_optimizer(torch.optim.SGD(second.parameters(), lr=0.1))
    opt_first = desloc.setup_optimizer(torch.optim.SGD(first.parameters(), lr=0.1))
    again = desloc.setup_optimizer(torch.optim.SGD(first[0].parameters(), lr=0.1))  # same module: its buffers once
    buffers = {name: desloc.runtime.averager_of(opt).buffers for name, opt in (("first", opt_first), ("second", opt_second), ("again", again))}
    float_buffers = lambda m: [b for b in m.buffers() if b.is_floating_point()]  # noqa: E731
    assert [id(b) for b in buffers["first"]] == [id(b) for b in float_buffers(first)]
    assert [id(b) for b in buffers["second"]] == [id(b) for b in float_buffers(second)]
    assert buffers["again"] == []
    with pytest.warns(UserWarning, match="belong to no module set up with Fabric"):
        desloc.setup_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_fabric_gradient_clipping_leaves_a_nan_to_the_guard_instead_of_raising_on_one_rank() -> None:
    import torch
    from torch import nn

    from demo_lightning import DeMoFabricStrategy

    strategy = DeMoFabricStrategy()
    model = nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight.grad = torch.full((3, 3), float("nan"))
    model.bias.grad = torch.ones(3)
    norm = strategy.clip_gradients_norm(model, optimizer, max_norm=1.0)  # Fabric's default error_if_nonfinite=True
    assert torch.isnan(norm)
