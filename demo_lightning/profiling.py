"""Named stage ranges: where an optimizer step's communication time goes, for any profiler.

Every stage of the DeMo exchange, of DES-LOC's averaging (and its compressed parameter sync) and
of the non-finite guard runs inside :func:`stage_range` under one of the names below. A range is
two things at once:

* a ``torch.profiler.record_function`` range, so ``torch.profiler`` and Lightning's
  ``PyTorchProfiler`` (``Trainer(profiler="pytorch")``) show it in their tables and traces;
* an entry into every registered **sink**: a callable ``name -> context manager`` entered around
  the range. Lightning's ``Profiler.profile`` is such a callable, so registering
  ``trainer.profiler.profile`` (:func:`lightning_sink`, :func:`add_sink`) makes ``SimpleProfiler``
  and ``AdvancedProfiler`` report the stages as actions of their own; :class:`StageTimes`
  (:func:`measure_stages`) is a sink that only adds up wall time, for benchmarks that must not pay
  ``torch.profiler``'s overhead.

Ranges and their nesting (a name ``a/b/c`` sits inside ``a/b`` unless noted; per optimizer step
with ``B`` buckets of ``W`` ranks)::

    guard/nonfinite                  the guard's flags and its all-gather (NonFiniteGuard)
    demo/exchange                    one whole DeMoExchange.step (plan check, ledger, everything below)
      demo/node                      node hierarchy only: the intra-node mean, then the share broadcast
      demo/clip                      the worker's (node's) gradient clipped (DeMoConfig.clip_grad_norm)
      demo/encode                    momentum update (dense and DCT), selection
        demo/encode/transform        M <- decay M + DCT(g), every compressed tensor (one range)
        demo/encode/select           top-k / low-pass of every family (one range); under
                                     selection="shared" it holds the leader's broadcast, in demo/transport
      demo/transport                 collectives started (B), then per bucket its wait and unpacking
        demo/transport/pack          one bucket onto the wire (B ranges)
        demo/transport/unpack        one run (tensors of one tile shape) of one rank's part of a
                                     bucket off the wire (B x W x R for R runs a bucket; one per
                                     bucket for an all-reduce)
      demo/decode                    rank-order sums, error feedback, the dense means, the inverse
        demo/decode/scatter_add      one bucket's contributions added into the mean spectra (B)
        demo/decode/inverse          the inverse DCT of every compressed tensor (one range)
    desloc/clip                      DES-LOC's local gradient clipping (only when clip_grad_norm is set)
    desloc/sync                      one due DES-LOC average (layout check, collectives, write-back)
      desloc/sync/params             the parameters (exact, or compressed through CompressedMean)
        codec/...                    CompressedMean's stages, when compress_params is set
      desloc/sync/buffers            the floating-point buffers
      desloc/sync/state/<key>        one optimizer-state key (e.g. desloc/sync/state/exp_avg)
    desloc/final                     DES-LOC's final average when training ends (outside any step)

    codec/encode, codec/encode/transform, codec/encode/select,          CompressedMean, with the same
    codec/transport, codec/transport/pack, codec/transport/unpack,      meaning as the demo/ ranges; its
    codec/decode, codec/decode/scatter_add, codec/decode/inverse        unpacking runs lazily while the
                                                                        sums draw the contributions, so
                                                                        codec/transport/unpack nests
                                                                        inside codec/decode/scatter_add

Cost: with no profiler recording and no sink registered a range costs one check of
``torch.autograd._profiler_enabled()`` and returns a shared no-op context (well under a
microsecond). Otherwise each range is one ``record_function`` (a few microseconds, only while a
profiler records) plus one entry per sink; a range never reads a tensor, so it adds no host-device
synchronisation (:func:`measure_stages` with ``sync`` does, on request). The exchange opens about
``8 + B (4 + W R)`` ranges per step (``R``: runs a bucket, one per tile shape in it), none per tensor.

Sinks are process-wide: every exchange of the process reports to every registered sink.
Registration and removal are thread-safe (copy on write); entering a range reads the current tuple
of sinks without a lock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

import torch

__all__ = [
    "CODEC",
    "DEMO",
    "DEMO_CLIP",
    "DEMO_DECODE",
    "DEMO_ENCODE",
    "DEMO_EXCHANGE",
    "DEMO_NODE",
    "DEMO_TRANSPORT",
    "DESLOC_CLIP",
    "DESLOC_FINAL",
    "DESLOC_SYNC",
    "DESLOC_SYNC_BUFFERS",
    "DESLOC_SYNC_PARAMS",
    "GUARD_NONFINITE",
    "OUTERMOST",
    "Sink",
    "SinkHandle",
    "StageNames",
    "StageTimes",
    "add_sink",
    "desloc_sync_state",
    "lightning_sink",
    "measure_stages",
    "registered_sinks",
    "sinks",
    "stage_range",
]

Sink = Callable[[str], ContextManager[Any]]


@dataclass(frozen=True)
class StageNames:
    """The range names of one user of the codec's stages (``prefix`` ``"demo"`` or ``"codec"``)."""

    prefix: str

    @property
    def encode(self) -> str:
        return f"{self.prefix}/encode"

    @property
    def transform(self) -> str:
        return f"{self.prefix}/encode/transform"

    @property
    def select(self) -> str:
        return f"{self.prefix}/encode/select"

    @property
    def transport(self) -> str:
        return f"{self.prefix}/transport"

    @property
    def pack(self) -> str:
        return f"{self.prefix}/transport/pack"

    @property
    def unpack(self) -> str:
        return f"{self.prefix}/transport/unpack"

    @property
    def decode(self) -> str:
        return f"{self.prefix}/decode"

    @property
    def scatter_add(self) -> str:
        return f"{self.prefix}/decode/scatter_add"

    @property
    def inverse(self) -> str:
        return f"{self.prefix}/decode/inverse"

    def all(self) -> tuple[str, ...]:
        """Every name, parents before children."""
        return (self.encode, self.transform, self.select, self.transport, self.pack, self.unpack,
                self.decode, self.scatter_add, self.inverse)


