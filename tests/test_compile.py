"""``torch.compile``: a compiled LightningModule trains under ``strategy="demo"`` and ``"desloc"``.

``Trainer.fit(torch.compile(model))`` hands Lightning an ``OptimizedModule``; Lightning 2.6
(``lightning.pytorch.utilities.compile.from_compiled``) unwraps it to the original LightningModule,
sets ``_compiler_ctx`` and replaces that instance's ``forward`` / ``training_step`` /
``validation_step`` / ``test_step`` / ``predict_step`` with the compiled (dynamo-wrapped) methods;
``_verify_strategy_supports_compile`` accepts any ``DDPStrategy`` subclass, so ours. Nothing
re-compiles later: no strategy code touches ``_compiler_ctx``, and our ``configure_ddp`` neither
wraps the module nor recompiles; it broadcasts rank 0's parameters in place, before the first
(lazy) compile. The strategy then calls ``lightning_module.training_step``, the compiled one; the
guard, the exchange / averaging and the optimizer step run eagerly around it.

All fits are ``tests/compile_run.py`` (tiny GPT, every rank seeded differently, 6 optimizer
steps) in a 2-process launch under a hard timeout; each rank records per optimizer step a digest of
its parameters, the loss, the bytes sent, whether the loss's backward runs through a
``CompiledFunctionBackward`` node (so the compiled graph, not eager code, made this step's loss and
gradients) and dynamo's number of compiled graphs. Two launches:

* ``backend="aot_eager"`` (dynamo + AOTAutograd without code generation: traces and runs the same
  graphs as inductor would get, in ~5 s per fit): eager and compiled fits under both strategies,
  plus ``model.model.compile()`` (a submodule) and ``model.compile()`` (in place on the
  LightningModule). About 30 s on 2 idle CPU cores (60-90 s when other jobs share them).
* the default ``torch.compile(model)`` (inductor, C++ code generation into a private, cold cache):
  demo and desloc, about 50 s on 2 idle cores, up to ~125 s shared (the first fit compiles for ~25 s
  of CPU; the second hits the FX graph cache). Marked ``slow``, so out of CI: run it with
  ``pytest -m slow tests/test_compile.py``.
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
SCRIPT = HERE / "compile_run.py"
STEPS = 6  # compile_run.STEPS
DESLOC_PERIOD = 4  # compile_run.DESLOC_PERIOD: one sync mid-run (step 4), then local steps and the final sync
AOT_LAUNCH_TIMEOUT_S = 200
INDUCTOR_LAUNCH_TIMEOUT_S = 330
DESLOC = {"strategy": "desloc", "optimizer": "adamw", "lr": 3e-3}


def _launch(out: Path, fits: list[dict[str, Any]], timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Run the fits on 2 processes (one launch) under a hard timeout; each fit's per-rank results."""
    out.mkdir(parents=True, exist_ok=True)
    env = clean_env()
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["TORCHINDUCTOR_CACHE_DIR"] = str(out / "inductor-cache")  # cold and private: compiles really happen here
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--fits", json.dumps(fits), "--timeout", "60"]
    code, output = run_launch(cmd, env, out, SCRIPT, timeout)
    assert code == 0, output[-6000:]
    return {f["name"]: [torch.load(out / f["name"] / f"rank{r}.pt", weights_only=False) for r in range(2)] for f in fits}


