"""Per-rank checkpoint shards: no rank holds another rank's state, and resumes at another world size.

Three launches of ``tests/shards_run.py`` (real Lightning Trainers on CPU processes, gloo; each in
its own session, killed afterwards, under a hard timeout), for two variants (``VARIANTS``: DeMo
with compressed tensors, whose residuals differ per rank; DES-LOC with AdamW, whose replicas and
moments differ between syncs). Every saving fit runs 2 epochs of 3 steps under
``ModelCheckpoint(save_top_k=1)``: ``step=3.ckpt`` is saved, then removed once ``step=6.ckpt`` is
saved (``strategy.remove_checkpoint`` on every rank).

1. 2 processes: ``save2-<variant>``;
2. 4 processes: ``save4-<variant>``, and ``grow-<variant>`` resumed from ``save2``'s step 6 (2 -> 4);
3. 2 processes: ``shrink-<variant>`` resumed from ``save4``'s step 6 (4 -> 2), and resumes from
   damaged copies of a checkpoint: a rank's shard missing, truncated, or from another save, and at
   another world size, rank 0's shard missing (DES-LOC needs it).

Checked: each shard holds exactly that rank's state (what the rank had when it saved, and not the
other ranks'), the main file holds no per-rank tensor and does not grow with the world size,
``save_top_k`` removes the old shards (and only them), a resume at another world size restores the
weights and rank 0's optimizer state on every rank, restarts the DeMo momenta from zero, takes the
DES-LOC schedule from rank 0 and warns once, and a damaged shard makes every rank raise
``CheckpointShardError`` naming the rank, the file and the fix.

About 2-3 minutes on 2 CPU cores shared with other jobs (imports alone ~10 s of CPU per process).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from dist_helpers import clean_env, free_port, run_launch, tensor_hash

HERE = Path(__file__).parent
SCRIPT = HERE / "shards_run.py"
TIMEOUT_S = 60  # the strategies' collective timeout in these runs; it also bounds the first rendezvous, and four
# ranks importing Lightning at once on two cores took over 20 s to join when this module ran after test_fabric.py
# and test_nonfinite.py (the first 4-rank fit failed with DistStoreError, twice); a broken shard must still fail at
# once (below), far inside it
LAUNCH_TIMEOUT_S = 300  # hard limit of one launch (several fits)
CKPT = "step=6.ckpt"

VARIANTS: dict[str, dict[str, Any]] = {
    "demo": {"strategy": "demo", "optimizer": "sgd", "options": {"dense_below": 100}},
    "desloc": {"strategy": "desloc", "optimizer": "adamw", "options": {"param_sync_every": 5}},  # step 6: one step after a sync
}
SAVE: dict[str, Any] = {"epochs": 2, "steps_per_epoch": 3, "save": True, "top_k": 1}
RESUME: dict[str, Any] = {"epochs": 3, "steps_per_epoch": 3}  # one more epoch: steps 7-9


# ---------------------------------------------------------------------------------------- launching
def _launch(out: Path, devices: int, fits: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = clean_env()
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--devices", str(devices), "--fits", json.dumps(fits), "--timeout", str(TIMEOUT_S)]
    returncode, output = run_launch(cmd, env, out, SCRIPT, LAUNCH_TIMEOUT_S)
    assert returncode == 0, output[-6000:]


def _copy(source: Path, target: Path) -> Path:
    """A copy of checkpoint ``source`` and its shard directory at ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, target)
    shutil.copytree(f"{source}.shards", f"{target}.shards")
    return target


def _extra(variant: str) -> dict[str, Any]:
    """DES-LOC: a file of the user's planted in step=3.ckpt.shards; DeMo: ``last.ckpt``, a symbolic link to the latest."""
    return {"plant": True} if variant == "desloc" else {"save_last": "link"}


@pytest.fixture(scope="module")
def launch1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards2")
    _launch(out, 2, [{"name": f"save2-{v}", **spec, **SAVE, **_extra(v)} for v, spec in VARIANTS.items()])
    return out