DEMO = StageNames("demo")
"""The DeMo exchange's stages (:class:`~demo_lightning.algorithms.DeMoExchange`)."""
CODEC = StageNames("codec")
"""CompressedMean's stages (DES-LOC's compressed parameter sync)."""

GUARD_NONFINITE = "guard/nonfinite"
DEMO_EXCHANGE = "demo/exchange"
DEMO_NODE = "demo/node"
DEMO_CLIP = "demo/clip"
DEMO_ENCODE, DEMO_TRANSPORT, DEMO_DECODE = DEMO.encode, DEMO.transport, DEMO.decode
DESLOC_CLIP = "desloc/clip"
DESLOC_SYNC = "desloc/sync"
DESLOC_SYNC_PARAMS = "desloc/sync/params"
DESLOC_SYNC_BUFFERS = "desloc/sync/buffers"
DESLOC_FINAL = "desloc/final"
OUTERMOST = (GUARD_NONFINITE, DEMO_EXCHANGE, DESLOC_CLIP, DESLOC_SYNC, DESLOC_FINAL)
"""The ranges the library opens outside any other of its ranges."""


def desloc_sync_state(key: str) -> str:
    """The range of one optimizer-state key's average: ``desloc/sync/state/<key>``."""
    return f"{DESLOC_SYNC}/state/{key}"


# ------------------------------------------------------------------------------------------ ranges
_sinks: tuple[Sink, ...] = ()
_registry: list[tuple[object, Sink]] = []
_lock = threading.Lock()
_NOTHING = contextlib.nullcontext()
_profiler_enabled = torch.autograd._profiler_enabled