@pytest.fixture(scope="module")
def aot(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    fits = [
        {"name": "eager-demo", "strategy": "demo"},
        {"name": "compiled-demo", "strategy": "demo", "compile": "torch.compile", "backend": "aot_eager"},
        {"name": "eager-desloc", **DESLOC},
        {"name": "compiled-desloc", **DESLOC, "compile": "torch.compile", "backend": "aot_eager"},
        {"name": "submodule-demo", "strategy": "demo", "compile": "submodule", "backend": "aot_eager"},
        {"name": "module-compile-demo", "strategy": "demo", "compile": "module.compile", "backend": "aot_eager"},
    ]
    return _launch(tmp_path_factory.mktemp("compile-aot"), fits, AOT_LAUNCH_TIMEOUT_S)


def _assert_compiled_training(ranks: list[dict[str, Any]]) -> None:
    """Every step's loss and gradients came from a compiled graph, compiled once (no recompiling every
    step), the replicas started different, trained (loss down) and nothing was skipped."""
    assert ranks[0]["initial"] != ranks[1]["initial"]  # the broadcast, not the seed, makes them equal
    for r in ranks:
        assert r["global_step"] == STEPS and len(r["digests"]) == STEPS
        assert r["compiler_ctx"] and r["is_lightning_module"]  # Lightning's from_compiled unwrapped it
        assert r["compiled_backward"] == [True] * STEPS, r["compiled_backward"]
        assert 0 < r["graphs"][-1] <= 4 and r["graphs"][STEPS // 2] == r["graphs"][-1], r["graphs"]
        assert len(set(r["digests"])) == STEPS  # the parameters moved at every step
        assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]
        assert r["skipped_steps"] == 0


def _assert_matches_eager(compiled: list[dict[str, Any]], eager: list[dict[str, Any]], rtol: float, atol: float) -> None:
    """The same training as the eager fit: same bytes on the wire, losses and final weights within tolerance."""
    for c, e in zip(compiled, eager):
        assert e["compiled_backward"] == [False] * STEPS  # negative control: eager really is eager
        assert c["sent"] == e["sent"]
        torch.testing.assert_close(torch.tensor(c["losses"]), torch.tensor(e["losses"]), rtol=rtol, atol=atol)
        assert c["params"].keys() == e["params"].keys()
        for name, tensor in c["params"].items():
            torch.testing.assert_close(tensor, e["params"][name], rtol=rtol, atol=atol, msg=name)


def test_compiled_module_under_demo_keeps_replicas_bitwise_equal_every_step(aot: dict[str, list[dict[str, Any]]]) -> None:
    ranks = aot["compiled-demo"]
    _assert_compiled_training(ranks)
    assert ranks[0]["digests"] == ranks[1]["digests"]  # after every optimizer step
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own data
    _assert_matches_eager(ranks, aot["eager-demo"], rtol=1e-5, atol=1e-6)


def test_compiled_module_under_desloc_is_equal_after_each_sync_and_at_the_end(aot: dict[str, list[dict[str, Any]]]) -> None:
    ranks = aot["compiled-desloc"]
    _assert_compiled_training(ranks)
    equal = [a == b for a, b in zip(ranks[0]["digests"], ranks[1]["digests"])]
    # local steps between syncs (replicas differ), equal right after every param sync
    assert equal == [(step + 1) % DESLOC_PERIOD == 0 for step in range(STEPS)], equal
    assert not equal[-1] and ranks[0]["final"] == ranks[1]["final"]  # the final sync after the last (local) step
    _assert_matches_eager(ranks, aot["eager-desloc"], rtol=1e-5, atol=1e-6)


def test_compiling_a_submodule_works_but_model_compile_on_the_lightning_module_stays_eager(
    aot: dict[str, list[dict[str, Any]]],
) -> None:
    # model.model.compile(): the GPT's __call__ is compiled, training_step calls it
    sub = aot["submodule-demo"]
    assert sub[0]["digests"] == sub[1]["digests"]
    for r in sub:
        assert r["compiled_backward"] == [True] * STEPS and not r["compiler_ctx"]
    # model.compile() compiles only the LightningModule's __call__ (forward); Lightning calls
    # training_step directly and GPTLightningModule.training_step never calls self(...): nothing is
    # compiled, training runs eagerly (as under Lightning's own DDPStrategy), and silently
    whole = aot["module-compile-demo"]
    assert whole[0]["digests"] == whole[1]["digests"]
    for r in whole:
        assert r["compiled_backward"] == [False] * STEPS and r["graphs"][-1] == 0 and not r["compiler_ctx"]


def test_model_compile_on_the_lightning_module_is_warned_about(aot: dict[str, list[dict[str, Any]]]) -> None:
    rank0 = aot["module-compile-demo"][0]
    assert any("torch.compile(model)" in w for w in rank0["warnings"]), rank0["warnings"]
    for name in ("compiled-demo", "submodule-demo", "eager-demo"):
        assert not any("torch.compile(model)" in w for w in aot[name][0]["warnings"]), name


def _have_cpp_compiler() -> bool:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:
        return False
    return True


@pytest.mark.slow  # 50-125 s of C++ code generation on 2 cores: run it with -m slow (see the README)
@pytest.mark.timeout(INDUCTOR_LAUNCH_TIMEOUT_S + 60)
@pytest.mark.skipif(not _have_cpp_compiler(), reason="inductor on CPU needs a C++ compiler")
def test_default_inductor_compile_trains_under_demo_and_desloc(tmp_path: Path) -> None:
    fits = [
        {"name": "inductor-demo", "strategy": "demo", "compile": "torch.compile"},  # torch.compile(model): inductor
        {"name": "inductor-desloc", **DESLOC, "compile": "torch.compile"},
        {"name": "eager-demo", "strategy": "demo"},
        {"name": "eager-desloc", **DESLOC},
    ]
    runs = _launch(tmp_path, fits, INDUCTOR_LAUNCH_TIMEOUT_S)
    demo, desloc = runs["inductor-demo"], runs["inductor-desloc"]
    for ranks in (demo, desloc):
        _assert_compiled_training(ranks)
        for r in ranks:  # inductor generated code (or, in the second fit, took it from the FX graph cache)
            assert r["inductor"].get("fxgraph_cache_miss", 0) + r["inductor"].get("fxgraph_cache_hit", 0) > 0, r["inductor"]
    assert demo[0]["digests"] == demo[1]["digests"]
    equal = [a == b for a, b in zip(desloc[0]["digests"], desloc[1]["digests"])]
    assert equal == [(step + 1) % DESLOC_PERIOD == 0 for step in range(STEPS)], equal
    assert not equal[-1] and desloc[0]["final"] == desloc[1]["final"]
    # inductor's fused kernels round differently from eager: close, not bitwise
    _assert_matches_eager(demo, runs["eager-demo"], rtol=1e-3, atol=1e-4)
    _assert_matches_eager(desloc, runs["eager-desloc"], rtol=1e-3, atol=1e-4)


@pytest.mark.timeout(300)
def test_the_readme_compile_command_trains_with_identical_replicas(tmp_path: Path) -> None:
    """``python examples/own_module.py --compile``, here with the aot_eager backend (inductor's C++
    build is the slow test above): both ranks end with the same parameters."""
    import re

    example = Path(__file__).parent.parent / "examples" / "own_module.py"
    env = clean_env()
    env["MASTER_PORT"] = str(free_port())
    code, output = run_launch([sys.executable, str(example), "--compile", "aot_eager", "--max-steps", "4"], env, tmp_path, example, timeout=240)
    assert code == 0, output[-4000:]
    hashes = dict(re.findall(r"rank (\d): params (\w+)", output))
    assert set(hashes) == {"0", "1"} and hashes["0"] == hashes["1"], output[-2000:]
