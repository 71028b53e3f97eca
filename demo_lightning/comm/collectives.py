"""The only module that calls ``torch.distributed`` collectives; every call goes to the ledger.

Collectives follow gloo's limits so the same code runs on CPU and on NCCL: all-gathers move one
``uint8`` buffer of equal size on every rank (gloo aborts on unequal sizes and has no int16), and
averages are SUM followed by a division (gloo has no ``ReduceOp.AVG``).

Handles: the primitive collectives (:meth:`~Communicator.all_gather_bytes`,
:meth:`~Communicator.all_reduce_sum_`, :meth:`~Communicator.broadcast_`) launch the collective at
once (``async_op=True``) and return a :class:`CollectiveWork`; its :meth:`~CollectiveWork.wait`
returns the result (the gathered buffers, the reduced or broadcast tensor) once the collective has
completed, so a caller can start several collectives back to back, compute meanwhile, and wait
for each where it needs it (in any order). Until ``wait`` returns, the tensors handed in and the
result must not be read or written. Every rank must still launch the same collectives in the same
order. The ledger records each collective once, when it is launched; :attr:`Communicator.seconds`
adds the time spent launching and waiting. ``wait`` is idempotent: a second call returns the same
result (or raises the same error). On NCCL, ``wait`` makes the current CUDA stream wait for the
collective (as a synchronous call does), it does not block the host. The composite operations
(:meth:`~Communicator.broadcast_tensors_`, :meth:`~Communicator.all_gather_object`,
:meth:`~Communicator.check_same`) wait for their collectives themselves and return as before.

Groups: every collective runs over the communicator's own group (:attr:`Communicator.group`)
unless its keyword-only ``group=`` names another process group (e.g. one from
``dist.new_group``, which every rank must create alike, members or not); only that group's
members may call it (others get ``ValueError``). The ledger records the world size of the group
used, ranks are the ranks within it (``broadcast_``'s ``src`` too; see
:meth:`~Communicator.rank_in` and :meth:`~Communicator.world_size_of`).

With a world of one (or no initialised process group) every collective is the identity and its
handle is already completed; the ledger still records the payload (its modeled wire bytes are
zero).

Devices: a :class:`Communicator` has one :attr:`~Communicator.device`, where every tensor it hands
to the backend must live (NCCL, which Lightning uses on GPUs, takes only CUDA tensors of the
rank's own device; gloo takes CPU tensors). It comes from the group's backend (the current CUDA
device for ``nccl``, CPU for ``gloo`` and the rest, CPU without a process group) unless the
constructor's ``device`` overrides it (e.g. a job whose parameters live on GPUs under gloo passes
their device: gloo takes CUDA tensors too, and the check below wants one device). Control messages
(layout checks, object gathers, the callbacks' reductions, the non-finite guard) are built on it;
data (momenta, parameters) is there because the parameters are. Whenever a process group exists
(a world of one included, so a one-GPU run checks what a multi-GPU run would send), every
collective first checks each tensor's device when it is launched and raises ``ValueError`` naming
the collective, its ledger tag and both devices, before the backend would fail or hang on it.

Failure: errors surface where a handle is waited on. A collective that does not complete makes
:meth:`CollectiveWork.wait` raise on every rank after the process group's timeout (set it with the
strategy's ``timeout``); nothing here retries. The backend's own error (gloo: ``Timed out waiting
1800000ms for recv operation``, or ``Connection closed by peer``), whether raised at launch or
while waiting, is re-raised by ``wait`` as :class:`CollectiveError`, whose message names the
collective, its ledger tag, this rank, the timeout and the likely causes; the backend's error is
kept as ``__cause__``. (Mistakes of the caller, a tensor on the wrong device, a buffer of the wrong
dtype, a rank outside the group, raise ``ValueError`` at launch.)
"""

from __future__ import annotations

import hashlib
import io
import time
from datetime import timedelta
from typing import Any, Generic, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch import Tensor

from demo_lightning.comm.ledger import ByteLedger, CollectiveOp
from demo_lightning.comm.topology import Link, NodeTopology

__all__ = ["CollectiveError", "CollectiveWork", "Communicator", "default_device"]

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective failed on this rank: a peer stopped answering (hung, blocked before the
    collective, much slower than the timeout), a peer process was lost, or the ranks ran different
    collectives. The backend's own error is the ``__cause__``."""


_TIMEOUT_WORDS = ("timed out", "timeout", "deadline")
_LOST_WORDS = ("connection closed", "connection reset", "broken pipe", "connection refused", "socket", "peer")


