"""Checkpoints of revision d65a308 (DeMo momenta in ``optimizer.state``) resume with today's code.

The fixtures ``tests/data/legacy_demo_d65a308.ckpt`` and ``legacy_demo_desloc_d65a308.ckpt`` were
written by ``tests/data/make_legacy_checkpoints.py`` at revision d65a308 on 2 ranks: their per-rank
entries hold ``"demo_momentum"`` (``{parameter index: parameter-shaped tensor}``), and their JSON
sidecars the sha256 of every rank's momenta and parameters (and the DES-LOC schedule). One launch
of ``tests/legacy_resume_run.py`` (2 processes, CPU, gloo; own session, killed afterwards) resumes
both with ``trainer.fit(module, ckpt_path=fixture)``, the strategy settings of the JSON and one
more epoch (as many optimizer steps again), then writes a new checkpoint; and, as a negative
control, resumes both once more with the momenta cleared at train start.

Checked, for both fixtures, on both ranks:

1. at ``on_train_start`` (restored, before any new step) ``exchange.momentum(p)`` of every
   parameter the JSON lists has that rank's own sha256 (the two ranks' differ for the compressed
   tensors: each rank got its own back);
2. the parameters right after the restore have the JSON's sha256 (the same on both ranks);
3. every new step keeps the replicas bitwise identical, moves the parameters, has a finite loss,
   and global step advances past the fixture's; the restored momenta matter (the cleared control's
   first step differs); DES-LOC: the averager's schedule and sync counts continue from the JSON's;
4. the new checkpoint carries layout version 2 under ``"demo_exchange"`` (no ``"demo_momentum"``),
   each rank's own state bitwise, in that rank's own shard (``resumed.ckpt.shards/rank<r>.pt``).

About 15-25 s on 2 CPU cores shared with other jobs (one launch: imports ~10 s per process).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_helpers import clean_env, free_port, run_launch

HERE = Path(__file__).parent
DATA = HERE / "data"
SCRIPT = HERE / "legacy_resume_run.py"
sys.path.insert(0, str(DATA))
from make_legacy_checkpoints import FITS, sha256_of  # noqa: E402

FIXTURES = sorted(FITS)  # legacy_demo_d65a308, legacy_demo_desloc_d65a308
DESLOC = "legacy_demo_desloc_d65a308"
MIX_WEIGHT = "4"  # net.mix.weight, 64 x 64: compressed
TIMEOUT_S = 20  # the strategy's collective timeout in these runs
LAUNCH_TIMEOUT_S = 150  # hard limit of the launch (four fits)


# ---------------------------------------------------------------------------------------- launching
@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Resume every fixture (and its cleared control) on 2 processes under a hard timeout."""
    out = tmp_path_factory.mktemp("legacy")
    env = clean_env()
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--fixtures", *FIXTURES, "--controls", "--timeout", str(TIMEOUT_S)]
    returncode, output = run_launch(cmd, env, out, SCRIPT, LAUNCH_TIMEOUT_S)
    errors = "".join(f"\n{p}: {p.read_text()}" for p in sorted(out.glob("*/rank*.error")))
    assert returncode == 0, output[-6000:] + errors
    return out


