"""The byte ledger: every collective's payload and its modeled traffic on the wire.

Wire models (per worker, for ``W`` workers, payload ``P`` bytes handed in by each worker):

* ring all-gather: each worker sends and receives ``(W - 1) * P``;
* ring all-reduce of ``N`` bytes: each worker sends and receives ``2 * (W - 1) / W * N``
  (reduce-scatter, then all-gather);
* broadcast of ``N`` bytes along a ring from the root: every worker but the last forwards ``N``,
  every worker but the root receives ``N``.

The DDP baseline is what Lightning's ``DDPStrategy`` moves for the same model: a ring all-reduce
of every trainable parameter's gradient per optimizer step, each in its parameter's dtype,
``2 * (W - 1) / W * sum(numel * element_size)`` bytes per worker (``4 * n_trainable`` for fp32). The ratio reported is
``DDP bytes sent / our bytes sent`` (``100`` means 100x fewer bytes).

Links: every record carries its link class (``"intra"`` inside a node, ``"inter"`` across nodes)
and the share of its sent bytes charged to the inter-node link, which the communicator derives
from its :class:`~demo_lightning.comm.topology.NodeTopology`; DDP's baseline on the inter-node link
is its all-reduce charged the same way (``1 / G`` of its bytes per rank on ``G`` ranks per node).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from demo_lightning.comm.topology import Link

__all__ = [
    "CollectiveRecord",
    "ByteLedger",
    "StepTraffic",
    "TagTotals",
    "ddp_bytes_for",
    "ddp_bytes_per_step",
    "human_bytes",
    "ring_all_gather_bytes",
    "ring_all_reduce_bytes",
]

CollectiveOp = Literal["all_gather", "all_reduce", "broadcast"]
_SI_UNITS = ("B", "kB", "MB", "GB", "TB")


def human_bytes(nbytes: float) -> str:
    """``nbytes`` as a decimal SI size for people: ``"999 B"``, ``"62.4 kB"``, ``"1.5 MB"``.

    Units step by 1000 (B, kB, MB, GB, TB; sizes beyond stay in TB): whole bytes below 1 kB, one
    decimal from kB up. The unit is chosen after rounding, so 999,960 bytes read ``"1.0 MB"``,
    never ``"1000.0 kB"``. Raises ``ValueError`` for anything but a finite, non-negative number.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"human_bytes expects a finite, non-negative byte count, got {nbytes!r}")
    if round(nbytes) < 1000:
        return f"{round(nbytes)} B"
    for power, unit in enumerate(_SI_UNITS[1:], start=1):
        text = f"{nbytes / 1000.0**power:.1f}"
        if float(text) < 1000.0 or unit == _SI_UNITS[-1]:
            return f"{text} {unit}"
    raise AssertionError("unreachable: the last unit always returns")


def ring_all_gather_bytes(payload_bytes: int, world_size: int) -> float:
    """Bytes each worker sends (and receives) in a ring all-gather of ``payload_bytes`` per worker."""
    return float((world_size - 1) * payload_bytes)


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> float:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def ddp_bytes_per_step(n_trainable: int, world_size: int, grad_bytes: int = 4) -> float:
    """Bytes per worker per optimizer step of DDP's gradient all-reduce (fp32 by default)."""
    return ring_all_reduce_bytes(n_trainable * grad_bytes, world_size)


def ddp_bytes_for(params: Iterable[Any], world_size: int) -> float:
    """DDP's gradient all-reduce per worker per optimizer step for these trainable parameters.

    DDP reduces each gradient in its parameter's dtype: 4 bytes an element for fp32 parameters
    (``"32-true"``, and ``"bf16-mixed"``, whose parameters stay fp32), 2 for ``"bf16-true"`` or
    ``"16-true"``, 8 for float64.
    """
    return ring_all_reduce_bytes(sum(p.numel() * p.element_size() for p in params), world_size)


