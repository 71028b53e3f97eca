"""Transport stage: one bucket of selected coefficients onto the wire and back, as every rank's contribution.

A transport is any object with :meth:`Transport.start`: it puts a bucket's runs in its wire
format, launches one collective through the :class:`~demo_lightning.comm.Communicator` (which
records it in the ledger) and returns a :class:`PendingBucket` at once. The pending bucket knows
what this worker sent, as every receiver will decode it (:attr:`PendingBucket.sent`, for error
feedback), and, once waited on, yields the contributions to sum, in a fixed order that is the same
on every rank. Encode and decode do not depend on which transport runs.

* :class:`AllGatherTransport` (``"topk"``, and ``"lowpass"`` with int8/sign values): positions
  (bit-packed, only when they vary; once per position group, in its first member's segment) and
  values in the value format, one ``uint8`` buffer per rank; contributions are every rank's, rank
  order 0..W-1.
* :class:`AllReduceTransport` (``"shared"``, and ``"lowpass"`` with float values): the values at
  positions every rank shares (the leader's, or the fixed low frequencies) in the wire dtype,
  summed by one all-reduce; each value saturates at
  :func:`~demo_lightning.codec.saturation_limit` for ``W`` summands, so the sum stays finite and the
  excess stays in the sender's residual. One contribution: the sum.

Profiling: packing one bucket runs inside the stage range ``<names>/transport/pack``, and unpacking
inside ``<names>/transport/unpack`` (an all-gather: one range per run of each rank's part of the
bucket, closed before the run is yielded; an all-reduce: one per bucket), where ``names`` is the
user's :class:`~demo_lightning.profiling.StageNames` (``demo`` for the exchange, ``codec`` by
default). The collective's launch and wait are the caller's (its ``transport`` range).

Failure: a collective that does not complete raises :class:`~demo_lightning.comm.CollectiveError`
from :meth:`PendingBucket.wait` or :meth:`PendingBucket.contributions` (which waits first) after
the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from demo_lightning.algorithms.config import CodecConfig
from demo_lightning.algorithms.stages.plan import Run
from demo_lightning.codec import pack_segments, position_coding, saturate, unpack_segments
from demo_lightning.comm import CollectiveWork, Communicator
from demo_lightning.profiling import CODEC, StageNames, stage_range

__all__ = ["AllGatherTransport", "AllReduceTransport", "Contribution", "Outgoing", "PendingBucket", "Transport", "transport_for"]


@dataclass
class Outgoing:
    """One run's selection on this worker: ``(tiles of the run, k)`` each."""

    run: Run
    positions: Tensor
    values: Tensor


@dataclass
class Contribution:
    """Coefficients to add into the mean: ``positions`` ``None`` means this worker's own (fixed) ones."""

    run: Run
    positions: Optional[Tensor]
    values: Tensor


class PendingBucket(Protocol):
    sent: list[Tensor]
    """Per run of the bucket, this worker's values as every receiver decodes them."""

    def wait(self) -> None:
        """Block until the collective has completed (idempotent; :meth:`contributions` calls it)."""
        ...

    def contributions(self) -> Iterator[Contribution]:
        """Wait for the collective; yield what to sum, in the same order on every rank."""
        ...


class Transport(Protocol):
    """Moves one bucket (see the module docstring)."""

    def start(self, bucket: Sequence[Outgoing], tag: str) -> PendingBucket: ...


class _GatheredBucket:
    def __init__(
        self, outgoing: Sequence[Outgoing], sent: list[Tensor], work: CollectiveWork, config: CodecConfig, names: StageNames,
    ) -> None:
        self.outgoing, self.sent, self.work, self.config, self.names = outgoing, sent, work, config, names

    def wait(self) -> None:
        self.work.wait()

    def contributions(self) -> Iterator[Contribution]:
        cfg = self.config
        for rank_buf in self.work.wait():  # rank order 0..W-1 on every replica
            offset = 0
            for out in self.outgoing:  # one run at a time (the peak is one run decoded), lazily
                run = out.run
                with stage_range(self.names.unpack):  # closed before the yield: no range stays open across it
                    shared = cfg.sends_positions and run.shares_positions
                    positions, values = unpack_segments(
                        rank_buf[offset : offset + run.nbytes], run.tiles, run.family.k, run.family.tile_numel,
                        cfg.value_format, run.positioned if shared else cfg.sends_positions, cfg.fp16_share, cfg.position_format,
                    )
                    if shared:  # position groups: every member's rows from its carrier's
                        positions = positions.index_select(0, run.position_rows)  # type: ignore[union-attr]
                    contribution = Contribution(run, positions, values.to(out.values.dtype))
                offset += run.nbytes
                yield contribution


