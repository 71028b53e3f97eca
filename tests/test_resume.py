"""Crash and resume: 2-process fits stopped mid-run resume from their last checkpoint bitwise.

All fits are ``tests/resume_run.py`` in subprocesses (own session; the session and every worker it
recorded are killed afterwards): 3 epochs of 4 optimizer steps, a checkpoint at the end of every
epoch (global steps 4, 8, 12: Lightning's DataLoaders cannot resume mid-epoch), and rank 1's loss
NaN at the 5th step, so ``skipped_steps`` becomes 1 and the DES-LOC schedule position (local steps)
lags the global step by one from then on: local step t = 4, 7, 11 at the checkpoints.

Three strategy variants (``VARIANTS``), each taken through the same chain; one launch (two
processes) runs a stage of every variant one after the other, since imports alone cost ~10 s of
CPU per process:

1. ``reference``: uninterrupted, and ``crashed``: every rank raises after step 6 (last checkpoint:
   step 4, between syncs);
2. ``resumed4``: resumed from ``crashed``'s last checkpoint; stopped after step 10 by an exception
   on every rank, except the last variant, where rank 1 SIGKILLs itself and rank 0 must fail within
   the collective timeout (last checkpoint: step 8, written by this resumed run; right after a
   sync for the DES-LOC variants);
3. ``resumed8``: resumed from ``resumed4``'s last checkpoint to the end.

Plus one torchrun launch (``--max-restarts 1``, DES-LOC) whose worker 0 SIGKILLs itself once after
step 10; torchrun restarts the group and the script resumes from ``last.ckpt``. So a SIGKILL is
injected into the combination (rank 1, Lightning's launcher) and into DES-LOC (rank 0, torchrun).

Each resumed run must reproduce, on every rank and at every step it ran, the hashes of every
parameter and of every optimizer-state tensor (Adam moments, DeMo residuals ``demo_momentum``),
the loss, the learning rate, the DES-LOC schedule position and sync counts and ``skipped_steps``,
and end with the reference's tensors.

Four launches in all: about 2.5 minutes on 2 CPU cores shared with other jobs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_helpers import clean_env, free_port, run_launch

HERE = Path(__file__).parent
SCRIPT = HERE / "resume_run.py"
TIMEOUT_S = 20  # the strategies' collective timeout in these runs
LAUNCH_TIMEOUT_S = 240  # hard limit of one launch (several fits)
TOTAL_STEPS = 12
COMMON = ["--epochs", "3", "--steps-per-epoch", "4", "--nan-at", "4", "--nan-rank", "1", "--timeout", str(TIMEOUT_S)]

# local (DES-LOC) step t after global step g: t = g up to the skipped 5th step, g - 1 after it
VARIANTS: dict[str, dict[str, Any]] = {
    # DeMo, AdamW on the shared direction: the residuals differ per rank; no periodic syncs
    "demo": {"strategy": "demo", "optimizer": "adamw", "options": {"update": "raw", "dense_below": 100}},
    # DES-LOC, AdamW: params at t=7 (g=8), exp_avg at t=5, 10 (g=6, 11), exp_avg_sq at t=7 (g=8)
    "desloc": {
        "strategy": "desloc", "optimizer": "adamw",
        "options": {"param_sync_every": 7, "state_sync_every": {"exp_avg": 5, "exp_avg_sq": 7}},
    },
    # DeMo with DES-LOC: params at t=5, 10 (g=6, 11), the residuals demo_momentum at t=7 (g=8); each
    # worker's gradient averages (gradient_ema) are its own state, in its shard
    "demo+desloc": {
        "strategy": "demo", "optimizer": "sgd",
        "options": {"dense_below": 100, "param_sync_every": 5, "state_sync_every": {"demo_momentum": 7}, "gradient_ema": 0.5},
    },
}
KILLED = "demo+desloc"  # stage 2 of this variant ends with a SIGKILL of rank 1 (so it runs last)


# ---------------------------------------------------------------------------------------- launching
def _launch(out: Path, fits: list[dict[str, Any]], *extra: str, torchrun: bool = False) -> tuple[int, str]:
    """Run the fits on 2 processes under a hard timeout; returns (exit code, output)."""
    out.mkdir(parents=True, exist_ok=True)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    script = [str(SCRIPT), "--out", str(out), "--fits", json.dumps(fits), *COMMON, *extra]
    if torchrun:  # --standalone picks a free port for its rendezvous; the workers get MASTER_* from it
        # torchrun's workers share the agent's rendezvous TCPStore by default, and after a restart a
        # rank can read its peer's gloo address from the previous attempt ("Gloo connectFullMesh
        # failed ... Connection refused"; plain torch.distributed too, pytorch/pytorch#135712):
        # a store of the workers' own per attempt avoids it
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *script]
    else:
        env["MASTER_PORT"] = str(free_port())
        cmd = [sys.executable, *script]
    returncode, output = run_launch(cmd, env, out, SCRIPT, LAUNCH_TIMEOUT_S)
    return returncode, output


def _fits(stage: str, **per_variant: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": f"{stage}-{name}", **spec, **per_variant.get(name, {})} for name, spec in VARIANTS.items()]


def _last(out: Path, stage: str, variant: str) -> str:
    return str(out / f"{stage}-{variant}" / "ckpt" / "last.ckpt")


@pytest.fixture(scope="module")
def launch1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 1: ``reference-<variant>`` (uninterrupted) and ``crashed-<variant>`` (raises after step 6)."""
    out = tmp_path_factory.mktemp("launch1")
    code, output = _launch(out, _fits("reference") + _fits("crashed", **{v: {"raise_at": 6} for v in VARIANTS}))
    assert code == 0, output[-6000:]
    return out