def _modeled(op: CollectiveOp, payload_bytes: int, world_size: int, rank: int, root: int) -> tuple[float, float]:
    if world_size <= 1:
        return 0.0, 0.0
    if op == "all_gather":
        both = ring_all_gather_bytes(payload_bytes, world_size)
        return both, both
    if op == "all_reduce":
        both = ring_all_reduce_bytes(payload_bytes, world_size)
        return both, both
    last = (root - 1) % world_size
    sent = 0.0 if rank == last else float(payload_bytes)
    received = 0.0 if rank == root else float(payload_bytes)
    return sent, received


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective call as this worker saw it: ``inter_node_bytes`` of its ``sent_bytes``
    are charged to the inter-node link (0 for a group inside one node)."""

    op: CollectiveOp
    tag: str
    payload_bytes: int
    sent_bytes: float
    received_bytes: float
    world_size: int
    link: Link = "intra"
    inter_node_bytes: float = 0.0

    @property
    def intra_node_bytes(self) -> float:
        return self.sent_bytes - self.inter_node_bytes


@dataclass
class TagTotals:
    """Cumulative totals of one tag."""

    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0
    received_bytes: float = 0.0
    inter_node_bytes: float = 0.0


@dataclass(frozen=True)
class StepTraffic:
    """Traffic of one optimizer step on this worker, with the DDP baseline for the same model."""

    sent_bytes: float
    received_bytes: float
    payload_bytes: int
    calls: int
    ddp_bytes: float
    inter_node_bytes: float = 0.0
    ddp_inter_node_bytes: float = 0.0

    @property
    def intra_node_bytes(self) -> float:
        """Sent bytes that stay inside the node."""
        return self.sent_bytes - self.inter_node_bytes

    @property
    def ratio_vs_ddp(self) -> float:
        """How many times fewer bytes than DDP this step sent (1 when neither sends anything)."""
        return _ratio(self.ddp_bytes, self.sent_bytes)

    @property
    def inter_node_ratio_vs_ddp(self) -> float:
        """How many times fewer bytes than DDP this step put on the inter-node link."""
        return _ratio(self.ddp_inter_node_bytes, self.inter_node_bytes)


def _ratio(ddp_bytes: float, sent_bytes: float) -> float:
    if sent_bytes > 0:
        return ddp_bytes / sent_bytes
    return 1.0 if ddp_bytes == 0 else float("inf")


@dataclass
class ByteLedger:
    """Records every collective; keeps cumulative totals per tag and the records of the open step.

    ``begin_step`` / ``end_step`` bracket the collectives of one optimizer step; collectives outside
    a step (the initial broadcast, checkpoint gathers) only count in the cumulative totals. Windows
    nest: an inner pair (an algorithm's own) reports what the step has recorded so far, and only the
    outermost ``end_step`` closes the step.
    """

    rank: int = 0
    totals: dict[str, TagTotals] = field(default_factory=dict)
    step_records: list[CollectiveRecord] = field(default_factory=list)
    last_step: StepTraffic | None = None
    steps: int = 0
    steps_sent_bytes: float = 0.0
    steps_received_bytes: float = 0.0
    steps_ddp_bytes: float = 0.0
    steps_inter_node_bytes: float = 0.0
    steps_ddp_inter_node_bytes: float = 0.0
    payload_by_link: dict[str, int] = field(default_factory=lambda: {"intra": 0, "inter": 0})
    """Bytes handed to collectives, by the link class of their group (all calls, steps or not)."""
    _depth: int = 0

    def record(
        self, op: CollectiveOp, tag: str, payload_bytes: int, world_size: int, root: int = 0, per_step: bool = True,
        *, rank: int | None = None, link: Link = "intra", inter_share: float = 0.0,
    ) -> CollectiveRecord:
        """Record one collective of ``payload_bytes`` handed in by this worker (in the open step's
        traffic unless ``per_step`` is false; always in the totals).

        ``world_size``, ``root`` and ``rank`` are those of the group the collective ran over
        (``rank`` ``None``: :attr:`rank`; a collective over a subgroup passes this worker's rank in it).
        ``link`` is the group's link class and ``inter_share`` the fraction of the sent bytes charged
        to the inter-node link (:meth:`~demo_lightning.comm.topology.NodeTopology.inter_share`)."""
        if not 0.0 <= inter_share <= 1.0:
            raise ValueError(f"inter_share must be in [0, 1], got {inter_share!r}")
        sent, received = _modeled(op, payload_bytes, world_size, self.rank if rank is None else rank, root)
        rec = CollectiveRecord(op, tag, int(payload_bytes), sent, received, world_size, link, sent * inter_share)
        totals = self.totals.setdefault(tag, TagTotals())
        totals.calls += 1
        totals.payload_bytes += rec.payload_bytes
        totals.sent_bytes += sent
        totals.received_bytes += received
        totals.inter_node_bytes += rec.inter_node_bytes
        self.payload_by_link[link] = self.payload_by_link.get(link, 0) + rec.payload_bytes
        if self._depth > 0 and per_step:
            self.step_records.append(rec)
        return rec

    def begin_step(self) -> None:
        if self._depth == 0:
            self.step_records = []
        self._depth += 1

    def end_step(self, ddp_bytes: float, ddp_inter_node_bytes: float = 0.0) -> StepTraffic:
        """Close a window; ``ddp_bytes`` is DDP's traffic for the same step (for the ratio) and
        ``ddp_inter_node_bytes`` its share on the inter-node link."""
        if self._depth == 0:
            raise RuntimeError("end_step without begin_step")
        self._depth -= 1
        traffic = StepTraffic(
            sent_bytes=sum(r.sent_bytes for r in self.step_records),
            received_bytes=sum(r.received_bytes for r in self.step_records),
            payload_bytes=sum(r.payload_bytes for r in self.step_records),
            calls=len(self.step_records),
            ddp_bytes=ddp_bytes,
            inter_node_bytes=sum(r.inter_node_bytes for r in self.step_records),
            ddp_inter_node_bytes=ddp_inter_node_bytes,
        )
        if self._depth == 0:
            self.steps += 1
            self.last_step = traffic
            self.steps_sent_bytes += traffic.sent_bytes
            self.steps_received_bytes += traffic.received_bytes
            self.steps_ddp_bytes += ddp_bytes
            self.steps_inter_node_bytes += traffic.inter_node_bytes
            self.steps_ddp_inter_node_bytes += ddp_inter_node_bytes
        return traffic

    @property
    def cumulative_ratio_vs_ddp(self) -> float:
        """DDP's bytes over all closed steps divided by ours: the saving of a periodic schedule."""
        return _ratio(self.steps_ddp_bytes, self.steps_sent_bytes)

    @property
    def cumulative_inter_node_ratio_vs_ddp(self) -> float:
        """DDP's inter-node bytes over all closed steps divided by ours."""
        return _ratio(self.steps_ddp_inter_node_bytes, self.steps_inter_node_bytes)

    @property
    def total_sent_bytes(self) -> float:
        return sum(t.sent_bytes for t in self.totals.values())

    @property
    def total_received_bytes(self) -> float:
        return sum(t.received_bytes for t in self.totals.values())

    @property
    def total_payload_bytes(self) -> int:
        return sum(t.payload_bytes for t in self.totals.values())
