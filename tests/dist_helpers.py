"""Run a function on several real processes with a process group (gloo unless told), under a hard timeout.

Each worker gets a fresh process (forked from a preloaded forkserver), its own process group on a free loopback port, one
CPU thread, and always destroys its group. A worker that raises makes the call fail with its
traceback; workers still alive at the deadline are killed and the call raises ``TimeoutError``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_LEAKY_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env() -> dict[str, str]:
    """This process's environment without the variables that make Lightning think it was launched externally."""
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY_ENV and not k.startswith(("PL_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _entry(target: Callable[..., Any], rank: int, world_size: int, port: int, out_dir: str, args: tuple, timeout_s: float,
           backend: str = "gloo") -> None:
    for key in _LEAKY_ENV:
        os.environ.pop(key, None)
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = target(rank, world_size, *args)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context() -> Any:
    """A forkserver whose server imported torch and our package once, so workers start without re-importing.

    Each worker is still a fresh fork of a process that only ran imports (no torch thread pools, no
    process group), and gets the parent's ``sys.path`` and main module exactly as ``spawn`` would.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "demo_lightning", "dist_helpers"])
    return ctx


def run_workers(target: Callable[..., Any], world_size: int, out_dir: Path, *args: Any, timeout: float = 120.0, collective_timeout: float = 60.0,
                backend: str = "gloo") -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` processes over a ``backend`` process group; return
    each rank's result."""
    ctx = _context()
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(target, rank, world_size, port, str(out_dir), args, collective_timeout, backend),
                    daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = {rank: (out_dir / f"rank{rank}.err").read_text() for rank in range(world_size) if (out_dir / f"rank{rank}.err").exists()}
    if errors:
        raise AssertionError("worker(s) failed:\n" + "\n".join(f"--- rank {r}\n{e}" for r, e in errors.items()))
    if alive:
        raise TimeoutError(f"rank(s) {alive} still running after {timeout} s (deadlock or desynchronised collectives?)")
    bad = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode != 0}
    if bad:
        raise AssertionError(f"worker exit codes {bad}")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def record_pid(out: Path) -> None:
    """In a launched worker: leave ``<out>/pids/rank<R>-<pid>`` so :func:`kill_launch` can find it."""
    (out / "pids").mkdir(parents=True, exist_ok=True)
    rank_hint = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    (out / "pids" / f"rank{rank_hint}-{os.getpid()}").touch()


def kill_launch(proc: Any, out: Path, script: Path) -> None:
    """Kill a launch's session and every worker of ``script`` it recorded (:func:`record_pid`;
    torchrun starts workers in new sessions), then reap the launch."""
    import signal

    for pid_file in (out / "pids").glob("rank*-*") if (out / "pids").exists() else []:
        pid = int(pid_file.name.rsplit("-", 1)[1])
        try:
            if script.name in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_launch(cmd: list[str], env: dict[str, str], out: Path, script: Path, timeout: float) -> tuple[int, str]:
    """Run a launch (a Lightning or torchrun command line) in its own session under a hard ``timeout``;
    always kill what is left of it and of ``script``'s workers (:func:`kill_launch`); returns its exit
    code and output. A launch still running after ``timeout`` fails the test."""
    import subprocess

    import pytest

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"launch in {out} still running after {timeout} s (a rank hung?)")
    finally:
        kill_launch(proc, out, script)
    return proc.returncode, output


class IdenticalWorkers:
    """A stand-in for ``world_size`` workers that all send this process's data, without processes:
    every collective goes through a one-process :class:`~demo_lightning.comm.Communicator` (so the
    ledger records it), then an all-gather returns ``world_size`` copies and an all-reduce ``world_size``
    times the input. Everything else (``check_same``, ``ledger``, ``rank``, ...) is the one-process
    communicator's."""

    def __init__(self, world_size: int) -> None:
        from demo_lightning.comm import Communicator

        self._comm = Communicator()
        self.world_size = world_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def all_gather_bytes(self, buffer: torch.Tensor, tag: str, *args: Any, **kwargs: Any) -> Any:
        from demo_lightning.comm import CollectiveWork

        gathered = self._comm.all_gather_bytes(buffer, tag, *args, **kwargs).wait()
        return CollectiveWork.completed([b.clone() for b in gathered * self.world_size])

    def all_reduce_sum_(self, tensor: torch.Tensor, tag: str, *args: Any, **kwargs: Any) -> Any:
        from demo_lightning.comm import CollectiveWork

        self._comm.all_reduce_sum_(tensor, tag, *args, **kwargs).wait()
        return CollectiveWork.completed(tensor.mul_(self.world_size))