@pytest.fixture(scope="module")
def launch2(launch1: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 2: ``resumed4-<variant>`` from crashed's step 4, stopped after step 10 (KILLED: by SIGKILL of rank 1)."""
    out = tmp_path_factory.mktemp("launch2")
    stops = {v: {"raise_at": 10} if v != KILLED else {"kill_at": 10} for v in VARIANTS}
    fits = _fits("resumed4", **{v: {"ckpt_in": _last(launch1, "crashed", v), **stops[v]} for v in VARIANTS})
    assert fits[-1]["name"] == f"resumed4-{KILLED}"  # the kill ends the launch
    code, output = _launch(out, fits, "--kill-rank", "1")
    assert code != 0, "the launch whose rank 1 was killed must fail:\n" + output[-6000:]
    return out


@pytest.fixture(scope="module")
def launch3(launch2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 3: ``resumed8-<variant>`` from resumed4's step 8 to the end."""
    out = tmp_path_factory.mktemp("launch3")
    code, output = _launch(out, _fits("resumed8", **{v: {"ckpt_in": _last(launch2, "resumed4", v)} for v in VARIANTS}))
    assert code == 0, output[-6000:]
    return out


# ---------------------------------------------------------------------------------------- results
def _records(folder: Path, rank: int, attempt: int = 0) -> list[dict[str, Any]]:
    """The per-step records a fit wrote as it went (also those of a fit stopped later)."""
    path = folder / f"rank{rank}.attempt{attempt}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _results(folder: Path, attempt: int = 0) -> list[dict[str, Any]]:
    """Each rank's final tensors and schedule, with the per-step records."""
    return [{**torch.load(folder / f"rank{r}.pt", weights_only=False), "records": _records(folder, r, attempt)} for r in range(2)]


def _record(run: dict[str, Any], step: int) -> dict[str, Any]:
    (record,) = [r for r in run["records"] if r["global_step"] == step]
    return record


def _keys(record: dict[str, Any], suffix: str) -> list[str]:
    return [k for k in record["state"] if k.endswith(suffix)]


def _checkpoints(folder: Path) -> list[str]:
    """The checkpoint files of ``folder/ckpt``; each has its shard directory beside it, one file per
    rank in it, and nothing else lies there (no leftover temporary files)."""
    names = sorted(p.name for p in (folder / "ckpt").iterdir())
    files = [n for n in names if n.endswith(".ckpt")]
    assert names == sorted(files + [f"{n}.shards" for n in files]), names
    for name in files:
        assert sorted(p.name for p in (folder / "ckpt" / f"{name}.shards").iterdir()) == ["rank0.pt", "rank1.pt"], name
    return files


def _per_rank_checkpoint(path: Path) -> dict[str, Any]:
    """The main file's record plus ``per_rank``: every rank's entry, read from its own shard."""
    checkpoint = torch.load(path, weights_only=True)  # tensors and primitives only
    (state,) = checkpoint["optimizer_states"]
    extra = state["demo_lightning"]
    assert extra["layout"] == "shards" and extra["world_size"] == 2 and "per_rank" not in extra, extra
    shards = [torch.load(f"{path}.shards/rank{r}.pt", weights_only=True) for r in range(2)]
    assert [(s["rank"], s["world_size"], s["global_step"]) for s in shards] == [(r, 2, checkpoint["global_step"]) for r in range(2)]
    return {"global_step": checkpoint["global_step"], **extra, "per_rank": [s["optimizers"][0] for s in shards]}


def _assert_same_steps(ref: list[dict[str, Any]], records: list[list[dict[str, Any]]], steps: range, what: str) -> None:
    """Every rank's records cover exactly global ``steps`` and equal the reference's exactly."""
    for rank in range(2):
        got = records[rank]
        assert [x["global_step"] for x in got] == list(steps), (what, rank)
        for want, have in zip((_record(ref[rank], g) for g in steps), got):
            differ = sorted(k for k in want if want[k] != have[k])
            assert not differ, f"{what}: rank {rank}, global step {want['global_step']}: {differ} differ from the uninterrupted run"


def _assert_ends_bitwise(ref: list[dict[str, Any]], resumed: list[dict[str, Any]], from_step: int, what: str) -> None:
    """A fit resumed after ``from_step``: its steps and every rank's final state equal the reference's."""
    _assert_same_steps(ref, [r["records"] for r in resumed], range(from_step + 1, TOTAL_STEPS + 1), what)
    for rank in range(2):
        f, r = ref[rank], resumed[rank]
        assert f["params"].keys() == r["params"].keys()
        for name, tensor in f["params"].items():
            assert torch.equal(tensor, r["params"][name]), (what, rank, name)
        assert f["opt_state"].keys() == r["opt_state"].keys()
        for key, tensor in f["opt_state"].items():
            assert torch.equal(tensor, r["opt_state"][key]), (what, rank, key)
        assert (r["desloc"], r["skipped_steps"], r["global_step"]) == (f["desloc"], f["skipped_steps"], f["global_step"]), what
        # the comparison can fail: what it checks did change since the checkpoint
        start, end = _record(f, from_step), _record(f, TOTAL_STEPS)
        for field in ("params", "state", "loss"):
            assert start[field] != end[field], (what, rank, field)


def _reference(launch1: Path, variant: str) -> list[dict[str, Any]]:
    return _results(launch1 / f"reference-{variant}")


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_checkpoints_carry_per_rank_state_between_and_at_syncs(launch1: Path, variant: str) -> None:
    """The uninterrupted run's checkpoints sit where the chain needs them and hold what differs per rank."""
    folder = launch1 / f"reference-{variant}"
    ref = _reference(launch1, variant)
    assert _checkpoints(folder) == ["last.ckpt", "step=12.ckpt", "step=4.ckpt", "step=8.ckpt"]
    early, late = _per_rank_checkpoint(folder / "ckpt" / "step=4.ckpt"), _per_rank_checkpoint(folder / "ckpt" / "step=8.ckpt")
    assert (early["global_step"], early["skipped_steps"], late["global_step"], late["skipped_steps"]) == (4, 0, 8, 1)
    assert all(r["skipped_steps"] == 1 and r["global_step"] == TOTAL_STEPS for r in ref)
    if variant != "demo":  # DES-LOC local steps: the skipped 5th step did not count
        assert [s["desloc"]["step_count"] for s in early["per_rank"]] == [4, 4]
        assert [s["desloc"]["step_count"] for s in late["per_rank"]] == [7, 7]
        assert [d["step_count"] for r in ref for d in r["desloc"]] == [TOTAL_STEPS - 1] * 2
    a4, b4 = (_record(ref[r], 4) for r in range(2))
    a8, b8 = (_record(ref[r], 8) for r in range(2))
    for rank in range(2):  # negative control: what the resume tests compare changes between checkpoints
        for field in ("params", "state", "loss"):
            assert _record(ref[rank], 4)[field] != _record(ref[rank], 8)[field], (rank, field)
    # step=4.ckpt lies between syncs: per-rank state differs across ranks; step=8.ckpt follows a sync
    if variant == "desloc":
        assert a4["params"] != b4["params"] and a4["state"] != b4["state"]
        assert a8["params"] == b8["params"]  # params and exp_avg_sq averaged after local step 7
        assert all(a8["state"][k] == b8["state"][k] for k in _keys(a8, "/exp_avg_sq"))
        assert any(a8["state"][k] != b8["state"][k] for k in _keys(a8, "/exp_avg"))  # averaged at t=5, 10 only
    else:
        assert all(_record(ref[0], g)["params"] == _record(ref[1], g)["params"] for g in range(1, TOTAL_STEPS + 1))
        momenta = _keys(a4, "/demo_momentum")
        assert len(momenta) == len(a4["params"])
        assert any(a4["state"][k] != b4["state"][k] for k in momenta)  # (densely sent tensors keep no residual)
        if variant == "demo+desloc":  # residuals averaged after local step 7 (global step 8)
            assert all(a8["state"][k] == b8["state"][k] for k in momenta)
        else:
            assert any(a8["state"][k] != b8["state"][k] for k in momenta)
    # at the end no sync is due: each rank ends with its own state, so resuming must restore it per rank
    assert ref[0]["opt_state"].keys() == ref[1]["opt_state"].keys()
    assert any(not torch.equal(t, ref[1]["opt_state"][k]) for k, t in ref[0]["opt_state"].items())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exception_on_every_rank_then_resume_between_syncs_is_bitwise(launch1: Path, launch2: Path, variant: str) -> None:
    """Stage 1 stopped by an exception after step 6; stage 2, resumed from step 4, repeats steps 5-10 exactly."""
    ref = _reference(launch1, variant)
    crashed = launch1 / f"crashed-{variant}"
    for rank in range(2):  # the fault fired on both ranks and stopped both
        assert (crashed / f"rank{rank}.fault").read_text().startswith("raise 6")
        assert "InjectedFailure: injected failure after step 6" in (crashed / f"rank{rank}.error").read_text()
        assert not (crashed / f"rank{rank}.pt").exists()
    assert _checkpoints(crashed) == ["last.ckpt", "step=4.ckpt"]
    _assert_same_steps(ref, [_records(crashed, r) for r in range(2)], range(1, 7), "stage 1 (from scratch)")
    resumed = launch2 / f"resumed4-{variant}"
    assert _checkpoints(resumed) == ["last.ckpt", "step=8.ckpt"]
    _assert_same_steps(ref, [_records(resumed, r) for r in range(2)], range(5, 11), "stage 2 (resumed from step 4)")


def test_killed_rank_makes_its_peer_fail_within_the_timeout(launch2: Path) -> None:
    """Stage 2 of KILLED: rank 1 SIGKILLed itself after step 10; rank 0 failed in a collective, it did not hang."""
    killed = launch2 / f"resumed4-{KILLED}"
    fault = (killed / "rank1.fault").read_text()
    assert fault.startswith("kill 10")
    assert not (killed / "rank1.error").exists()  # SIGKILL: no handler ran
    error = (killed / "rank0.error").read_text()
    assert "InjectedFailure" not in error
    assert float(error.split()[0]) - float(fault.split()[2]) < TIMEOUT_S + 10, error
    assert not any((killed / f"rank{r}.pt").exists() for r in range(2))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_from_a_stopped_resumed_run_at_a_sync_step_ends_bitwise(launch1: Path, launch2: Path, launch3: Path, variant: str) -> None:
    """Stage 3, resumed from the step-8 checkpoint that stage 2 wrote before it was stopped, ends as the reference."""
    ref = _reference(launch1, variant)
    folder = launch3 / f"resumed8-{variant}"
    late = _per_rank_checkpoint(launch2 / f"resumed4-{variant}" / "ckpt" / "last.ckpt")
    assert (late["global_step"], late["skipped_steps"]) == (8, 1)
    assert _checkpoints(folder) == ["last.ckpt", "step=12.ckpt"]
    _assert_ends_bitwise(ref, _results(folder), 8, "stage 3 (resumed from step 8)")


def test_torchrun_restarts_the_group_after_a_worker_is_killed_and_finishes_like_the_reference(launch1: Path, tmp_path: Path) -> None:
    """torchrun --max-restarts 1 with DES-LOC (replicas differ between syncs): worker 0 SIGKILLs itself once
    after step 10; torchrun restarts both workers, which resume from last.ckpt (step 8) and end like the
    uninterrupted run launched by Lightning's own launcher."""
    variant = "desloc"
    ref = _reference(launch1, variant)
    out, marker = tmp_path / "torchrun", tmp_path / "killed-once"
    fits = [{"name": "fit", **VARIANTS[variant], "ckpt_in": "last", "kill_at": 10}]
    code, output = _launch(out, fits, "--kill-rank", "0", "--kill-marker", str(marker), torchrun=True)
    assert code == 0, output[-6000:]
    folder = out / "fit"
    assert marker.exists() and (folder / "rank0.fault").read_text().startswith("kill 10")
    assert len(list((out / "pids").iterdir())) == 4, "two attempts of two workers each"
    # attempt 0 (from scratch) equals the popen-launched reference up to the kill
    _assert_same_steps(ref, [_records(folder, r, attempt=0) for r in range(2)], range(1, 11), "torchrun attempt 0")
    runs = _results(folder, attempt=1)
    assert [r["environment"] for r in runs] == ["TorchElasticEnvironment"] * 2
    assert [r["restart_count"] for r in runs] == ["1", "1"]
    _assert_ends_bitwise(ref, runs, 8, "torchrun attempt 1 (resumed from last.ckpt, step 8)")