def _fixture(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def _ranks(out: Path, folder: str) -> list[dict[str, Any]]:
    return [json.loads((out / folder / f"rank{r}.json").read_text()) for r in range(2)]


def _compressed(fixture: dict[str, Any]) -> list[str]:
    return [str(p["index"]) for p in fixture["parameters"] if not p["dense"]]


# ---------------------------------------------------------------------------------------- tests
def test_fixtures_match_the_generator() -> None:
    """The JSON sidecars describe the fits of ``FITS`` on 2 ranks, with momenta for every parameter."""
    for name in FIXTURES:
        fixture = _fixture(name)
        assert fixture["revision"] == "d65a308" and fixture["world_size"] == 2
        assert fixture["strategy"] == FITS[name]["strategy"] and fixture["optimizer"] == FITS[name]["optimizer"]
        assert fixture["global_step"] == FITS[name]["steps"]
        for r, entry in enumerate(fixture["per_rank"]):
            assert entry["rank"] == r and "demo_momentum" in entry["per_rank_keys"]
            assert sorted(entry["demo_momentum"], key=int) == [str(p["index"]) for p in fixture["parameters"]]
        saved = torch.load(DATA / fixture["checkpoint"], map_location="cpu", weights_only=True)
        per_rank = saved["optimizer_states"][0]["demo_lightning"]["per_rank"]
        assert all("demo_momentum" in e and "demo_exchange" not in e for e in per_rank)  # the old layout


@pytest.mark.parametrize("name", FIXTURES)
def test_each_rank_gets_its_own_momentum_back_bitwise(launch: Path, name: str) -> None:
    fixture = _fixture(name)
    ranks = _ranks(launch, name)
    for r, run in enumerate(ranks):
        restored, saved = run["restored"], fixture["per_rank"][r]["demo_momentum"]
        assert restored["global_step"] == fixture["global_step"], r
        for index, want in saved.items():
            assert restored["has_momentum"][int(index)], (r, index)
            assert restored["momentum_shape"][index] == want["shape"] and restored["momentum_dtype"][index] == want["dtype"], (r, index)
            assert restored["momentum"][index] == want["sha256"], f"rank {r}, parameter {index}: restored momentum is not the saved one"
    # negative control: the ranks' momenta differ (each got ITS OWN back, not rank 0's)
    hashes = [run["restored"]["momentum"][MIX_WEIGHT] for run in ranks]
    assert hashes[0] != hashes[1]
    assert fixture["per_rank"][0]["demo_momentum"][MIX_WEIGHT]["sha256"] != fixture["per_rank"][1]["demo_momentum"][MIX_WEIGHT]["sha256"]
    for index in _compressed(fixture):
        assert ranks[0]["restored"]["momentum"][index] != ranks[1]["restored"]["momentum"][index], index


@pytest.mark.parametrize("name", FIXTURES)
def test_parameters_after_restore_are_the_saved_ones(launch: Path, name: str) -> None:
    fixture = _fixture(name)
    ranks = _ranks(launch, name)
    for r, run in enumerate(ranks):
        assert run["restored"]["params"] == fixture["per_rank"][r]["param_sha256"], r
    assert ranks[0]["restored"]["params"] == ranks[1]["restored"]["params"]
    assert fixture["per_rank"][0]["param_sha256"] == fixture["per_rank"][1]["param_sha256"]


@pytest.mark.parametrize("name", FIXTURES)
def test_training_continues_with_identical_replicas(launch: Path, name: str) -> None:
    fixture = _fixture(name)
    ranks = _ranks(launch, name)
    start, steps = fixture["global_step"], FITS[name]["steps"]
    for r, run in enumerate(ranks):
        assert [s["global_step"] for s in run["steps"]] == list(range(start + 1, start + steps + 1)), r
        assert run["final_global_step"] == start + steps
        assert all(math.isfinite(float(s["loss"])) for s in run["steps"]), r
        assert run["restored"]["skipped_steps"] == fixture["skipped_steps"] == 0
        assert all(s["skipped_steps"] == 0 for s in run["steps"]), r
        hashes = [run["restored"]["params"]] + [s["params"] for s in run["steps"]]
        assert all(a != b for a, b in zip(hashes, hashes[1:])), f"rank {r}: a step left the parameters unchanged"
        assert all(all(s["has_momentum"]) for s in run["steps"]), r
    for a, b in zip(*(run["steps"] for run in ranks)):
        assert a["params"] == b["params"], f"replicas differ after global step {a['global_step']}"
    # the ranks see different data, so their losses and (compressed) momenta differ
    assert [s["loss"] for s in ranks[0]["steps"]] != [s["loss"] for s in ranks[1]["steps"]]
    assert ranks[0]["steps"][0]["momentum"][MIX_WEIGHT] != ranks[1]["steps"][0]["momentum"][MIX_WEIGHT]


@pytest.mark.parametrize("name", FIXTURES)
def test_restored_momenta_drive_the_first_new_step(launch: Path, name: str) -> None:
    """Negative control: resumed alike but with the momenta cleared at train start, the first new
    step comes out differently (so the checks above see the restored momenta at work)."""
    real, cleared = _ranks(launch, name), _ranks(launch, f"{name}-cleared")
    for r in range(2):
        assert cleared[r]["restored"] == real[r]["restored"], r  # the same restore, cleared afterwards
        assert cleared[r]["steps"][0]["params"] != real[r]["steps"][0]["params"], r
    assert cleared[0]["steps"][0]["params"] == cleared[1]["steps"][0]["params"]


def test_desloc_schedule_continues_from_the_checkpoint(launch: Path) -> None:
    fixture = _fixture(DESLOC)
    every_x = fixture["strategy"]["param_sync_every"]
    every_m = fixture["strategy"]["state_sync_every"]["demo_momentum"]
    ranks = _ranks(launch, DESLOC)
    for r, run in enumerate(ranks):
        saved = fixture["per_rank"][r]["desloc"]
        (restored,) = run["restored"]["desloc"]
        assert restored["step_count"] == saved["step_count"] == fixture["global_step"], r
        assert restored["syncs"] == restored["stats_syncs"] == saved["syncs"], r
        assert restored["params_synced_at"] == saved["params_synced_at"], r
        for step in run["steps"]:
            (schedule,) = step["desloc"]
            t = step["global_step"]  # no skipped steps: local step = global step
            assert schedule["step_count"] == t, (r, t)
            want = {"params": t // every_x, "state/demo_momentum": t // every_m}
            assert schedule["syncs"] == schedule["stats_syncs"] == want, (r, t)
            assert schedule["params_synced_at"] == every_x * (t // every_x), (r, t)
    # the momentum averages took place: the ranks' momenta are equal right after them only
    for a, b in zip(*(run["steps"] for run in ranks)):
        averaged = a["global_step"] % every_m == 0
        for index in _compressed(fixture):
            assert (a["momentum"][index] == b["momentum"][index]) == averaged, (a["global_step"], index)


@pytest.mark.parametrize("name", FIXTURES)
def test_new_checkpoint_has_layout_version_2_and_each_ranks_state(launch: Path, name: str) -> None:
    fixture = _fixture(name)
    ranks = _ranks(launch, name)
    saved = torch.load(launch / name / "resumed.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == fixture["global_step"] + FITS[name]["steps"]
    (state,) = saved["optimizer_states"]
    assert all("demo_momentum" not in s for s in state["state"].values()), "momenta in the shared optimizer state"
    extra = state["demo_lightning"]  # the new checkpoint is sharded: each rank's state in its own file
    assert extra["layout"] == "shards" and extra["world_size"] == 2 and "per_rank" not in extra
    shards = [torch.load(launch / name / f"resumed.ckpt.shards/rank{r}.pt", map_location="cpu", weights_only=True) for r in range(2)]
    assert [s["rank"] for s in shards] == [0, 1]
    per_rank = [s["optimizers"][0] for s in shards]
    for r, entry in enumerate(per_rank):
        assert "demo_momentum" not in entry, r
        momentum = entry["demo_exchange"]["momentum"]
        assert momentum["version"] == 2, r
        assert sorted(momentum["momenta"]) == [p["index"] for p in fixture["parameters"]], r
        live = ranks[r]["final_state"]
        assert live["version"] == 2
        for index, e in momentum["momenta"].items():
            assert e["layout"] == live["momenta"][str(index)]["layout"], (r, index)
            assert sha256_of(e["value"]) == live["momenta"][str(index)]["sha256"], f"rank {r}, parameter {index}: not this rank's state"
        if name == DESLOC:
            assert entry["desloc"]["step_count"] == saved["global_step"], r
    mix = [per_rank[r]["demo_exchange"]["momentum"]["momenta"][int(MIX_WEIGHT)]["value"] for r in range(2)]
    assert not torch.equal(mix[0], mix[1])  # each rank's own
    # compressed tensors are stored as spectra now: the layout names the tiling, not the parameter's shape
    for p in fixture["parameters"]:
        entry = per_rank[0]["demo_exchange"]["momentum"]["momenta"][p["index"]]
        assert (entry["layout"] is None) == p["dense"], p
