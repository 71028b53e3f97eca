"""The only module that calls ``torch.distributed`` collectives; every call goes to the ledger.

Collectives follow gloo's limits so the same code runs on CPU and on NCCL: all-gathers move one
``uint8`` buffer of equal size on every rank (gloo aborts on unequal sizes and has no int16), and
averages are SUM followed by a division (gloo has no ``ReduceOp.AVG``).

With a world of one (or no initialised process group) every collective is the identity; the
ledger still records the payload (its modeled wire bytes are zero).

Devices: a :class:`Communicator` has one :attr:`~Communicator.device`, where every tensor it hands
to the backend must live (NCCL, which Lightning uses on GPUs, takes only CUDA tensors of the
rank's own device; gloo takes CPU tensors). It comes from the group's backend (the current CUDA
device for ``nccl``, CPU for ``gloo`` and the rest, CPU without a process group) unless the
constructor's ``device`` overrides it (e.g. a job whose parameters live on GPUs under gloo passes
their device: gloo takes CUDA tensors too, and the check below wants one device). Control messages
(layout checks, object gathers, the callbacks' reductions, the non-finite guard) are built on it;
data (momenta, parameters) is there because the parameters are. Whenever a process group exists
(a world of one included, so a one-GPU run checks what a multi-GPU run would send), every
collective first checks each tensor's device and raises ``ValueError`` naming the collective, its
ledger tag and both devices, before the backend would fail or hang on it.

Failure: a collective that does not complete raises on every rank after the process group's
timeout (set it with the strategy's ``timeout``); nothing here retries. The backend's own error
(gloo: ``Timed out waiting 1800000ms for recv operation``, or ``Connection closed by peer``) is
re-raised as :class:`CollectiveError`, whose message names the collective, its ledger tag, this
rank, the timeout and the likely causes; the backend's error is kept as ``__cause__``.
"""

from __future__ import annotations

import hashlib
import io
import time
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from demo_lightning.comm.ledger import ByteLedger

__all__ = ["CollectiveError", "Communicator", "default_device"]


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


class Communicator:
    """Collectives over one process group, each recorded in a :class:`ByteLedger`.

    Args:
        group: the process group (``None``: the default group, if initialised).
        ledger: where to record; a new ledger for this rank by default.
        timeout: the process group's collective timeout, named in error messages (``None``: unknown).
        device: where the collectives' tensors live (see the module docstring); ``None``:
            :func:`default_device` of ``group``. ``"cuda"`` without an index means the current one.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        ledger: Optional[ByteLedger] = None,
        timeout: Optional[timedelta] = None,
        device: Union[torch.device, str, None] = None,
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
        self.seconds = 0.0  # wall time spent inside collectives

    def _timed(self, op: str, tag: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except RuntimeError as error:  # torch.distributed.DistError and the backends' errors derive from it
            raise CollectiveError(self._failure_message(op, tag, time.perf_counter() - start, error)) from error
        finally:
            self.seconds += time.perf_counter() - start

    def _failure_message(self, op: str, tag: str, seconds: float, error: BaseException) -> str:
        """What failed, where, after how long, and what to do about it."""
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        lowered = text.lower()
        limit = f"{self.timeout.total_seconds():g} s" if self.timeout is not None else "the process group's timeout"
        where = f"{op} '{tag}' failed on rank {self.rank} of {self.world_size} after {seconds:.1f} s"
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

    @property
    def active(self) -> bool:
        """Whether collectives actually cross processes."""
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

    def all_gather_bytes(self, buffer: Tensor, tag: str, per_step: bool = True) -> list[Tensor]:
        """All-gather one ``uint8`` buffer of the same size on every rank; returns them in rank order.

        ``per_step=False`` keeps the call out of the open step's traffic (verification, not training).
        """
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(f"all_gather_bytes expects a 1-D uint8 buffer, got {buffer.dtype} {tuple(buffer.shape)}")
        self._check_device("all_gather", tag, buffer)
        self.ledger.record("all_gather", tag, buffer.numel(), self.world_size, per_step=per_step)
        if not self.active:
            return [buffer]
        out = [torch.empty_like(buffer) for _ in range(self.world_size)]
        self._timed("all_gather", tag, dist.all_gather, out, buffer.contiguous(), group=self.group)
        return out

    def all_reduce_sum_(self, tensor: Tensor, tag: str) -> Tensor:
        """Sum ``tensor`` over ranks in place (bitwise identical on every rank) and return it."""
        self._check_device("all_reduce", tag, tensor)
        self.ledger.record("all_reduce", tag, tensor.numel() * tensor.element_size(), self.world_size)
        if self.active:
            self._timed("all_reduce", tag, dist.all_reduce, tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def broadcast_(self, tensor: Tensor, tag: str, src: int = 0) -> Tensor:
        """Overwrite ``tensor`` with rank ``src``'s copy, in place."""
        self._check_device("broadcast", tag, tensor)
        self.ledger.record("broadcast", tag, tensor.numel() * tensor.element_size(), self.world_size, root=src)
        if self.active:
            self._timed("broadcast", tag, dist.broadcast, tensor, src=self._global_rank(src), group=self.group)
        return tensor

    def broadcast_tensors_(self, tensors: list[Tensor], tag: str, src: int = 0) -> None:
        """Overwrite every tensor with rank ``src``'s copy: one flat broadcast per dtype and device."""
        groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for group in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self.broadcast_(flat, tag, src=src)
            for t, part in zip(group, torch.split(flat, [t.numel() for t in group])):
                t.data.copy_(part.view_as(t))

    def all_gather_object(self, obj: Any, tag: str) -> list[Any]:
        """Gather a picklable object (tensors allowed) from every rank, in rank order.

        Sizes are exchanged first (8 bytes each), then every rank's serialised bytes are padded to
        the largest and all-gathered; both collectives are recorded. Both buffers are built on
        :attr:`device` and read back with one device-to-host copy each; the objects come back on CPU.
        """
        stream = io.BytesIO()
        torch.save(obj, stream)
        payload = torch.frombuffer(bytearray(stream.getvalue()), dtype=torch.uint8)
        if not self.active:
            self.ledger.record("all_gather", tag, payload.numel(), self.world_size)
            return [obj]
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        sizes = self.all_gather_bytes(size.view(torch.uint8), tag + "/sizes")
        lengths = [int(n) for n in torch.cat(sizes).view(torch.int64).cpu().tolist()]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload.to(self.device)
        gathered = torch.stack(self.all_gather_bytes(padded, tag)).cpu()
        return [
            torch.load(io.BytesIO(row[:n].numpy().tobytes()), weights_only=True, map_location="cpu")
            for row, n in zip(gathered, lengths)
        ]

    def check_same(self, values: list[int], tag: str, what: str) -> None:
        """Raise ``RuntimeError`` on every rank if ``values`` (e.g. a model fingerprint) differ across ranks.

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
        gathered = self.all_gather_bytes(mine.view(torch.uint8), tag, per_step=False)
        rows = [tuple(row) for row in torch.stack(gathered).view(torch.int64).cpu().tolist()]
        bad = [r for r, row in enumerate(rows) if row != rows[0]]
        if bad:
            counts = ", ".join(f"rank {r}: {rows[r][0]}" for r in [0, *bad])
            raise RuntimeError(
                f"{what} differs between rank 0 and rank(s) {bad} (items: {counts}); every rank must build the same "
                "model with the same trainable parameters (requires_grad) in the same order"
            )

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)