def default_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where collectives over ``group`` (``None``: the default group) take their tensors: the current
    CUDA device when its backend is NCCL (also a mixed ``"cpu:gloo,cuda:nccl"`` one), otherwise CPU;
    CPU when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _chained(error: CollectiveError, cause: BaseException) -> CollectiveError:
    error.__cause__ = cause
    error.__suppress_context__ = True
    return error


class CollectiveWork(Generic[T]):
    """A launched collective: :meth:`wait` returns its result once it has completed.

    Returned by :meth:`Communicator.all_gather_bytes` (``CollectiveWork[list[Tensor]]``),
    :meth:`Communicator.all_reduce_sum_` and :meth:`Communicator.broadcast_`
    (``CollectiveWork[Tensor]``, the tensor handed in). A handle of a collective that crossed no
    process (a world of one, no process group) is completed from the start; build one with
    :meth:`completed` (e.g. in a stand-in communicator).
    """

    __slots__ = ("_result", "_work", "_error", "_comm", "_op", "_tag", "_group", "_started", "_keep")

    def __init__(
        self,
        result: T,
        work: Optional[Any] = None,
        *,
        communicator: Optional["Communicator"] = None,
        op: str = "",
        tag: str = "",
        group: Optional[dist.ProcessGroup] = None,
        started: Optional[float] = None,
        error: Optional[CollectiveError] = None,
        keep: tuple[Any, ...] = (),
    ) -> None:
        if work is not None and communicator is None:
            raise ValueError("a CollectiveWork waiting on a backend work needs the communicator that launched it")
        self._result = result
        self._work = work  # the backend's torch.distributed.Work; None once waited on (or never any)
        self._error = error  # raised by every wait() once set
        self._comm = communicator
        self._op, self._tag, self._group = op, tag, group
        self._started = time.perf_counter() if started is None else started
        self._keep = keep  # the tensors the backend reads, alive until the collective completed

    @classmethod
    def completed(cls, result: T) -> "CollectiveWork[T]":
        """A handle that is already complete: :meth:`wait` returns ``result``."""
        return cls(result)

    def is_completed(self) -> bool:
        """Whether the collective has finished (successfully or not): :meth:`wait` would not block."""
        return self._work is None or bool(self._work.is_completed())

    def wait(self) -> T:
        """Block until the collective has completed and return its result (the same on every call).

        Raises :class:`CollectiveError` (the backend's error as ``__cause__``) if it failed or did
        not complete within the process group's timeout; every later call raises it again.
        """
        if self._work is not None:
            work, comm = self._work, self._comm
            assert comm is not None
            start = time.perf_counter()
            try:
                work.wait()
            except RuntimeError as error:  # torch.distributed.DistError and the backends' errors derive from it
                message = comm._failure_message(self._op, self._tag, time.perf_counter() - self._started, error, self._group)
                self._error = _chained(CollectiveError(message), error)
            except BaseException:  # interrupted while waiting (KeyboardInterrupt, ...): still pending, wait again later
                comm.seconds += time.perf_counter() - start
                raise
            comm.seconds += time.perf_counter() - start
            self._work, self._keep = None, ()
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "completed" if self.is_completed() else "pending"
        return f"CollectiveWork({self._op or 'identity'} {self._tag!r}, {state})"


