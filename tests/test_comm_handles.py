"""The Communicator's collectives return handles and take a process group per call, on real gloo processes.

* handles started back to back and waited in reverse order give the right values, each collective
  recorded once (at launch) with its group's world size;
* a subgroup passed per call: sums, gathers and broadcasts over its members only, ranks within it,
  the ledger's world size and broadcast traffic those of the subgroup, non-members refused;
* a world of one (no process group, or a group of one): handles complete at once;
* a peer that never joins: ``wait()`` raises ``CollectiveError`` after the collective timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from demo_lightning.comm import CollectiveError, CollectiveWork, Communicator

from dist_helpers import run_workers

pytestmark = pytest.mark.timeout(300)


def _records(comm: Communicator) -> dict[str, tuple[int, int, float, float]]:
    return {tag: (t.calls, t.payload_bytes, t.sent_bytes, t.received_bytes) for tag, t in comm.ledger.totals.items()}


# ---------------------------------------------------------------------------- (a) async handles, waited in reverse order
def _reverse_order_worker(rank: int, world: int) -> dict[str, Any]:
    comm = Communicator(timeout=timedelta(seconds=30))
    comm.ledger.begin_step()
    x = torch.full((5,), float(rank + 1), dtype=torch.float64)
    buf = torch.full((3,), 10 + rank, dtype=torch.uint8)
    y = torch.full((4,), float(100 * rank), dtype=torch.float32)
    reduce = comm.all_reduce_sum_(x, "h/reduce")
    gather = comm.all_gather_bytes(buf, "h/gather")
    bcast = comm.broadcast_(y, "h/broadcast", src=world - 1)
    recorded_at_launch = [(r.op, r.tag, r.world_size) for r in comm.ledger.step_records]
    handles = (reduce, gather, bcast)
    assert all(isinstance(h, CollectiveWork) for h in handles)
    broadcast = bcast.wait()
    gathered = gather.wait()
    reduced = reduce.wait()
    traffic = comm.ledger.end_step(0.0)
    return {
        "recorded_at_launch": recorded_at_launch,
        "reduced": reduced.tolist(), "reduced_is_input": reduced is x,
        "gathered": [g.tolist() for g in gathered],
        "broadcast": broadcast.tolist(), "broadcast_is_input": broadcast is y,
        "idempotent": reduce.wait() is reduced and gather.wait() is gathered and bcast.wait() is broadcast,
        "completed": [h.is_completed() for h in handles],
        "records": _records(comm), "calls": traffic.calls, "seconds": comm.seconds,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_handles_started_back_to_back_and_waited_in_reverse_order(tmp_path: Path, world: int) -> None:
    results = run_workers(_reverse_order_worker, world, tmp_path, timeout=120, collective_timeout=30)
    total = float(sum(range(1, world + 1)))
    for rank, r in enumerate(results):
        assert r["recorded_at_launch"] == [
            ("all_reduce", "h/reduce", world), ("all_gather", "h/gather", world), ("broadcast", "h/broadcast", world),
        ]
        assert r["reduced"] == [total] * 5 and r["reduced_is_input"]
        assert r["gathered"] == [[10 + q] * 3 for q in range(world)]
        assert r["broadcast"] == [float(100 * (world - 1))] * 4 and r["broadcast_is_input"]
        assert r["idempotent"] and r["completed"] == [True, True, True]
        assert r["calls"] == 3  # each recorded once, though waited on twice
        records = r["records"]
        assert set(records) == {"h/reduce", "h/gather", "h/broadcast"}
        assert records["h/reduce"] == (1, 40, 2 * (world - 1) / world * 40, 2 * (world - 1) / world * 40)
        assert records["h/gather"] == (1, 3, 3.0 * (world - 1), 3.0 * (world - 1))
        root, last = world - 1, world - 2
        assert records["h/broadcast"] == (1, 16, 0.0 if rank == last else 16.0, 0.0 if rank == root else 16.0)
        assert r["seconds"] > 0.0


# ---------------------------------------------------------------------------- (b) a per-call subgroup
def _subgroup_worker(rank: int, world: int, members: list[int]) -> dict[str, Any]:
    comm = Communicator(timeout=timedelta(seconds=30))
    sub = dist.new_group(members)  # every rank creates it, members or not
    comm.ledger.begin_step()
    out: dict[str, Any] = {"rank_in": comm.rank_in(sub), "world_size_of": comm.world_size_of(sub),
                           "own": (comm.rank_in(None), comm.world_size_of(None))}
    if rank in members:
        src = len(members) - 1  # a rank within the subgroup: global rank members[-1]
        reduce = comm.all_reduce_sum_(torch.full((3,), float(rank + 1)), "sub/reduce", group=sub)
        gather = comm.all_gather_bytes(torch.full((2,), rank, dtype=torch.uint8), "sub/gather", group=sub)
        bcast = comm.broadcast_(torch.full((2,), float(rank)), "sub/broadcast", src=src, group=sub)
        out["completed_at_once"] = [h.is_completed() for h in (reduce, gather, bcast)] if len(members) == 1 else None
        out["broadcast"] = bcast.wait().tolist()
        out["gathered"] = [g.tolist() for g in gather.wait()]
        out["reduced"] = reduce.wait().tolist()
        out["objects"] = comm.all_gather_object({"rank": rank}, "sub/object", group=sub)
        comm.check_same([1, 2, 3], "sub/check", "a fixed list", group=sub)
        tensors = [torch.full((2,), float(rank)), torch.full((3,), rank, dtype=torch.int64)]
        comm.broadcast_tensors_(tensors, "sub/tensors", src=src, group=sub)
        out["tensors"] = [t.tolist() for t in tensors]
        out["world_sizes"] = [(r.tag, r.world_size) for r in comm.ledger.step_records]
    else:
        try:
            comm.all_reduce_sum_(torch.ones(2), "sub/outsider", group=sub)
            out["outsider"] = "no error"
        except ValueError as error:
            out["outsider"] = str(error)
    # every rank is still aligned on the default group, which the communicator uses without group=
    out["after"] = comm.all_reduce_sum_(torch.ones(1), "world/after").wait().tolist()
    out["records"] = _records(comm)
    return out


@pytest.mark.parametrize(("world", "members"), [(3, [1, 2]), (2, [1])])
def test_collectives_over_a_per_call_subgroup(tmp_path: Path, world: int, members: list[int]) -> None:
    results = run_workers(_subgroup_worker, world, tmp_path, members, timeout=120, collective_timeout=30)
    size = len(members)
    src_global = members[-1]
    for rank, r in enumerate(results):
        assert r["own"] == (rank, world)
        assert r["after"] == [float(world)]
        records = r["records"]
        assert records["world/after"][0] == 1
        if rank not in members:
            assert (r["rank_in"], r["world_size_of"]) == (-1, -1)
            assert "not a member of the process group passed as group=" in r["outsider"], r["outsider"]
            assert set(records) == {"world/after"}  # the refused call was not recorded
            continue
        sub_rank = members.index(rank)
        assert (r["rank_in"], r["world_size_of"]) == (sub_rank, size)
        assert r["reduced"] == [float(sum(m + 1 for m in members))] * 3  # the members' sum only
        assert r["gathered"] == [[m, m] for m in members]  # in the subgroup's rank order
        assert r["broadcast"] == [float(src_global)] * 2  # src is a subgroup rank
        assert r["objects"] == [{"rank": m} for m in members]
        assert r["tensors"] == [[float(src_global)] * 2, [src_global] * 3]
        if size == 1:
            assert r["completed_at_once"] == [True, True, True]
        objects = ["sub/object/sizes", "sub/object"] if size > 1 else ["sub/object"]  # a world of one sends no sizes
        tags = ["sub/reduce", "sub/gather", "sub/broadcast", *objects, "sub/tensors", "sub/tensors"]
        assert r["world_sizes"] == [(tag, size) for tag in tags]  # check_same: not per step
        assert records["sub/reduce"] == (1, 12, 2 * (size - 1) / size * 12, 2 * (size - 1) / size * 12)
        assert records["sub/gather"] == (1, 2, 2.0 * (size - 1), 2.0 * (size - 1))
        # the broadcast's modeled traffic uses the rank within the subgroup (root: its last rank)
        root, last = size - 1, (size - 2) % size
        expected_sent = 0.0 if size == 1 or sub_rank == last else 8.0
        expected_received = 0.0 if size == 1 or sub_rank == root else 8.0
        assert records["sub/broadcast"] == (1, 8, expected_sent, expected_received)


# ---------------------------------------------------------------------------- (c) a world of one
def test_world_of_one_without_a_process_group_hands_back_completed_handles() -> None:
    comm = Communicator()
    assert not comm.distributed and comm.rank_in(None) == 0 and comm.world_size_of(None) == 1
    buf = torch.arange(4, dtype=torch.uint8)
    x, y = torch.ones(3), torch.full((2,), 7.0)
    handles = [comm.all_gather_bytes(buf, "one/g"), comm.all_reduce_sum_(x, "one/r"), comm.broadcast_(y, "one/b")]
    assert all(isinstance(h, CollectiveWork) and h.is_completed() for h in handles)
    gathered, reduced, broadcast = (h.wait() for h in handles)
    assert len(gathered) == 1 and gathered[0] is buf
    assert reduced is x and torch.equal(x, torch.ones(3))
    assert broadcast is y and torch.equal(y, torch.full((2,), 7.0))
    assert handles[0].wait() is gathered  # idempotent
    assert [(r.calls, r.sent_bytes) for r in comm.ledger.totals.values()] == [(1, 0.0)] * 3
    assert comm.broadcast_tensors_([torch.zeros(2)], "one/t") is None
    assert comm.all_gather_object({"a": 1}, "one/o") == [{"a": 1}]
    assert comm.check_same([1, 2], "one/c", "a list") is None
    assert CollectiveWork.completed(5).is_completed() and CollectiveWork.completed(5).wait() == 5


def _one_rank_worker(rank: int, world: int) -> dict[str, Any]:
    comm = Communicator()
    x = torch.ones(2)
    work = comm.all_reduce_sum_(x, "one/r")
    out = {"completed": work.is_completed(), "value": work.wait().tolist(), "same": work.wait() is x}
    try:
        comm.all_reduce_sum_(torch.ones(1, device="meta"), "one/meta")  # the device check still runs at launch
        out["meta"] = "no error"
    except ValueError as error:
        out["meta"] = str(error)
    return out


def test_world_of_one_with_a_process_group_hands_back_completed_handles(tmp_path: Path) -> None:
    (r,) = run_workers(_one_rank_worker, 1, tmp_path, timeout=60, collective_timeout=30)
    assert r["completed"] and r["value"] == [1.0, 1.0] and r["same"]
    assert "all_reduce 'one/meta' on rank 0 got a tensor on meta" in r["meta"]


# ---------------------------------------------------------------------------- (d) a peer that never joins
def _never_joins_worker(rank: int, world: int, out_dir: str, timeout_s: float) -> dict[str, Any]:
    out = Path(out_dir)
    comm = Communicator(timeout=timedelta(seconds=timeout_s))
    if rank == world - 1:  # never joins the collective; waits until the others gave up (or a hard limit)
        deadline = time.monotonic() + timeout_s + 60
        while time.monotonic() < deadline and not all((out / f"failed{r}").exists() for r in range(world - 1)):
            time.sleep(0.1)
        return {"joined": False}
    start = time.perf_counter()
    work = comm.all_reduce_sum_(torch.ones(4), "h/lost")
    launched = time.perf_counter() - start
    completed_before = work.is_completed()
    result: dict[str, Any] = {"joined": True, "launched_s": launched, "completed_before": completed_before}
    try:
        work.wait()
        result["error"] = None
    except CollectiveError as error:
        result["error"] = str(error)
        result["cause"] = type(error.__cause__).__name__
        try:
            work.wait()
            result["again"] = "no error"
        except CollectiveError as again:
            result["again"] = "same" if again is error else str(again)
    result["waited_s"] = time.perf_counter() - start
    result["seconds"] = comm.seconds
    result["completed_after"] = work.is_completed()
    (out / f"failed{rank}").write_text("done")
    return result


@pytest.mark.parametrize("world", [2, 3])
def test_a_peer_that_never_joins_makes_wait_raise_within_the_timeout(tmp_path: Path, world: int) -> None:
    timeout_s = 4.0
    flags = tmp_path / "flags"
    flags.mkdir()
    results = run_workers(
        _never_joins_worker, world, tmp_path / "ranks", str(flags), timeout_s, timeout=timeout_s + 90, collective_timeout=timeout_s,
    )
    assert results[-1] == {"joined": False}
    for rank, r in enumerate(results[:-1]):
        assert r["launched_s"] < timeout_s / 2, r  # launching does not wait for the peer
        assert not r["completed_before"]
        assert r["error"] is not None, "wait() returned although a peer never joined"
        assert r["error"].startswith(f"all_reduce 'h/lost' failed on rank {rank} of {world} after "), r["error"]
        assert f"collective timeout ({timeout_s:g} s)" in r["error"] and "a peer stopped answering" in r["error"], r["error"]
        assert r["cause"] != "NoneType"  # the backend's error is kept
        assert r["again"] == "same"  # a second wait raises the same error
        assert timeout_s * 0.6 < r["waited_s"] < timeout_s + 30, r
        assert r["seconds"] >= timeout_s * 0.6  # the waiting counts in the communicator's seconds
        assert r["completed_after"]


def test_an_interrupted_wait_leaves_the_handle_pending() -> None:
    """Only a backend error (a ``RuntimeError``) completes a handle as failed; an interrupt while
    waiting (KeyboardInterrupt) propagates and a later ``wait()`` waits again."""
    from demo_lightning.comm import CollectiveWork, Communicator

    class _Work:
        def __init__(self) -> None:
            self.calls = 0

        def wait(self) -> None:
            self.calls += 1
            if self.calls == 1:
                raise KeyboardInterrupt

        def is_completed(self) -> bool:
            return self.calls > 1

    backend = _Work()
    work: CollectiveWork[str] = CollectiveWork("done", backend, communicator=Communicator(), op="all_reduce", tag="t")
    with pytest.raises(KeyboardInterrupt):
        work.wait()
    assert not work.is_completed()
    assert work.wait() == "done" and backend.calls == 2 and work.is_completed()