@pytest.fixture(scope="module")
def launch2(launch1: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards4")
    fits = [{"name": f"save4-{v}", **spec, **SAVE, **_extra(v)} for v, spec in VARIANTS.items()]
    fits += [{"name": f"grow-{v}", **spec, **RESUME, "ckpt_in": str(launch1 / f"save2-{v}" / "ckpt" / CKPT)} for v, spec in VARIANTS.items()]
    _launch(out, 4, fits)
    return out


BROKEN = ("missing", "truncated", "stale", "shrink-without-rank0")


@pytest.fixture(scope="module")
def launch3(launch1: Path, launch2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards2again")
    broken = out / "broken"
    missing = _copy(launch1 / "save2-demo" / "ckpt" / CKPT, broken / "missing" / CKPT)
    os.remove(f"{missing}.shards/rank1.pt")
    truncated = _copy(launch1 / "save2-desloc" / "ckpt" / CKPT, broken / "truncated" / CKPT)
    data = Path(f"{truncated}.shards/rank0.pt").read_bytes()
    Path(f"{truncated}.shards/rank0.pt").write_bytes(data[: len(data) // 2])
    stale = _copy(launch1 / "save2-demo" / "ckpt" / CKPT, broken / "stale" / CKPT)
    shard = torch.load(f"{stale}.shards/rank1.pt", weights_only=True)
    shard["global_step"] = 3  # as if left over from the step-3 save of an interrupted run
    torch.save(shard, f"{stale}.shards/rank1.pt")
    without = _copy(launch2 / "save4-desloc" / "ckpt" / CKPT, broken / "shrink-without-rank0" / CKPT)
    os.remove(f"{without}.shards/rank0.pt")
    paths = {"missing": missing, "truncated": truncated, "stale": stale, "shrink-without-rank0": without}
    variant = {"missing": "demo", "truncated": "desloc", "stale": "demo", "shrink-without-rank0": "desloc"}
    fits = [{"name": f"shrink-{v}", **spec, **RESUME, "ckpt_in": str(launch2 / f"save4-{v}" / "ckpt" / CKPT)} for v, spec in VARIANTS.items()]
    fits += [{"name": name, **VARIANTS[variant[name]], **RESUME, "ckpt_in": str(paths[name])} for name in BROKEN]
    # the same world size through ModelCheckpoint(save_last="link")'s last.ckpt: the shards are the link target's
    fits += [{"name": "same-via-link", **VARIANTS["demo"], **RESUME, "ckpt_in": str(launch1 / "save2-demo" / "ckpt" / "last.ckpt")}]
    _launch(out, 2, fits)
    return out


# ---------------------------------------------------------------------------------------- reading
def _ranks(folder: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _entry_hashes(entry: dict[str, Any]) -> dict[str, Any]:
    """A shard's entry for optimizer 0 as ``shards_run.py`` records a rank's state (see ``_state_hashes``)."""
    out: dict[str, Any] = {"momenta": {}, "optimizer": {}, "params": None}
    if "demo_exchange" in entry:
        momenta = entry["demo_exchange"]["momentum"]["momenta"]
        out["momenta"] = {str(i): tensor_hash(e["value"].reshape(-1)) for i, e in sorted(momenta.items())}
    if "optimizer" in entry:
        out["optimizer"] = {
            f"{i}/{key}": tensor_hash(v.reshape(-1))
            for i, state in sorted(entry["optimizer"]["state"].items())
            for key, v in sorted(state.items())
            if isinstance(v, torch.Tensor)
        }
        out["params"] = [tensor_hash(p) for p in entry["params"]]
    return out


def _main(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def _main_optimizer_hashes(main: dict[str, Any]) -> dict[str, str]:
    (state,) = main["optimizer_states"]
    return {
        f"{i}/{key}": tensor_hash(v.reshape(-1))
        for i, entry in sorted(state["state"].items())
        for key, v in sorted(entry.items())
        if isinstance(v, torch.Tensor)
    }


def _weights(main: dict[str, Any]) -> set[str]:
    return {tensor_hash(t) for t in main["state_dict"].values()}


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_shard_holds_only_its_own_ranks_state_and_the_main_file_no_per_rank_state(
    launch1: Path, launch2: Path, variant: str, world: int
) -> None:
    folder = (launch1 if world == 2 else launch2) / f"save{world}-{variant}"
    ranks = _ranks(folder, world)
    path = folder / "ckpt" / CKPT
    main = _main(path)
    (state,) = main["optimizer_states"]
    record = state["demo_lightning"]
    assert record == {"layout": "shards", "version": 1, "world_size": world, "skipped_steps": 0, "shards": f"{CKPT}.shards"}
    saved = []
    for r, run in enumerate(ranks):
        assert "error" not in run, run.get("error")
        (at6,) = [s for s in run["saves"] if s["global_step"] == 6]
        shard = torch.load(f"{path}.shards/rank{r}.pt", weights_only=True)
        assert {k: v for k, v in shard.items() if k != "optimizers"} == {
            "format": "demo_lightning/rank-shard", "version": 1, "rank": r, "world_size": world, "global_step": 6, "epoch": 1,
        }
        (entry,) = shard["optimizers"]
        got = _entry_hashes(entry)
        assert got["momenta"] == at6["momenta"], f"rank {r}: the shard's momenta are not what the rank held when saving"
        if variant == "desloc":
            assert got["optimizer"] == at6["optimizer"] and got["params"] == at6["params"], r
            assert entry["desloc"]["step_count"] == at6["desloc"][0]["step_count"] == 6
        saved.append(got)
    main_tensors = {tensor_hash(t.reshape(-1)) for t in _tensors(main)}  # (hashes of the flattened bytes, as recorded)
    if variant == "demo":
        # compressed tensors keep per-rank residuals: every rank's differ from every other's
        assert all(saved[a]["momenta"] and saved[a]["momenta"] != saved[b]["momenta"] for a in range(world) for b in range(a))
        assert not main_tensors & {h for s in saved for h in s["momenta"].values()}, "a momentum in the main file"
    else:
        assert all(saved[a]["params"] != saved[b]["params"] for a in range(world) for b in range(a))
        assert _weights(main) == set(saved[0]["params"])  # rank 0's replica, and no one else's
        assert _main_optimizer_hashes(main) == saved[0]["optimizer"]
        others = {h for s in saved[1:] for h in [*s["params"], *s["optimizer"].values()]} - set(saved[0]["params"]) - set(saved[0]["optimizer"].values())
        assert others and not main_tensors & others, "another rank's replica or optimizer state in the main file"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_main_file_does_not_grow_with_the_world_size(launch1: Path, launch2: Path, variant: str) -> None:
    """Same model, same step: the main file at 4 ranks is the size of the one at 2; the shards add one file per rank."""
    sizes = {}
    for world, launch in ((2, launch1), (4, launch2)):
        path = launch / f"save{world}-{variant}" / "ckpt" / CKPT
        shards = [os.path.getsize(f"{path}.shards/rank{r}.pt") for r in range(world)]
        sizes[world] = (os.path.getsize(path), shards)
        assert max(shards) <= 1.05 * min(shards), shards  # every rank's shard about the same size
    (main2, shards2), (main4, shards4) = sizes[2], sizes[4]
    assert abs(main4 - main2) <= 0.01 * main2, sizes
    assert abs(max(shards4) - max(shards2)) <= 0.05 * max(shards2), sizes
    # the gathered layout held every rank's entry in the main file: it would have grown by two shards
    assert sum(shards4) - sum(shards2) > 50 * abs(main4 - main2) + 1, sizes


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_top_k_removes_the_old_checkpoints_shards_and_nothing_else(launch1: Path, launch2: Path, variant: str, world: int) -> None:
    ckpt = (launch1 if world == 2 else launch2) / f"save{world}-{variant}" / "ckpt"
    shards = sorted(p.name for p in (ckpt / f"{CKPT}.shards").iterdir())
    assert shards == [f"rank{r}.pt" for r in range(world)]  # no temporary file left
    if variant == "desloc":  # rank 0 put a file of the user's into step=3.ckpt.shards before it was removed
        assert sorted(p.name for p in ckpt.iterdir()) == ["step=3.ckpt.shards", CKPT, f"{CKPT}.shards"]
        assert sorted(p.name for p in (ckpt / "step=3.ckpt.shards").iterdir()) == ["keep.txt"]
    else:  # last.ckpt: a link to step=6.ckpt, with no shards of its own
        assert sorted(p.name for p in ckpt.iterdir()) == ["last.ckpt", CKPT, f"{CKPT}.shards"]
        assert os.readlink(ckpt / "last.ckpt") == CKPT


def _check_other_world_size(old: list[dict[str, Any]], new: list[dict[str, Any]], main: dict[str, Any], variant: str) -> None:
    """A resume at another world size: the weights and rank 0's optimizer state on every rank, DeMo
    momenta from zero, the DES-LOC schedule from rank 0, one warning, and training goes on."""
    (old0,) = [s for s in old[0]["saves"] if s["global_step"] == 6]
    for r, run in enumerate(new):
        assert "error" not in run, (r, run.get("error"))
        restored = run["restored"]
        assert restored["global_step"] == 6, r
        assert set(restored["params"]) == _weights(main), f"rank {r}: restored parameters are not the checkpoint's weights"
        assert restored["optimizer"] == _main_optimizer_hashes(main) == old0["optimizer"], f"rank {r}: not rank 0's optimizer state"
        if variant == "demo":
            assert old0["momenta"] and restored["momenta"] == {}, f"rank {r}: DeMo momenta must restart from zero"
        else:
            assert restored["desloc"] == old0["desloc"], r
        assert [s["global_step"] for s in run["steps"]] == [7, 8, 9], r
        assert all(math.isfinite(float(s["loss"])) for s in run["steps"]), r
        assert run["warnings"] == ([] if r else run["warnings"]), r
    (warning,) = new[0]["warnings"]
    assert f"comes from {len(old)} workers, this run has {len(new)}" in warning and "DeMo momenta restart from zero" in warning
    if variant == "demo":  # replicas stay identical (the shared update)
        for steps in zip(*(run["steps"] for run in new)):
            assert all(s["params"] == steps[0]["params"] for s in steps)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_from_2_on_4_ranks(launch1: Path, launch2: Path, variant: str) -> None:
    main = _main(launch1 / f"save2-{variant}" / "ckpt" / CKPT)
    _check_other_world_size(_ranks(launch1 / f"save2-{variant}", 2), _ranks(launch2 / f"grow-{variant}", 4), main, variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_from_4_on_2_ranks(launch2: Path, launch3: Path, variant: str) -> None:
    main = _main(launch2 / f"save4-{variant}" / "ckpt" / CKPT)
    _check_other_world_size(_ranks(launch2 / f"save4-{variant}", 4), _ranks(launch3 / f"shrink-{variant}", 2), main, variant)


@pytest.mark.parametrize(
    ("name", "rank", "what"),
    [
        ("missing", 1, "is missing"),
        ("truncated", 0, "cannot be read"),
        ("stale", 1, "was written by another save (rank 1 of 2 at global step 3"),
        ("shrink-without-rank0", 0, "is missing (saved by 4 ranks, this run has 2"),
    ],
)
def test_a_damaged_shard_makes_every_rank_raise_naming_the_rank_the_file_and_the_fix(launch3: Path, name: str, rank: int, what: str) -> None:
    shard = launch3 / "broken" / name / f"{CKPT}.shards" / f"rank{rank}.pt"
    for r, run in enumerate(_ranks(launch3 / name, 2)):
        assert run["restored"] is None, f"rank {r} started training"
        error = run.get("error")
        assert error is not None and error["type"] == "CheckpointShardError", (r, error)
        message = error["message"]
        for part in (f"{'own shard' if name != 'shrink-without-rank0' else 'shard'} {str(shard)!r} {what}", "copy the checkpoint's shard directory",
                     "fit without ckpt_path"):
            assert part in message, (r, part, message)
        assert error["seconds"] < TIMEOUT_S, "the ranks must agree at once, not fail in a later collective"


def test_resume_through_a_symbolic_link_at_the_same_world_size_gives_each_rank_its_own_state(launch1: Path, launch3: Path) -> None:
    """``last.ckpt`` of ``ModelCheckpoint(save_last="link")`` has no shards of its own: they are read
    beside the link's target, and each rank gets its own momenta back, without a warning."""
    saved = _ranks(launch1 / "save2-demo", 2)
    resumed = _ranks(launch3 / "same-via-link", 2)
    for r in range(2):
        (at6,) = [s for s in saved[r]["saves"] if s["global_step"] == 6]
        run = resumed[r]
        assert "error" not in run and run["warnings"] == [], (r, run.get("error"), run["warnings"])
        assert run["restored"]["momenta"] == at6["momenta"] and run["restored"]["params"] == at6["params"], r
    assert resumed[0]["restored"]["momenta"] != resumed[1]["restored"]["momenta"]
