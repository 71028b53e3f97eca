"""The DeMo exchange: decoupled momentum with a compressed, error-fed exchange of its fast components.

Paper: "DeMo: Decoupled Momentum Optimization", Peng, Quesnelle, Kingma, arXiv 2411.19870.

Per trainable tensor, once per optimizer step, after the backward pass and before the
optimizer's update, on every worker (no gradient all-reduce at all)::

    m  <- decay * m + g                    # local momentum (optimizer.state[p]["demo_momentum"])
    C  =  DCT(tiles(m))                    # orthonormal 2-D DCT-II per tile (see codec)
    (I, V) = select(C, k)                  # top-k by magnitude, or the k lowest frequencies
    V^ = quantize(V)                       # what goes on the wire (value_format)
    m  <- m - IDCT(scatter(I, V^))         # error feedback: what was sent leaves m
    Q  =  IDCT( sum_r scatter(I_r, V^_r) / W )   # mean over all W workers, rank order 0..W-1
    p.grad <- sign(Q)   (update="sign", the paper's rule, for plain SGD)
    p.grad <- Q         (update="raw", the shared direction for any optimizer)

Tensors with fewer than ``dense_below`` elements skip the codec: their whole momentum is summed
by an fp32 all-reduce, divided by W, and their residual is cleared (everything was sent).

Differences from the reference implementation (bloc97/DeMo), each deliberate:

* the momentum is kept in ``optimizer.state`` so checkpoints carry it (it is hidden from the
  optimizer's own ``step`` so lazily initialised optimizers such as Adam still initialise);
* the exchange runs after the closure (Lightning's forward/backward), not before it;
* ``grad is None`` counts as a zero gradient, so every rank sends the same sizes;
* the decode is a true mean over all workers in a fixed rank order, so every replica computes
  bitwise the same update; indices are bit-packed, values are fp32/bf16/fp16/int8/sign;
* tensors are tiled with padding (no prime-size degeneration; N-D weights work), and tiles of
  the same shape from all tensors are transformed in one batched matmul;
* collectives are bucketed: one all-gather per bucket of up to ``bucket_cap_mb`` megabytes.

Failure behaviour: a collective that cannot complete raises on every rank after the process
group's timeout. The parameter fingerprint is compared across ranks whenever the set of trainable
tensors changes; a mismatch raises ``RuntimeError`` on every rank before any exchange.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from demo_lightning.codec import (
    SELECTIONS,
    VALUE_FORMATS,
    TileLayout,
    coefficients_per_tile,
    dct2,
    from_tiles,
    idct2,
    pack_segment,
    plan_tiles,
    segment_nbytes,
    select,
    to_tiles,
    unpack_segment,
    validate_strength,
)
from demo_lightning.comm import Communicator, StepTraffic, ddp_bytes_per_step

__all__ = ["DEFAULT_TOPK", "DEMO_STATE_KEY", "UPDATES", "DeMoConfig", "DeMoExchange", "ExchangeStats", "warn_if_stateful"]

DEMO_STATE_KEY = "demo_momentum"
DEFAULT_TOPK = 32
UPDATES: tuple[str, ...] = ("sign", "raw")
_WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DeMoConfig:
    """Settings of the DeMo exchange.

    Args:
        chunk: tile side: 2-D views are cut into ``chunk`` x ``chunk`` tiles, 1-D into ``chunk``-long ones.
        topk: coefficients kept per tile (clamped to the tile size). Default 32 when neither
            ``topk`` nor ``keep_ratio`` is given (the paper's setting: 32 of 4096 = 0.78 %).
        keep_ratio: fraction of each tile kept, in (0, 1]; exclusive with ``topk``.
        decay: momentum decay beta in [0, 1) (the reference's ``compression_decay``).
        selection: ``"topk"`` (largest magnitudes, positions sent) or ``"lowpass"`` (fixed lowest
            frequencies, no positions; all-reduced when ``value_format`` is a float format).
        value_format: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"int8"`` or ``"sign"``.
        update: ``"sign"`` writes ``sign(Q)`` into ``p.grad`` (plain SGD); ``"raw"`` writes ``Q``.
        dense_below: tensors with fewer elements are all-reduced densely in fp32 (0 disables).
        bucket_cap_mb: largest payload per collective, in megabytes.
    """

    chunk: int = 64
    topk: Optional[int] = None
    keep_ratio: Optional[float] = None
    decay: float = 0.999
    selection: Literal["topk", "lowpass"] = "topk"
    value_format: Literal["fp32", "bf16", "fp16", "int8", "sign"] = "bf16"
    update: Literal["sign", "raw"] = "sign"
    dense_below: int = 4096
    bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be a positive integer (tile side), got {self.chunk!r}; the paper uses 64")
        validate_strength(self.topk, self.keep_ratio)
        if not isinstance(self.decay, (int, float)) or not 0.0 <= float(self.decay) < 1.0:
            raise ValueError(f"decay must lie in [0, 1), got {self.decay!r}; the paper uses 0.999")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.value_format not in VALUE_FORMATS:
            raise ValueError(f"value_format must be one of {VALUE_FORMATS}, got {self.value_format!r}")
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {self.update!r}")
        if isinstance(self.dense_below, bool) or not isinstance(self.dense_below, int) or self.dense_below < 0:
            raise ValueError(f"dense_below must be a non-negative integer (element count), got {self.dense_below!r}")
        if not isinstance(self.bucket_cap_mb, (int, float)) or not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")

    @property
    def strength(self) -> tuple[Optional[int], Optional[float]]:
        """``(topk, keep_ratio)`` with the default applied."""
        if self.topk is None and self.keep_ratio is None:
            return DEFAULT_TOPK, None
        return self.topk, self.keep_ratio

    @property
    def sends_positions(self) -> bool:
        return self.selection == "topk"

    @property
    def all_reduces(self) -> bool:
        """Low-pass values in a float format are summed by an all-reduce; everything else is all-gathered."""
        return self.selection == "lowpass" and self.value_format in _WIRE_DTYPES


@dataclass
class _TensorPlan:
    index: int
    param: Tensor
    dense: bool
    compute_dtype: torch.dtype
    layout: Optional[TileLayout] = None
    k: int = 0
    family: Any = None
    tile_offset: int = 0

    @property
    def n_tiles(self) -> int:
        return self.layout.n_tiles if self.layout is not None else 0


@dataclass
class _Plan:
    tensors: list[_TensorPlan]
    dense_groups: dict[torch.dtype, list[_TensorPlan]]
    families: "OrderedDict[Any, list[_TensorPlan]]"
    buckets: list[list[_TensorPlan]]
    segment_bytes: dict[int, int]
    n_trainable: int


@dataclass
class ExchangeStats:
    """What the last exchange did on this worker."""

    seconds: float = 0.0
    comm_seconds: float = 0.0
    sent_bytes: float = 0.0
    received_bytes: float = 0.0
    payload_bytes: int = 0
    ddp_bytes: float = 0.0
    collectives: int = 0
    coefficients: int = 0
    n_trainable: int = 0
    steps: int = 0
    total_seconds: float = 0.0
    total_comm_seconds: float = 0.0

    @property
    def ratio_vs_ddp(self) -> float:
        return StepTraffic(self.sent_bytes, self.received_bytes, self.payload_bytes, self.collectives, self.ddp_bytes).ratio_vs_ddp


class DeMoExchange:
    """Attach the DeMo exchange to an optimizer (no Lightning needed).

    Call :meth:`step` after the backward pass and before ``optimizer.step()``; it replaces every
    trainable parameter's ``grad`` with the shared update.

    Args:
        optimizer: the optimizer whose parameters are exchanged (its ``param_groups`` order is the
            exchange order, so it must be the same on every rank).
        config: exchange settings.
        communicator: collectives and ledger; a fresh one over the default group by default.
    """

    def __init__(self, optimizer: Optimizer, config: Optional[DeMoConfig] = None, communicator: Optional[Communicator] = None) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"DeMoExchange needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.config = config if config is not None else DeMoConfig()
        self.comm = communicator if communicator is not None else Communicator()
        self.stats = ExchangeStats()
        self._plan: Optional[_Plan] = None
        self._plan_key: Optional[tuple] = None
        self._hidden: dict[Tensor, Tensor] = {}
        self._hooks = [
            optimizer.register_step_pre_hook(self._hide_state),
            optimizer.register_step_post_hook(self._restore_state),
        ]

    # ------------------------------------------------------------------ state
    def parameters(self) -> list[Tensor]:
        """Trainable parameters in exchange order (the optimizer's ``param_groups`` order)."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def momentum(self, param: Tensor) -> Tensor:
        """The local momentum (residual) of ``param``, created as zeros on first use."""
        state = self.optimizer.state[param]
        buf = state.get(DEMO_STATE_KEY)
        if buf is None:
            buf = self._hidden.pop(param, None)
        if buf is None:
            buf = torch.zeros(param.shape, dtype=_compute_dtype(param), device=param.device)
        state[DEMO_STATE_KEY] = buf
        return buf

    def local_state(self) -> dict[int, Tensor]:
        """This worker's momenta by parameter index (the optimizer ``state_dict`` numbering)."""
        self.restore_state()
        out: dict[int, Tensor] = {}
        for index, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"]):
            buf = self.optimizer.state.get(p, {}).get(DEMO_STATE_KEY)
            if buf is not None:
                out[index] = buf.detach().clone()
        return out

    def load_local_state(self, momenta: dict[int, Tensor]) -> None:
        """Install momenta saved by :meth:`local_state` (same model; shapes are checked)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for index, buf in momenta.items():
            if not 0 <= int(index) < len(params):
                raise ValueError(f"saved DeMo momentum for parameter {index}, but the optimizer has {len(params)}")
            p = params[int(index)]
            if tuple(buf.shape) != tuple(p.shape):
                raise ValueError(
                    f"saved DeMo momentum for parameter {index} has shape {tuple(buf.shape)}, the parameter "
                    f"{tuple(p.shape)}: the checkpoint comes from a different model"
                )
            self.optimizer.state[p][DEMO_STATE_KEY] = buf.to(dtype=_compute_dtype(p), device=p.device).clone()

    def clear_state(self) -> None:
        """Drop every local momentum (they restart from zero)."""
        self.restore_state()
        for state in self.optimizer.state.values():
            state.pop(DEMO_STATE_KEY, None)

    def _hide_state(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # Adam and others initialise a parameter's state only while it is empty: keep ours out of sight.
        for p, state in optimizer.state.items():
            buf = state.pop(DEMO_STATE_KEY, None)
            if buf is not None:
                self._hidden[p] = buf

    def _restore_state(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.restore_state()

    def restore_state(self) -> None:
        """Put momenta hidden during ``optimizer.step`` back (also safe after a failed step)."""
        for p, buf in self._hidden.items():
            self.optimizer.state[p][DEMO_STATE_KEY] = buf
        self._hidden = {}

    def remove(self) -> None:
        """Detach from the optimizer (the momenta stay in ``optimizer.state``)."""
        self.restore_state()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ plan
    def _build_plan(self) -> _Plan:
        cfg = self.config
        topk, keep_ratio = cfg.strength
        all_params = [p for g in self.optimizer.param_groups for p in g["params"]]
        tensors: list[_TensorPlan] = []
        for index, p in enumerate(all_params):
            if not p.requires_grad:
                continue
            dense = p.numel() < cfg.dense_below
            plan = _TensorPlan(index=index, param=p, dense=dense, compute_dtype=_compute_dtype(p))
            if not dense:
                plan.layout = plan_tiles(p.shape, cfg.chunk)
                plan.k = coefficients_per_tile(plan.layout.tile_numel, topk, keep_ratio)
                plan.family = (plan.layout.tile_shape, plan.k, plan.compute_dtype, p.device)
            tensors.append(plan)
        dense_groups: dict[torch.dtype, list[_TensorPlan]] = {}
        families: OrderedDict[Any, list[_TensorPlan]] = OrderedDict()
        for t in tensors:
            if t.dense:
                dense_groups.setdefault(t.compute_dtype, []).append(t)
            else:
                members = families.setdefault(t.family, [])
                t.tile_offset = sum(m.n_tiles for m in members)
                members.append(t)
        segment_bytes: dict[int, int] = {}
        cap = int(cfg.bucket_cap_mb * 1024 * 1024)
        buckets: list[list[_TensorPlan]] = []
        size = 0
        for t in tensors:
            if t.dense:
                continue
            assert t.layout is not None
            if cfg.all_reduces:
                nbytes = t.n_tiles * t.k * _WIRE_DTYPES[cfg.value_format].itemsize
            else:
                nbytes = segment_nbytes(t.n_tiles, t.k, t.layout.tile_numel, cfg.value_format, cfg.sends_positions)
            segment_bytes[t.index] = nbytes
            if not buckets or size + nbytes > cap:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += nbytes
        fingerprint = [len(all_params)]
        for t in tensors:
            fingerprint += [t.index, t.param.numel(), len(t.param.shape)]
        self.comm.check_same(fingerprint, "demo/fingerprint", "the set of trainable parameters")
        return _Plan(tensors, dense_groups, families, buckets, segment_bytes, sum(t.param.numel() for t in tensors))

    def _plan_for_step(self) -> _Plan:
        key = tuple((id(p), tuple(p.shape), p.dtype, p.requires_grad) for g in self.optimizer.param_groups for p in g["params"])
        if self._plan is None or key != self._plan_key:
            self._plan = self._build_plan()
            self._plan_key = key
        return self._plan

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> ExchangeStats:
        """Run one exchange: update momenta, share their fast components, write ``p.grad``."""
        start = time.perf_counter()
        comm_seconds = 0.0
        cfg = self.config
        world = self.comm.world_size
        self.restore_state()
        plan = self._plan_for_step()
        ledger = self.comm.ledger
        ledger.begin_step()
        try:
            momenta = {t.index: self.momentum(t.param) for t in plan.tensors}
            for t in plan.tensors:
                m = momenta[t.index]
                m.mul_(cfg.decay)
                if t.param.grad is not None:
                    m.add_(t.param.grad.to(m.dtype))
            shared: dict[int, Tensor] = {}

            # dense tensors: the whole momentum, summed in one all-reduce per dtype
            for dtype, group in plan.dense_groups.items():
                flat = torch.cat([momenta[t.index].reshape(-1) for t in group])
                tic = time.perf_counter()
                self.comm.all_reduce_sum_(flat, "demo/dense")
                comm_seconds += time.perf_counter() - tic
                flat.div_(world)
                for t, part in zip(group, torch.split(flat, [t.param.numel() for t in group])):
                    shared[t.index] = part.view(t.param.shape)
                    momenta[t.index].zero_()

            # compressed tensors: batched transform and selection per family of equal tiles
            selected: dict[int, tuple[Tensor, Tensor]] = {}
            family_coeffs: dict[Any, Tensor] = {}
            # `decode` holds, per family, the coefficients this worker sent (rows :n) and the mean over
            # workers (rows n:), so one inverse transform serves the error feedback and the update
            decode: dict[Any, Tensor] = {}
            for key, members in plan.families.items():
                n_tiles = sum(t.n_tiles for t in members)
                ref = members[0]
                tiles = torch.empty((n_tiles, *ref.layout.tile_shape), dtype=ref.compute_dtype, device=ref.param.device)
                for t in members:
                    to_tiles(momenta[t.index], t.layout, out=tiles[t.tile_offset : t.tile_offset + t.n_tiles])
                coeffs = dct2(tiles)
                family_coeffs[key] = coeffs
                positions, values = select(coeffs, ref.k, cfg.selection)
                for t in members:
                    rows = slice(t.tile_offset, t.tile_offset + t.n_tiles)
                    selected[t.index] = (positions[rows], values[rows])
                decode[key] = torch.zeros((2 * n_tiles, ref.layout.tile_numel), dtype=ref.compute_dtype, device=ref.param.device)
            sent = {key: buf[: buf.shape[0] // 2] for key, buf in decode.items()}
            mean = {key: buf[buf.shape[0] // 2 :] for key, buf in decode.items()}
            n_coefficients = 0
            for bucket in plan.buckets:
                if cfg.all_reduces:
                    wire = _WIRE_DTYPES[cfg.value_format]
                    parts = []
                    for t in bucket:
                        positions, values = selected[t.index]
                        narrow = values.to(wire)
                        rows = slice(t.tile_offset, t.tile_offset + t.n_tiles)
                        sent[t.family][rows].scatter_(1, positions, narrow.to(sent[t.family].dtype))
                        parts.append(narrow.reshape(-1))
                        n_coefficients += values.numel()
                    flat = torch.cat(parts)
                    tic = time.perf_counter()
                    self.comm.all_reduce_sum_(flat, "demo/lowpass")
                    comm_seconds += time.perf_counter() - tic
                    summed = flat.to(torch.float32)
                    offset = 0
                    for t in bucket:
                        positions, values = selected[t.index]
                        count = values.numel()
                        rows = slice(t.tile_offset, t.tile_offset + t.n_tiles)
                        part = summed[offset : offset + count].view_as(values).to(mean[t.family].dtype)
                        mean[t.family][rows].scatter_(1, positions, part)
                        offset += count
                    continue
                segments = []
                for t in bucket:
                    positions, values = selected[t.index]
                    buf, decoded = pack_segment(
                        positions if cfg.sends_positions else None, values, t.layout.tile_numel, cfg.value_format
                    )
                    rows = slice(t.tile_offset, t.tile_offset + t.n_tiles)
                    sent[t.family][rows].scatter_(1, positions, decoded.to(sent[t.family].dtype))
                    segments.append(buf)
                    n_coefficients += values.numel()
                payload = torch.cat(segments)
                tic = time.perf_counter()
                gathered = self.comm.all_gather_bytes(payload, "demo/topk" if cfg.sends_positions else "demo/values")
                comm_seconds += time.perf_counter() - tic
                for rank_buf in gathered:  # fixed rank order: deterministic sum on every replica
                    offset = 0
                    for t in bucket:
                        nbytes = plan.segment_bytes[t.index]
                        positions, values = unpack_segment(
                            rank_buf[offset : offset + nbytes], t.n_tiles, t.k, t.layout.tile_numel,
                            cfg.value_format, cfg.sends_positions,
                        )
                        if positions is None:
                            positions = selected[t.index][0]
                        rows = slice(t.tile_offset, t.tile_offset + t.n_tiles)
                        mean[t.family][rows].scatter_add_(1, positions, values.to(mean[t.family].dtype))
                        offset += nbytes

            for key, members in plan.families.items():
                n = mean[key].shape[0]
                mean[key].div_(world)
                decoded = idct2(decode[key].view(2 * n, *family_coeffs[key].shape[1:]))
                feedback, direction = decoded[:n], decoded[n:]
                for t in members:
                    rows = slice(t.tile_offset, t.tile_offset + t.n_tiles)
                    momenta[t.index].sub_(from_tiles(feedback[rows], t.layout))
                    shared[t.index] = from_tiles(direction[rows], t.layout)

            for t in plan.tensors:
                update = shared[t.index]
                if cfg.update == "sign":
                    update = torch.sign(update)
                update = update.to(t.param.dtype)
                if t.param.grad is None:
                    t.param.grad = update.clone()
                else:
                    t.param.grad.copy_(update)
        finally:
            traffic = ledger.end_step(ddp_bytes_per_step(plan.n_trainable, world))
        seconds = time.perf_counter() - start
        s = self.stats
        s.seconds, s.comm_seconds = seconds, comm_seconds
        s.sent_bytes, s.received_bytes = traffic.sent_bytes, traffic.received_bytes
        s.payload_bytes, s.ddp_bytes, s.collectives = traffic.payload_bytes, traffic.ddp_bytes, traffic.calls
        s.coefficients, s.n_trainable = n_coefficients, plan.n_trainable
        s.steps += 1
        s.total_seconds += seconds
        s.total_comm_seconds += comm_seconds
        return s


def _compute_dtype(param: Tensor) -> torch.dtype:
    """Momentum and transforms run in fp32 for half-precision parameters, else in the parameter's dtype."""
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


def warn_if_stateful(optimizer: Optimizer) -> Optional[str]:
    """A message if ``optimizer`` keeps its own momentum (``update="sign"`` expects plain SGD)."""
    for group in optimizer.param_groups:
        if group.get("momentum", 0) or "betas" in group:
            return (
                f"update='sign' is DeMo's rule for plain SGD, but {type(optimizer).__name__} keeps its own momentum "
                "or moments on top of the sign; use torch.optim.SGD(momentum=0), or update='raw' for this optimizer"
            )
    return None