def stage_range(name: str) -> ContextManager[Any]:
    """A context manager: ``name`` as a ``torch.profiler.record_function`` range (when a profiler
    records) and in every registered sink. Exits in reverse order, also on an exception (which no
    sink can swallow); a sink that fails to enter leaves the ones entered before it closed."""
    current = _sinks
    profiling = _profiler_enabled()
    if not current and not profiling:
        return _NOTHING
    return _Range(name, current, profiling)


class _Range:
    __slots__ = ("name", "sinks", "profiling", "entered")

    def __init__(self, name: str, sinks: tuple[Sink, ...], profiling: bool) -> None:
        self.name, self.sinks, self.profiling = name, sinks, profiling
        self.entered: list[Any] = []

    def __enter__(self) -> "_Range":
        entered = self.entered
        try:
            if self.profiling:
                rf = torch.profiler.record_function(self.name)
                rf.__enter__()
                entered.append(rf)
            for sink in self.sinks:
                cm = sink(self.name)
                cm.__enter__()
                entered.append(cm)
        except BaseException as error:
            self._close(type(error), error, error.__traceback__)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close(*exc)  # returns None: never suppresses the body's exception (a sink's own exit error replaces it)

    def _close(self, *exc: Any) -> None:
        entered, self.entered = self.entered, []
        failure: Optional[BaseException] = None
        for cm in reversed(entered):  # every one closed, even when one of them raises
            try:
                cm.__exit__(*exc)
            except BaseException as error:  # noqa: PERF203
                failure = failure or error
        if failure is not None:
            raise failure


# ------------------------------------------------------------------------------------------- sinks
class SinkHandle:
    """A registration made by :func:`add_sink`; :meth:`remove` (or leaving ``with``) undoes it once."""

    __slots__ = ("_token",)

    def __init__(self, token: object) -> None:
        self._token: Optional[object] = token

    def remove(self) -> None:
        """Unregister the sink (idempotent)."""
        global _sinks
        token, self._token = self._token, None
        if token is None:
            return
        with _lock:
            _registry[:] = [(t, s) for t, s in _registry if t is not token]
            _sinks = tuple(s for _, s in _registry)

    @property
    def active(self) -> bool:
        return self._token is not None

    def __enter__(self) -> "SinkHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def add_sink(sink: Sink) -> SinkHandle:
    """Enter ``sink(name)`` around every stage range from now on, until the handle is removed.

    The same sink added twice is entered twice (each handle removes its own registration). A sink
    must not raise on a name it does not know; it is entered for ranges of every thread."""
    global _sinks
    if not callable(sink):
        raise TypeError(f"a sink is a callable name -> context manager (e.g. trainer.profiler.profile), got {type(sink).__name__}")
    token = object()
    with _lock:
        _registry.append((token, sink))
        _sinks = tuple(s for _, s in _registry)
    return SinkHandle(token)


@contextlib.contextmanager
def sinks(*added: Sink) -> Iterator[None]:
    """Register ``added`` for the duration of a ``with`` block."""
    handles = [add_sink(s) for s in added]
    try:
        yield
    finally:
        for h in reversed(handles):
            h.remove()


def registered_sinks() -> tuple[Sink, ...]:
    """The sinks registered now, in registration order."""
    return _sinks


def lightning_sink(profiler: Any) -> Optional[Sink]:
    """The sink that reports the stages to a Lightning profiler: ``profiler.profile``, or ``None``
    where registering it would only cost time (``PassThroughProfiler``, ``Trainer``'s default, records
    nothing; ``PyTorchProfiler`` already records the ``record_function`` ranges and would list each
    one twice, once as ``[pl][profile]<name>``). Register it once: ``SimpleProfiler`` refuses an action
    that is started while it runs, which a second registration of the same profiler would do."""
    if profiler is None:
        return None
    try:
        from lightning.pytorch.profilers import PassThroughProfiler, PyTorchProfiler
    except ImportError:  # pragma: no cover - lightning is a dependency
        return profiler.profile
    if isinstance(profiler, (PassThroughProfiler, PyTorchProfiler)):
        return None
    return profiler.profile


