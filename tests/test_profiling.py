"""Named stage ranges (``demo_lightning.profiling``): ranges, sinks and the stage timer alone; the
exchange's, the averager's and the codec's ranges in one process; and profiled 2-process Lightning
fits whose per-rank Chrome traces (``PyTorchProfiler``) and reports (``SimpleProfiler``) list them."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch.profiler import profile

from demo_lightning import profiling
from demo_lightning.algorithms import CodecConfig, CompressedMean, DeMoConfig, DeMoExchange
from demo_lightning.algorithms.desloc import DesLocAverager, DesLocConfig
from demo_lightning.algorithms.guard import GUARD_TAG, NonFiniteGuard
from demo_lightning.algorithms.participants import StepContext, run_step
from demo_lightning.comm import Communicator
from demo_lightning.profiling import (
    CODEC,
    DEMO,
    StageTimes,
    add_sink,
    lightning_sink,
    measure_stages,
    registered_sinks,
    sinks,
    stage_range,
)
from dist_helpers import clean_env, free_port, run_launch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


class Log:
    """A sink that records every entry and exit."""

    def __init__(self, label: str = "") -> None:
        self.label, self.events = label, []

    def __call__(self, name: str) -> Any:
        log = self

        class _Cm:
            def __enter__(self) -> None:
                log.events.append(("enter", name))

            def __exit__(self, *exc: Any) -> None:
                log.events.append(("exit", name))

        return _Cm()


@pytest.fixture(autouse=True)
def no_leftover_sinks() -> Iterator[None]:
    assert registered_sinks() == ()
    yield
    assert registered_sinks() == (), "a test left a sink registered"


# ------------------------------------------------------------------------------------ ranges and sinks
def test_without_a_sink_or_a_profiler_a_range_is_one_shared_no_op() -> None:
    assert stage_range("a") is stage_range("b")  # nothing allocated, nothing entered
    with stage_range("a"):
        pass
    log = Log()
    with add_sink(log):
        assert stage_range("a") is not stage_range("a")
    assert stage_range("a") is stage_range("b")  # removed: back to the no-op


def test_sinks_are_entered_in_order_exited_in_reverse_and_removed() -> None:
    first, second = Log(), Log()
    with sinks(first, second):
        assert registered_sinks() == (first, second)
        with stage_range("x"):
            first.events.append(("inside", "x"))
    assert first.events == [("enter", "x"), ("inside", "x"), ("exit", "x")]
    assert second.events == [("enter", "x"), ("exit", "x")]
    handle = add_sink(first)
    twice = add_sink(first)  # the same sink twice: entered twice, each handle removes its own
    with stage_range("y"):
        pass
    handle.remove()
    handle.remove()  # idempotent
    assert not handle.active and registered_sinks() == (first,)
    twice.remove()
    with stage_range("z"):
        pass
    assert first.events[3:] == [("enter", "y"), ("enter", "y"), ("exit", "y"), ("exit", "y")]
    with pytest.raises(TypeError, match="callable"):
        add_sink("not a sink")  # type: ignore[arg-type]


def test_an_exception_inside_a_range_still_closes_it_everywhere() -> None:
    log = Log()
    with measure_stages() as times, sinks(log), profile() as prof:
        with pytest.raises(ValueError, match="boom"):
            with stage_range("outer"):
                with stage_range("outer/inner"):
                    raise ValueError("boom")
        with stage_range("after"):
            pass
    assert log.events == [("enter", "outer"), ("enter", "outer/inner"), ("exit", "outer/inner"), ("exit", "outer"),
                          ("enter", "after"), ("exit", "after")]
    assert times.calls == {"outer": 1, "outer/inner": 1, "after": 1}
    assert times._frames() == []  # nothing left open: "after" is outermost again
    assert times.total == pytest.approx(times.seconds("outer") + times.seconds("after"))
    names = [e.name for e in prof.events()]
    assert {"outer", "outer/inner", "after"} <= set(names)


def test_a_sink_that_fails_to_enter_leaves_the_others_closed() -> None:
    log = Log()

    def broken(name: str) -> Any:
        raise RuntimeError("sink down")

    with sinks(log, broken):
        with pytest.raises(RuntimeError, match="sink down"):
            with stage_range("x"):
                pytest.fail("the body must not run")
    assert log.events == [("enter", "x"), ("exit", "x")]


def test_stage_times_are_inclusive_and_exclusive_over_nested_ranges() -> None:
    with measure_stages() as times:
        with stage_range("step"):
            time.sleep(0.01)
            for _ in range(2):
                with stage_range("step/part"):
                    time.sleep(0.01)
                    with stage_range("step/part"):  # the same name nested: counted once inclusively
                        time.sleep(0.005)
        with stage_range("other"):
            time.sleep(0.002)
    assert times.calls == {"step": 1, "step/part": 4, "other": 1}
    step, part = times.seconds("step"), times.seconds("step/part")
    assert part >= 0.03 and step >= part + 0.01
    # exclusive times add up to the time inside any range, without double counting
    assert sum(times.exclusive.values()) == pytest.approx(times.total, rel=1e-9, abs=1e-9)
    assert times.total == pytest.approx(step + times.seconds("other"))
    assert times.seconds("step", exclusive=True) == pytest.approx(step - part, rel=1e-9, abs=1e-9)
    assert times.seconds("never") == 0.0
    snap = times.snapshot()
    times.reset()
    assert snap["calls"]["step/part"] == 4 and times.calls == {} and times.total == 0.0


def test_stage_times_call_sync_at_every_entry_and_exit_and_keep_threads_apart() -> None:
    calls = []
    times = StageTimes(sync=lambda: calls.append(1))
    barrier = threading.Barrier(2)

    def work() -> None:
        barrier.wait()
        for _ in range(50):
            with stage_range("t"):
                with stage_range("t/inner"):
                    pass

    with add_sink(times):
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert times.calls == {"t": 100, "t/inner": 100} and len(calls) == 2 * 200  # 200 ranges, a sync at each end
    assert times.total == pytest.approx(times.seconds("t"))


def test_lightning_sink_reports_to_simple_profilers_only() -> None:
    from lightning.pytorch.profilers import PassThroughProfiler, PyTorchProfiler, SimpleProfiler

    assert lightning_sink(None) is None
    assert lightning_sink(PassThroughProfiler()) is None  # Trainer's default: records nothing
    assert lightning_sink(PyTorchProfiler()) is None  # already sees the record_function ranges
    simple = SimpleProfiler()
    sink = lightning_sink(simple)
    assert sink is not None
    with sinks(sink):
        with stage_range(DEMO.encode), stage_range(DEMO.transform):
            pass
    assert set(simple.recorded_durations) == {DEMO.encode, DEMO.transform}


def test_range_names_are_hierarchical_constants() -> None:
    assert DEMO.all() == ("demo/encode", "demo/encode/transform", "demo/encode/select", "demo/transport",
                          "demo/transport/pack", "demo/transport/unpack", "demo/decode", "demo/decode/scatter_add",
                          "demo/decode/inverse")
    assert CODEC.transform == "codec/encode/transform" and profiling.DEMO_ENCODE == "demo/encode"
    assert profiling.GUARD_NONFINITE == GUARD_TAG
    assert profiling.desloc_sync_state("exp_avg") == "desloc/sync/state/exp_avg"


# ------------------------------------------------------------------------------ the library's ranges
def _exchange_step(profiled: bool = True) -> tuple[set[str], StageTimes]:
    """One guarded DeMo exchange plus a DES-LOC sync of the parameters and the momentum, world size 1."""
    model = torch.nn.Sequential(torch.nn.Linear(72, 40), torch.nn.Linear(40, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = Communicator()
    exchange = DeMoExchange(opt, DeMoConfig(CodecConfig(chunk=32, topk=4, dense_below=100)), comm)
    guard = NonFiniteGuard(lambda: list(model.parameters()), comm, "skip", exchange)
    averager = DesLocAverager(opt, DesLocConfig(param_sync_every=1, state_sync_every={"demo_momentum": 1}), comm)
    averager.add_state_source("demo_momentum", exchange.averaged_state)
    participants = [guard, averager, exchange]
    model(torch.randn(3, 72)).sum().backward()
    run_step(participants, opt.step, StepContext(loss=torch.tensor(1.0)))  # the momentum exists from here on
    model(torch.randn(3, 72)).sum().backward()
    with measure_stages() as times, profile() as prof:
        run_step(participants, opt.step, StepContext(loss=torch.tensor(1.0)))
    return {e.name for e in prof.events()}, times


def test_an_exchange_step_opens_every_stage_range_nested_as_documented() -> None:
    names, times = _exchange_step()
    expected = {profiling.GUARD_NONFINITE, profiling.DEMO_EXCHANGE, *DEMO.all(), profiling.DESLOC_SYNC,
                profiling.DESLOC_SYNC_PARAMS, profiling.desloc_sync_state("demo_momentum")}
    assert expected <= names, sorted(n for n in names if "/" in n)
    assert expected <= set(times.calls)
    # nesting: the stages lie inside the exchange, the fine ranges inside their stage
    assert times.seconds(profiling.DEMO_EXCHANGE) >= times.seconds(DEMO.encode) + times.seconds(DEMO.decode)
    assert times.seconds(DEMO.encode) >= times.seconds(DEMO.transform) + times.seconds(DEMO.select)
    assert times.seconds(DEMO.transport) >= times.seconds(DEMO.unpack)
    assert times.seconds(profiling.DESLOC_SYNC) >= times.seconds(profiling.DESLOC_SYNC_PARAMS)
    assert times.total == pytest.approx(sum(times.seconds(n) for n in profiling.OUTERMOST), rel=1e-9)
    # per family and bucket, not per tensor: one transform and one inverse range for the whole step
    assert times.calls[DEMO.transform] == times.calls[DEMO.inverse] == times.calls[DEMO.select] == 1


def test_the_compressed_sync_opens_the_codec_ranges_inside_desloc_sync_params() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(72, 40), torch.nn.Linear(40, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = DesLocAverager(opt, DesLocConfig(param_sync_every=1, state_sync_every={}, compress_params=True,
                                                codec=CodecConfig(chunk=32, topk=4, dense_below=100)), Communicator())
    model(torch.randn(3, 72)).sum().backward()
    opt.step()
    with measure_stages() as times:
        averager.after_step()
        averager.final_sync()  # the last step ended on a sync: nothing to do, no range
    assert set(CODEC.all()) <= set(times.calls)
    assert times.seconds(profiling.DESLOC_SYNC_PARAMS) >= times.seconds(CODEC.encode) + times.seconds(CODEC.decode)
    assert profiling.DESLOC_FINAL not in times.calls
    # the unpacking runs while the sums draw the contributions: exclusive times keep them apart
    assert times.seconds(CODEC.scatter_add) >= times.seconds(CODEC.unpack) > 0
    assert times.calls[CODEC.inverse] == 2  # the mean, and what this worker sent


def test_final_sync_and_clipping_have_their_ranges() -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = DesLocAverager(opt, DesLocConfig(param_sync_every=4, state_sync_every={}, clip_grad_norm=1.0), Communicator())
    model(torch.randn(2, 8)).sum().backward()
    with measure_stages() as times:
        averager.before_step()
        opt.step()
        averager.after_step()
        assert averager.final_sync()
    assert times.calls == {profiling.DESLOC_CLIP: 1, profiling.DESLOC_FINAL: 1}


@pytest.mark.parametrize("value_format", ["sign", "int8"])
def test_a_timed_exchange_step_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch, value_format: str) -> None:
    """Sinks and the timer read no tensor: an exchange step under ``measure_stages`` and a logging
    sink still has no ``.item()``, ``.tolist()``, ``bool(t)``, ... (each would synchronise with a GPU)."""
    model = torch.nn.Sequential(torch.nn.Linear(72, 40), torch.nn.Linear(40, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exchange = DeMoExchange(opt, DeMoConfig(CodecConfig(chunk=32, topk=4, value_format=value_format, dense_below=100)))
    model(torch.randn(3, 72)).sum().backward()
    exchange.step()
    model(torch.randn(3, 72)).sum().backward()

    def refuse(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"host read in the exchange step: Tensor.{name}")
        return call

    log = Log()
    with measure_stages() as times, sinks(log):
        for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, refuse(name))
        exchange.step(plan_agreed=True)
        monkeypatch.undo()
    assert times.calls[profiling.DEMO_EXCHANGE] == 1 and ("exit", profiling.DEMO_EXCHANGE) in log.events


def test_the_codec_benchmark_reads_its_in_step_breakdown_from_the_ranges() -> None:
    spec = importlib.util.spec_from_file_location("codec_benchmark", ROOT / "benchmarks" / "codec.py")
    assert spec is not None and spec.loader is not None
    codec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codec)
    x = torch.randn(96, 160, generator=torch.Generator().manual_seed(0))
    mean = CompressedMean(CodecConfig(chunk=32, topk=8, dense_below=0, dense_vectors=False), Communicator())
    found = codec.step_breakdown(mean, x, 1e-3, 0.0, torch.device("cpu"))
    parts = found["parts_s"]
    assert set(parts) == {*codec.IN_STEP, "rest"} and found["steps"] == 3
    assert all(parts[column] > 0 for column in codec.IN_STEP), parts
    assert sum(parts.values()) == pytest.approx(found["step_s"])
    assert registered_sinks() == ()


# --------------------------------------------------------------------------- profiled 2-process fits
def _launch(out: Path, profiler: str, *extra: str) -> None:
    env = clean_env()
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    script = HERE / "profiling_run.py"
    code, output = run_launch([sys.executable, str(script), "--out", str(out), "--profiler", profiler, *extra],
                              env, out, script, timeout=150)
    if code != 0 or not all((out / f"rank{r}.done").exists() for r in range(2)):
        pytest.fail(f"the profiled fit failed (exit {code}):\n{output[-4000:]}")


STAGES = {"guard/nonfinite", "demo/exchange", "demo/encode", "demo/transport", "demo/decode", "desloc/sync",
          "demo/encode/transform", "demo/encode/select", "demo/transport/pack", "demo/transport/unpack",
          "demo/decode/scatter_add", "demo/decode/inverse", "desloc/sync/params"}


def test_a_profiled_two_process_fit_has_the_stage_ranges_in_every_ranks_chrome_trace(tmp_path: Path) -> None:
    _launch(tmp_path, "pytorch")
    for rank in range(2):
        traces = list(tmp_path.glob(f"fit-trace-{rank}-*.pt.trace.json"))
        assert len(traces) == 1, sorted(p.name for p in tmp_path.iterdir())
        events = json.loads(traces[0].read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert STAGES <= names, (rank, sorted(n for n in names if isinstance(n, str) and n.startswith(("demo", "desloc", "guard"))))
        # every recorded step (warm-up left out) ran each stage; DES-LOC synced every second step
        counts = {n: sum(e.get("name") == n for e in events) for n in ("demo/exchange", "desloc/sync", "guard/nonfinite")}
        assert counts["demo/exchange"] == counts["guard/nonfinite"] >= 4 and counts["desloc/sync"] >= 2, counts


def test_a_simple_profiler_two_process_fit_reports_the_stages_per_rank(tmp_path: Path) -> None:
    """The strategy reports the stage ranges to ``trainer.profiler`` (``lightning_sink``, ``add_sink``)."""
    _launch(tmp_path, "simple")
    for rank in range(2):
        report_path = tmp_path / f"fit-simple-{rank}.txt"
        if not report_path.exists():
            pytest.fail(f"no SimpleProfiler report for rank {rank}: {sorted(p.name for p in tmp_path.iterdir())}")
        report = report_path.read_text()
        if "run_training_batch" not in report:
            pytest.fail(f"rank {rank}'s report lists none of Lightning's own actions:\n{report[:2000]}")
        missing = sorted(name for name in STAGES if f"|  {name} " not in report)
        assert not missing, f"rank {rank}'s SimpleProfiler report lacks {missing}"