class Communicator:
    """Collectives over one process group, each recorded in a :class:`ByteLedger`.

    Every collective can also run over another process group, passed per call as ``group=``
    (see the module docstring).

    Args:
        group: the process group (``None``: the default group, if initialised).
        ledger: where to record; a new ledger for this rank by default.
        timeout: the process group's collective timeout, named in error messages (``None``: unknown).
        device: where the collectives' tensors live (see the module docstring); ``None``:
            :func:`default_device` of ``group``. ``"cuda"`` without an index means the current one.
        topology: which ranks of the default group share a node, for the ledger's link classes
            (:mod:`~demo_lightning.comm.topology`); ``None``: every rank on one node.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        ledger: Optional[ByteLedger] = None,
        timeout: Optional[timedelta] = None,
        device: Union[torch.device, str, None] = None,
        topology: Optional[NodeTopology] = None,
    ) -> None:
        self.group = group
        self.timeout = timeout
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        if device is None:
            self.device = default_device(group)
        else:
            try:
                self.device = torch.device(device)
            except (RuntimeError, TypeError) as error:
                raise ValueError(f"Communicator device must be a torch.device or a device string such as 'cuda:0', got {device!r}") from error
            if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.ledger = ledger if ledger is not None else ByteLedger(rank=self.rank)
        self.ledger.rank = self.rank
        self.seconds = 0.0  # wall time spent inside collectives: launching them and waiting for them
        self.global_rank = dist.get_rank() if self.distributed else 0
        default_world = dist.get_world_size() if self.distributed else 1
        if topology is not None and not isinstance(topology, NodeTopology):
            raise ValueError(f"topology must be a NodeTopology or None, got {type(topology).__name__}")
        if topology is not None and topology.world_size != default_world:
            raise ValueError(
                f"topology describes {topology.world_size} ranks but the default process group has {default_world}; "
                "build it from the job's world size and processes per node"
            )
        self.topology = topology if topology is not None else NodeTopology.single_node(default_world)
        self._links: dict[int, tuple[Link, float]] = {}

    # ------------------------------------------------------------------ groups
    def _own(self, group: Optional[dist.ProcessGroup]) -> bool:
        return group is None or group is self.group

    def rank_in(self, group: Optional[dist.ProcessGroup]) -> int:
        """This process's rank within ``group`` (``None``: the communicator's own group); ``0``
        without a process group, ``-1`` if it is not a member (as ``dist.get_rank``)."""
        if self._own(group):
            return self.rank
        return dist.get_rank(group) if self.distributed else 0

    def world_size_of(self, group: Optional[dist.ProcessGroup]) -> int:
        """How many ranks ``group`` has (``None``: the communicator's own group); ``1`` without a
        process group, ``-1`` if this process is not a member (as ``dist.get_world_size``)."""
        if self._own(group):
            return self.world_size
        return dist.get_world_size(group) if self.distributed else 1

    def _resolve(self, op: str, tag: str, group: Optional[dist.ProcessGroup]) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """The process group a call runs over, this rank in it and its size; ``ValueError`` for a non-member."""
        if self._own(group):
            return self.group, self.rank, self.world_size
        rank, world = self.rank_in(group), self.world_size_of(group)
        if rank < 0 or world < 0:
            raise ValueError(
                f"{op} '{tag}' on rank {self.rank}: this process is not a member of the process group passed as group=; "
                "only its members may call its collectives (every rank creates the group, only members use it)"
            )
        return group, rank, world

    def _global_rank(self, group_rank: int, group: Optional[dist.ProcessGroup] = None) -> int:
        """The default group's rank of ``group``'s rank ``group_rank`` (``None``: the communicator's group)."""
        pg = self.group if group is None else group
        if pg is None:
            return group_rank
        return dist.get_global_rank(pg, group_rank)

    def link_of(self, group: Optional[dist.ProcessGroup] = None) -> tuple[Link, float]:
        """``(link class, inter-node share of this rank's sent bytes)`` of collectives over ``group``
        (``None``: the communicator's own), from :attr:`topology` (cached per group)."""
        pg = self.group if self._own(group) else group
        key = id(pg)
        found = self._links.get(key)
        if found is None:
            if not (self.distributed and dist.is_initialized()):
                ranks = [0]
            elif pg is None:
                ranks = list(range(dist.get_world_size()))
            else:
                ranks = list(dist.get_process_group_ranks(pg))
            found = self._links[key] = (self.topology.link_of(ranks), self.topology.inter_share(ranks, self.global_rank))
        return found

    def _record(self, op: CollectiveOp, tag: str, payload_bytes: int, world: int, rank: int,
                group: Optional[dist.ProcessGroup], *, root: int = 0, per_step: bool = True) -> None:
        link, share = self.link_of(group)
        self.ledger.record(op, tag, payload_bytes, world, root=root, per_step=per_step, rank=rank, link=link, inter_share=share)

    def active_in(self, group: Optional[dist.ProcessGroup]) -> bool:
        """Whether collectives over ``group`` (``None``: the communicator's own) actually cross processes."""
        return self.distributed and self.world_size_of(group) > 1

    # ------------------------------------------------------------------ failures
    def _failure_message(self, op: str, tag: str, seconds: float, error: BaseException, group: Optional[dist.ProcessGroup] = None) -> str:
        """What failed, where, after how long, and what to do about it."""
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        lowered = text.lower()
        limit = f"{self.timeout.total_seconds():g} s" if self.timeout is not None else "the process group's timeout"
        where = f"{op} '{tag}' failed on rank {self.rank} of {self.world_size}"
        if not self._own(group):
            where += f" (rank {self.rank_in(group)} of {self.world_size_of(group)} in the group it ran over)"
        where += f" after {seconds:.1f} s"
        if any(word in lowered for word in _TIMEOUT_WORDS):
            cause = (
                f"it did not complete within the collective timeout ({limit}): a peer stopped answering. Likely causes: a "
                "rank hangs or is blocked before this collective (a deadlock, a long checkpoint, validation or data loading "
                "on one rank only), a rank crashed without closing its connections, or the ranks ran different collectives "
                "(different models, settings or code paths). Check the other ranks' logs; if a peer is only slow, raise "
                "the strategy's timeout= (seconds)"
            )
        elif any(word in lowered for word in _LOST_WORDS):
            cause = (
                "the connection to a peer was lost: a peer process exited, crashed or was killed (check its logs), or the "
                f"network between the ranks failed. Collective timeout: {limit}"
            )
        else:
            cause = (
                "the backend raised an error; if another rank failed or called a different collective, its log names "
                f"the first cause. Collective timeout: {limit}"
            )
        return f"{where}: {cause}. Backend error: {text}"

    def _launch(
        self, op: str, tag: str, group: Optional[dist.ProcessGroup], result: T, fn: Any, /, *args: Any, **kwargs: Any,
    ) -> CollectiveWork[T]:
        """Start ``fn(*args, group=group, async_op=True, **kwargs)``; a launch error is raised by the handle's ``wait``."""
        start = time.perf_counter()
        try:
            work = fn(*args, group=group, async_op=True, **kwargs)
        except RuntimeError as error:  # as a failure while waiting: surfaces at wait()
            message = self._failure_message(op, tag, time.perf_counter() - start, error, group)
            return CollectiveWork(result, op=op, tag=tag, group=group, error=_chained(CollectiveError(message), error))
        finally:
            self.seconds += time.perf_counter() - start
        if work is None:  # torch.distributed's answer to a non-member; _resolve refuses those first
            return CollectiveWork(result, op=op, tag=tag, group=group)
        return CollectiveWork(result, work, communicator=self, op=op, tag=tag, group=group, started=start, keep=args)

    @property
    def active(self) -> bool:
        """Whether collectives over the communicator's own group actually cross processes."""
        return self.distributed and self.world_size > 1

    def _check_device(self, op: str, tag: str, tensor: Tensor) -> None:
        """Raise ``ValueError`` if ``tensor`` is not on :attr:`device` (whenever a process group exists)."""
        if self.distributed and tensor.device != self.device:
            raise ValueError(
                f"{op} '{tag}' on rank {self.rank} got a tensor on {tensor.device}, but this Communicator's collectives "
                f"run on {self.device} (its device attribute; process group backend {dist.get_backend(self.group)}). "
                "Build control tensors with device=communicator.device (and read results back with .cpu()), keep the "
                "exchanged parameters on that device, or pass Communicator(device=...) naming where they live"
            )

    # ------------------------------------------------------------------ primitive collectives: handles
    def all_gather_bytes(
        self, buffer: Tensor, tag: str, per_step: bool = True, *, group: Optional[dist.ProcessGroup] = None,
    ) -> CollectiveWork[list[Tensor]]:
        """Start an all-gather of one ``uint8`` buffer of the same size on every rank of ``group``
        (``None``: the communicator's own); ``wait()`` returns the buffers in the group's rank order.

        ``per_step=False`` keeps the call out of the open step's traffic (verification, not training).
        """
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(f"all_gather_bytes expects a 1-D uint8 buffer, got {buffer.dtype} {tuple(buffer.shape)}")
        self._check_device("all_gather", tag, buffer)
        pg, rank, world = self._resolve("all_gather", tag, group)
        self._record("all_gather", tag, buffer.numel(), world, rank, pg, per_step=per_step)
        if not (self.distributed and world > 1):
            return CollectiveWork.completed([buffer])
        out = [torch.empty_like(buffer) for _ in range(world)]
        return self._launch("all_gather", tag, pg, out, dist.all_gather, out, buffer.contiguous())

    def all_reduce_sum_(self, tensor: Tensor, tag: str, *, group: Optional[dist.ProcessGroup] = None) -> CollectiveWork[Tensor]:
        """Start summing ``tensor`` over the ranks of ``group`` (``None``: the communicator's own) in
        place; ``wait()`` returns it, bitwise identical on every rank."""
        self._check_device("all_reduce", tag, tensor)
        pg, rank, world = self._resolve("all_reduce", tag, group)
        self._record("all_reduce", tag, tensor.numel() * tensor.element_size(), world, rank, pg)
        if not (self.distributed and world > 1):
            return CollectiveWork.completed(tensor)
        return self._launch("all_reduce", tag, pg, tensor, dist.all_reduce, tensor, op=dist.ReduceOp.SUM)

    def broadcast_(
        self, tensor: Tensor, tag: str, src: int = 0, *, group: Optional[dist.ProcessGroup] = None,
    ) -> CollectiveWork[Tensor]:
        """Start overwriting ``tensor`` in place with the copy of ``group``'s rank ``src`` (a rank
        within ``group``; ``None``: the communicator's own group); ``wait()`` returns it."""
        self._check_device("broadcast", tag, tensor)
        pg, rank, world = self._resolve("broadcast", tag, group)
        active = self.distributed and world > 1
        if active and not 0 <= src < world:
            raise ValueError(f"broadcast '{tag}': src={src} is not a rank of the group it runs over (ranks 0 to {world - 1})")
        self._record("broadcast", tag, tensor.numel() * tensor.element_size(), world, rank, pg, root=src)
        if not active:
            return CollectiveWork.completed(tensor)
        return self._launch("broadcast", tag, pg, tensor, dist.broadcast, tensor, src=self._global_rank(src, pg))

    # ------------------------------------------------------------------ composite operations: synchronous
    def broadcast_tensors_(
        self, tensors: list[Tensor], tag: str, src: int = 0, *, group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """Overwrite every tensor with the copy of ``group``'s rank ``src``: one flat broadcast per
        dtype and device, all started before the first is waited on; returns once all are done."""
        same: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for t in tensors:
            same.setdefault((t.dtype, t.device), []).append(t)
        pending = []
        for members in same.values():
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            pending.append((members, self.broadcast_(flat, tag, src=src, group=group)))
        for members, work in pending:
            flat = work.wait()
            for t, part in zip(members, torch.split(flat, [t.numel() for t in members])):
                t.data.copy_(part.view_as(t))

    def all_gather_object(self, obj: Any, tag: str, *, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
        """Gather a picklable object (tensors allowed) from every rank of ``group`` (``None``: the
        communicator's own), in the group's rank order.

        Sizes are exchanged first (8 bytes each), then every rank's serialised bytes are padded to
        the largest and all-gathered; both collectives are recorded. Both buffers are built on
        :attr:`device` and read back with one device-to-host copy each; the objects come back on CPU.
        """
        stream = io.BytesIO()
        torch.save(obj, stream)
        payload = torch.frombuffer(bytearray(stream.getvalue()), dtype=torch.uint8)
        if not self.active_in(group):
            pg, rank, world = self._resolve("all_gather", tag, group)
            self._record("all_gather", tag, payload.numel(), world, rank, pg)
            return [obj]
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        sizes = self.all_gather_bytes(size.view(torch.uint8), tag + "/sizes", group=group).wait()
        lengths = [int(n) for n in torch.cat(sizes).view(torch.int64).cpu().tolist()]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload.to(self.device)
        gathered = torch.stack(self.all_gather_bytes(padded, tag, group=group).wait()).cpu()
        return [
            torch.load(io.BytesIO(row[:n].numpy().tobytes()), weights_only=True, map_location="cpu")
            for row, n in zip(gathered, lengths)
        ]

    def check_same(self, values: list[int], tag: str, what: str, *, group: Optional[dist.ProcessGroup] = None) -> None:
        """Raise ``RuntimeError`` on every rank of ``group`` (``None``: the communicator's own) if
        ``values`` (e.g. a model fingerprint) differ across its ranks.

        Every rank sends the same 16 bytes whatever ``values`` holds (their count and a 64-bit digest),
        so ranks whose fingerprints differ in length still meet in one well-formed all-gather and all
        raise the same clear error (gloo aborts the process on an all-gather of unequal sizes).
        ``values[0]`` should count the items compared; the error reports it per rank.

        The check is counted in the ledger's totals but not in the open step's traffic (it verifies,
        it does not train): callers run it at a point every rank reaches, e.g. DES-LOC at every sync,
        a standalone ``DeMoExchange.step`` at every step, the codec when its plan is rebuilt.
        The 16 bytes are built on :attr:`device` and read back with one device-to-host copy.
        """
        raw = torch.tensor(values, dtype=torch.int64, device="cpu").numpy().tobytes()
        digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)
        mine = torch.tensor([int(values[0]) if values else 0, digest], dtype=torch.int64, device=self.device)
        gathered = self.all_gather_bytes(mine.view(torch.uint8), tag, per_step=False, group=group).wait()
        rows = [tuple(row) for row in torch.stack(gathered).view(torch.int64).cpu().tolist()]
        bad = [r for r, row in enumerate(rows) if row != rows[0]]
        if bad:
            counts = ", ".join(f"rank {r}: {rows[r][0]}" for r in [0, *bad])
            raise RuntimeError(
                f"{what} differs between rank 0 and rank(s) {bad} (items: {counts}); every rank must build the same "
                "model with the same trainable parameters (requires_grad) in the same order"
            )