# ------------------------------------------------------------------------------------------ timing
class StageTimes:
    """A sink that adds up each range's wall time (``time.perf_counter``) and calls.

    Per name: :attr:`inclusive` (from entering to leaving the range; when ranges of the same name
    nest, only the outermost counts), :attr:`exclusive` (inclusive less the time of the ranges
    nested directly inside it, so exclusive times add up without double counting), :attr:`calls`.
    :attr:`total`: the time inside at least one range (the sum of the outermost ranges' times).
    Ranges are tracked per thread; the totals are shared. ``sync`` (e.g. ``torch.cuda.synchronize``)
    runs before every reading of the clock, so queued device work is charged to the range that
    queued it, at the price of one host-device synchronisation per range entry and exit.
    """

    def __init__(self, sync: Optional[Callable[[], Any]] = None) -> None:
        self.sync = sync
        self.inclusive: dict[str, float] = {}
        self.exclusive: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.total = 0.0
        self._lock = threading.Lock()
        self._local = threading.local()

    def __call__(self, name: str) -> ContextManager[None]:
        return _Timed(self, name)

    def _frames(self) -> list[list[Any]]:
        frames = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    def seconds(self, name: str, exclusive: bool = False) -> float:
        """Seconds spent in ``name`` (0 if it never ran)."""
        return (self.exclusive if exclusive else self.inclusive).get(name, 0.0)

    def snapshot(self) -> dict[str, Any]:
        """A copy: ``{"total": s, "inclusive": {...}, "exclusive": {...}, "calls": {...}}``."""
        with self._lock:
            return {"total": self.total, "inclusive": dict(self.inclusive), "exclusive": dict(self.exclusive),
                    "calls": dict(self.calls)}

    def reset(self) -> None:
        """Forget everything measured so far (ranges open now still count when they close)."""
        with self._lock:
            self.inclusive, self.exclusive, self.calls, self.total = {}, {}, {}, 0.0


class _Timed:
    __slots__ = ("times", "name", "frame")

    def __init__(self, times: StageTimes, name: str) -> None:
        self.times, self.name = times, name

    def __enter__(self) -> None:
        times = self.times
        if times.sync is not None:
            times.sync()
        # [name, start, time of the ranges nested directly inside]
        self.frame = [self.name, time.perf_counter(), 0.0]
        times._frames().append(self.frame)

    def __exit__(self, *exc: Any) -> None:
        times = self.times
        if times.sync is not None:
            times.sync()
        end = time.perf_counter()
        frames = times._frames()
        frame = self.frame
        found = False
        for depth in range(len(frames) - 1, -1, -1):
            if frames[depth] is frame:
                del frames[depth:]  # ranges still open inside this one (left by a generator) end with it
                found = True
                break
        name, start, inner = frame
        elapsed = end - start
        parent = frames[-1] if found and frames else None  # not found: its enclosing range already ended
        outer_same = found and any(f[0] == name for f in frames)
        with times._lock:
            times.calls[name] = times.calls.get(name, 0) + 1
            times.exclusive[name] = times.exclusive.get(name, 0.0) + elapsed - inner
            if not outer_same:
                times.inclusive[name] = times.inclusive.get(name, 0.0) + elapsed
            if found and parent is None:
                times.total += elapsed
        if parent is not None:
            parent[2] += elapsed


@contextlib.contextmanager
def measure_stages(sync: Optional[Callable[[], Any]] = None) -> Iterator[StageTimes]:
    """Add up the stage ranges' times while the block runs: yields a fresh :class:`StageTimes`
    registered as a sink, removed on leaving the block."""
    times = StageTimes(sync)
    with add_sink(times):
        yield times