class AllGatherTransport:
    """Every rank's positions and values, all-gathered in one ``uint8`` buffer per bucket (over
    ``group``; ``None``: the communicator's own)."""

    def __init__(
        self, config: CodecConfig, communicator: Communicator, group: Optional[dist.ProcessGroup] = None, names: StageNames = CODEC,
    ) -> None:
        self.config, self.comm, self.group, self.names = config, communicator, group, names

    def start(self, bucket: Sequence[Outgoing], tag: str) -> PendingBucket:
        cfg = self.config
        buffers, sent = [], []
        with stage_range(self.names.pack):
            for out in bucket:
                run = out.run
                positions: Optional[Tensor] = out.positions if cfg.sends_positions else None
                positioned, wire_order = None, None
                if positions is not None and run.shares_positions:  # position groups: carriers' rows only
                    if position_coding(run.family.k, run.family.tile_numel, cfg.position_format) == "elias_fano":
                        wire_order = positions.argsort(dim=1)  # every row: members in their carrier's order
                    positions, positioned = positions.index_select(0, run.carrier_rows), run.positioned
                buf, decoded = pack_segments(positions, out.values, run.tiles, run.family.tile_numel, cfg.value_format,
                                             cfg.fp16_share, positioned, cfg.position_format, wire_order)
                buffers.append(buf)
                sent.append(decoded.to(out.values.dtype))
            payload = torch.cat(buffers) if len(buffers) > 1 else buffers[0]
        work = self.comm.all_gather_bytes(payload, f"{tag}/{'topk' if cfg.sends_positions else 'values'}", group=self.group)
        return _GatheredBucket(bucket, sent, work, cfg, self.names)


class _ReducedBucket:
    def __init__(
        self, outgoing: Sequence[Outgoing], sent: list[Tensor], flat: Tensor, work: CollectiveWork, names: StageNames,
    ) -> None:
        self.outgoing, self.sent, self.flat, self.work, self.names = outgoing, sent, flat, work, names

    def wait(self) -> None:
        self.work.wait()

    def contributions(self) -> Iterator[Contribution]:
        self.work.wait()
        offset = 0
        part = []
        with stage_range(self.names.unpack):  # the sum's runs, in the compute dtype
            for out in self.outgoing:
                n = out.values.numel()
                part.append(Contribution(out.run, None, self.flat[offset : offset + n].view_as(out.values).to(out.values.dtype)))
                offset += n
        yield from part


class AllReduceTransport:
    """Values at fixed positions in the wire dtype, summed by one all-reduce per bucket (over
    ``group``; ``None``: the communicator's own)."""

    def __init__(
        self, config: CodecConfig, communicator: Communicator, group: Optional[dist.ProcessGroup] = None, names: StageNames = CODEC,
    ) -> None:
        if not config.all_reduces:
            raise ValueError(
                f"an all-reduce needs selection='shared', or 'lowpass' with a float value_format, got {config.selection!r}/{config.value_format!r}"
            )
        self.config, self.comm, self.group, self.names = config, communicator, group, names

    def start(self, bucket: Sequence[Outgoing], tag: str) -> PendingBucket:
        parts, sent = [], []
        with stage_range(self.names.pack):
            for out in bucket:
                narrow = saturate(out.values, self.config.value_format, self.comm.world_size_of(self.group))
                sent.append(narrow.to(out.values.dtype))
                parts.append(narrow.reshape(-1))
            flat = torch.cat(parts)  # a fresh buffer: the all-reduce sums in place
        work = self.comm.all_reduce_sum_(flat, f"{tag}/{self.config.selection}", group=self.group)
        return _ReducedBucket(bucket, sent, flat, work, self.names)


def transport_for(
    config: CodecConfig, communicator: Communicator, group: Optional[dist.ProcessGroup] = None, names: StageNames = CODEC,
) -> Transport:
    """The transport the settings call for, over ``group`` (``None``: the communicator's own): an
    all-reduce for low-pass float values, else an all-gather; its pack and unpack ranges are named
    after ``names``."""
    kind = AllReduceTransport if config.all_reduces else AllGatherTransport
    return kind(config, communicator, group, names)
