"""Byte ledger: wire models, per-step windows and totals."""

from __future__ import annotations

import pytest

from demo_lightning.comm import ByteLedger, Communicator, ddp_bytes_per_step, ring_all_gather_bytes, ring_all_reduce_bytes


def test_ring_models() -> None:
    assert ring_all_gather_bytes(100, 1) == 0
    assert ring_all_gather_bytes(100, 4) == 300
    assert ring_all_reduce_bytes(400, 2) == 400
    assert ring_all_reduce_bytes(400, 4) == 600
    assert ddp_bytes_per_step(1000, 2) == 4000


def test_records_totals_and_step_window() -> None:
    ledger = ByteLedger(rank=1)
    ledger.record("broadcast", "setup", 80, world_size=4, root=0)
    ledger.begin_step()
    ledger.record("all_gather", "demo/topk", 100, world_size=4)
    ledger.record("all_reduce", "demo/dense", 40, world_size=4)
    step = ledger.end_step(ddp_bytes=6000)
    assert step.calls == 2 and step.payload_bytes == 140
    assert step.sent_bytes == 300 + 60 and step.received_bytes == 300 + 60
    assert step.ratio_vs_ddp == pytest.approx(6000 / 360)
    assert ledger.totals["setup"].received_bytes == 80 and ledger.totals["setup"].sent_bytes == 80
    assert ledger.total_payload_bytes == 220
    root = ByteLedger(rank=0)
    root.record("broadcast", "setup", 80, world_size=4, root=0)
    assert root.totals["setup"].received_bytes == 0
    last = ByteLedger(rank=3)
    last.record("broadcast", "setup", 80, world_size=4, root=0)
    assert last.totals["setup"].sent_bytes == 0


def test_single_process_communicator_is_identity_and_recorded() -> None:
    import torch

    comm = Communicator()
    buf = torch.arange(10, dtype=torch.uint8)
    gathered = comm.all_gather_bytes(buf, "t")
    assert gathered.is_completed()  # no process group: nothing to wait for
    assert gathered.wait()[0] is buf and gathered.wait()[0] is buf  # wait() is idempotent
    x = torch.ones(3)
    reduced = comm.all_reduce_sum_(x, "r")
    assert reduced.is_completed() and reduced.wait() is x and torch.equal(x, torch.ones(3))
    assert comm.ledger.total_payload_bytes == 10 + 12
    assert comm.ledger.total_sent_bytes == 0
    with pytest.raises(ValueError, match="uint8"):
        comm.all_gather_bytes(torch.ones(2), "t")


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"), (1, "1 B"), (999, "999 B"), (999.4, "999 B"), (999.6, "1.0 kB"), (1000, "1.0 kB"),
        (62425, "62.4 kB"), (62425.0, "62.4 kB"), (999_949, "999.9 kB"), (999_960, "1.0 MB"), (1.5e6, "1.5 MB"),
        (2.34e9, "2.3 GB"), (7.5e12, "7.5 TB"), (3e15, "3000.0 TB"),
    ],
)
def test_human_bytes_uses_decimal_si_units(nbytes: float, text: str) -> None:
    from demo_lightning.comm.ledger import human_bytes

    assert human_bytes(nbytes) == text


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "62425", None])
def test_human_bytes_rejects_what_is_not_a_byte_count(bad: object) -> None:
    from demo_lightning.comm.ledger import human_bytes

    with pytest.raises(ValueError, match="byte count"):
        human_bytes(bad)  # type: ignore[arg-type]
