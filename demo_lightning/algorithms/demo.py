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
group's timeout. Every step, before any data moves, every rank's plan digest (trainable tensors and
their codec settings) is compared across ranks (:meth:`DeMoExchange.check_plan`, or the strategy's
guard, which carries it): a rank whose tensors or settings changed alone makes every rank raise the
same ``RuntimeError``.
"""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from demo_lightning.algorithms.compressed_mean import (
    DEFAULT_TOPK,
    CodecConfig,
    CompressedMean,
    TensorCodec,
    TensorEnergy,
    compute_dtype,
)
from demo_lightning.comm import Communicator, StepTraffic, ddp_bytes_for

__all__ = [
    "DEFAULT_TOPK", "DEMO_STATE_KEY", "UPDATES", "DeMoConfig", "DeMoExchange", "ExchangeStats", "TensorSettings",
    "warn_if_stateful",
]

DEMO_STATE_KEY = "demo_momentum"
UPDATES: tuple[str, ...] = ("sign", "raw")


@dataclass(frozen=True)
class DeMoConfig:
    """Settings of the DeMo exchange.

    Defaults (topk 64, 1-bit ``sign`` values with a per-tile scale, decay 0.99) were chosen by
    measurement on the bundled GPT job (``benchmarks/first_figures.py``): at about the paper's
    bytes per step (its topk 32 with fp32 values and int64 indices costs 3.7x more) they reached
    the closest loss to AdamW + DDP. The paper's settings are ``topk=32, value_format="fp32",
    decay=0.999``.

    Args:
        chunk: tile side: 2-D views are cut into ``chunk`` x ``chunk`` tiles, 1-D into ``chunk``-long ones.
        topk: coefficients kept per tile (clamped to the tile size). Default 64 when neither
            ``topk`` nor ``keep_ratio`` is given.
        keep_ratio: fraction of each tile kept, in (0, 1]; exclusive with ``topk``.
        decay: momentum decay beta in [0, 1) (the reference's ``compression_decay``; it used 0.999).
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
    decay: float = 0.99
    selection: Literal["topk", "lowpass"] = "topk"
    value_format: Literal["fp32", "bf16", "fp16", "int8", "sign"] = "sign"
    update: Literal["sign", "raw"] = "sign"
    dense_below: int = 4096
    bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        _ = self.codec  # validates the codec fields
        _check_decay(self.decay)
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {self.update!r}")

    @property
    def codec(self) -> CodecConfig:
        """The codec part of the settings."""
        return CodecConfig(
            chunk=self.chunk, topk=self.topk, keep_ratio=self.keep_ratio, selection=self.selection,
            value_format=self.value_format, dense_below=self.dense_below, bucket_cap_mb=self.bucket_cap_mb,
        )

    @property
    def strength(self) -> tuple[Optional[int], Optional[float]]:
        """``(topk, keep_ratio)`` with the default applied."""
        return self.codec.strength


def _check_decay(decay: Any) -> None:
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= float(decay) < 1.0:
        raise ValueError(f"decay must lie in [0, 1), got {decay!r}; the paper uses 0.999")


@dataclass(frozen=True)
class TensorSettings:
    """One tensor's departures from the :class:`DeMoConfig` (``None`` fields inherit it).

    Set by per-layer policies and the adaptive keep ratio through
    :meth:`DeMoExchange.set_tensor_settings`; every rank must set the same ones at the same step
    (a codec mismatch raises on every rank; a decay mismatch would only change local momenta).

    Args:
        decay: momentum decay beta in [0, 1) for this tensor.
        topk: coefficients kept per tile.
        keep_ratio: fraction of each tile kept, in (0, 1]; exclusive with ``topk``.
        chunk: tile side.
        dense: ``True``: whole momentum all-reduced in fp32; ``False``: compressed even when small.
    """

    decay: Optional[float] = None
    topk: Optional[int] = None
    keep_ratio: Optional[float] = None
    chunk: Optional[int] = None
    dense: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.decay is not None:
            _check_decay(self.decay)
        _ = self.codec

    @functools.cached_property
    def codec(self) -> TensorCodec:  # built once per (immutable) settings object: the step reads it per tensor
        return TensorCodec(topk=self.topk, keep_ratio=self.keep_ratio, chunk=self.chunk, dense=self.dense)


@dataclass
class ExchangeStats:
    """What the exchanges of this worker did: the last one, and running totals."""

    traffic: StepTraffic = field(default_factory=lambda: StepTraffic(0.0, 0.0, 0, 0, 0.0))
    seconds: float = 0.0
    comm_seconds: float = 0.0
    coefficients: int = 0
    n_trainable: int = 0
    steps: int = 0
    total_seconds: float = 0.0
    total_comm_seconds: float = 0.0
    energy: list[TensorEnergy] = field(default_factory=list)

    @property
    def keep_ratio(self) -> float:
        """Coefficients sent by the codec over the elements of the tensors it compressed (last step)."""
        compressed = sum(e.n_tiles * e.tile_numel for e in self.energy if e.k > 0)
        return self.coefficients / compressed if compressed else 1.0

    @property
    def energy_fraction(self) -> float:
        """Fraction of the momenta's energy the last exchange sent (all tensors together)."""
        total = sum(e.total for e in self.energy)
        return sum(e.captured for e in self.energy) / total if total > 0 else 1.0

    @property
    def sent_bytes(self) -> float:
        return self.traffic.sent_bytes

    @property
    def received_bytes(self) -> float:
        return self.traffic.received_bytes

    @property
    def payload_bytes(self) -> int:
        return self.traffic.payload_bytes

    @property
    def ratio_vs_ddp(self) -> float:
        return self.traffic.ratio_vs_ddp


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
        self._codec = CompressedMean(self.config.codec, self.comm)
        self._hidden: dict[Tensor, Tensor] = {}
        self._settings: dict[Tensor, TensorSettings] = {}
        self._want_curve = False
        self._digest_key: Optional[tuple] = None
        self._digest = 0
        self._hooks = [
            optimizer.register_step_pre_hook(self._hide_state),
            optimizer.register_step_post_hook(self._restore_state),
        ]

    # ------------------------------------------------------------------ state
    def parameters(self) -> list[Tensor]:
        """Trainable parameters in exchange order (the optimizer's ``param_groups`` order)."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def set_tensor_settings(self, param: Tensor, settings: Optional[TensorSettings]) -> None:
        """Give ``param`` its own settings from the next step on (``None`` returns it to the config's)."""
        if settings is None:
            self._settings.pop(param, None)
        elif not isinstance(settings, TensorSettings):
            raise TypeError(f"settings must be a TensorSettings or None, got {type(settings).__name__}")
        else:
            self._settings[param] = settings

    def tensor_settings(self, param: Tensor) -> TensorSettings:
        """The settings ``param`` departs from the config with (all ``None`` when it does not)."""
        return self._settings.get(param, _INHERIT)

    def decay_of(self, param: Tensor) -> float:
        """Momentum decay applied to ``param``."""
        own = self._settings.get(param)
        return float(own.decay) if own is not None and own.decay is not None else float(self.config.decay)

    def payload_bytes(self, param: Tensor, settings: Optional[TensorSettings] = None) -> int:
        """Bytes this worker puts on the wire for ``param`` per exchange, under ``settings``
        (default: its current ones)."""
        own = settings if settings is not None else self.tensor_settings(param)
        return self._codec.payload_bytes(tuple(param.shape), own.codec)

    def tile_numel(self, param: Tensor, settings: Optional[TensorSettings] = None) -> int:
        """Elements per tile of ``param`` under ``settings`` (0 when it is sent densely)."""
        own = settings if settings is not None else self.tensor_settings(param)
        layout, _ = self._codec.layout(tuple(param.shape), own.codec)
        return layout.tile_numel if layout is not None else 0

    def k_of(self, param: Tensor, settings: Optional[TensorSettings] = None) -> int:
        """Coefficients kept per tile of ``param`` under ``settings`` (0 when it is sent densely)."""
        own = settings if settings is not None else self.tensor_settings(param)
        return self._codec.layout(tuple(param.shape), own.codec)[1]

    def request_energy_curve(self) -> None:
        """Make the next :meth:`step` also compute every tensor's energy curve (a sort per tile)."""
        self._want_curve = True

    def momentum(self, param: Tensor) -> Tensor:
        """The local momentum (residual) of ``param``, created as zeros on first use."""
        state = self.optimizer.state[param]
        buf = state.get(DEMO_STATE_KEY)
        if buf is None:
            buf = self._hidden.pop(param, None)
        if buf is None:
            buf = torch.zeros(param.shape, dtype=compute_dtype(param.dtype), device=param.device)
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
            self.optimizer.state[p][DEMO_STATE_KEY] = buf.to(dtype=compute_dtype(p.dtype), device=p.device).clone()

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

    # ------------------------------------------------------------------ plan agreement
    def plan_digest(self) -> int:
        """A 64-bit digest of what decides this rank's collectives: the trainable tensors (order,
        shapes, dtypes) and their codec settings. Local (no communication); recomputed only when
        they change. Equal on every rank is what :meth:`check_plan` checks."""
        params = self.parameters()
        key = tuple((tuple(p.shape), p.dtype, self._settings[p].codec if p in self._settings else None) for p in params)
        if key != self._digest_key:
            text = repr([(shape, str(dtype), repr(codec)) for shape, dtype, codec in key]).encode()
            self._digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)
            self._digest_key = key
        return self._digest

    def check_plan(self) -> None:
        """Raise ``RuntimeError`` on every rank unless every rank's :meth:`plan_digest` is the same.

        A collective (a 16-byte all-gather, counted in the ledger's totals under ``demo/plan``, not
        in the step's traffic): every rank must call it at the same point. :meth:`step` runs it at
        every step unless the caller agreed on the digests already (the strategies carry the digest
        in their per-step non-finite guard, so they pay no extra collective).
        """
        self.comm.check_same(
            [len(self.parameters()), self.plan_digest()], "demo/plan",
            "the list of tensors to exchange (count, shapes, dtypes) or their per-tensor codec settings (topk, "
            "keep_ratio, chunk, dense: set the same TensorSettings on every rank at the same step)",
        )

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, plan_agreed: bool = False) -> ExchangeStats:
        """Run one exchange: update momenta, share their fast components, write ``p.grad``.

        Args:
            plan_agreed: the caller already established, at this step and on every rank, that every
                rank's :meth:`plan_digest` is equal; otherwise :meth:`check_plan` runs first, so a
                rank whose tensors or settings changed alone makes every rank raise the same
                ``RuntimeError`` instead of running mismatched collectives.
        """
        start = time.perf_counter()
        cfg = self.config
        self.restore_state()
        if not plan_agreed:
            self.check_plan()
        params = self.parameters()
        ledger = self.comm.ledger
        overrides = [self._settings[p].codec if p in self._settings else None for p in params]
        self._codec.plan(params, overrides)  # (re)planning checks layouts across ranks: outside the step window
        comm_before = self.comm.seconds
        want_curve, self._want_curve = self._want_curve, False
        ledger.begin_step()
        try:
            momenta = [self.momentum(p) for p in params]
            for p, m in zip(params, momenta):
                m.mul_(self.decay_of(p))
                if p.grad is not None:
                    m.add_(p.grad.to(m.dtype))
            shared, sent = self._codec(momenta, "demo", overrides, energy_curve=want_curve)
            for p, m, q, s in zip(params, momenta, shared, sent):
                m.sub_(s)  # error feedback: what was sent leaves the local momentum
                update = (torch.sign(q) if cfg.update == "sign" else q).to(p.dtype)
                if p.grad is None:
                    p.grad = update.clone()
                else:
                    p.grad.copy_(update)
        finally:
            n_trainable = sum(p.numel() for p in params)
            traffic = ledger.end_step(ddp_bytes_for(params, self.comm.world_size))
        seconds = time.perf_counter() - start
        comm_seconds = self.comm.seconds - comm_before
        st = self.stats
        st.traffic, st.seconds, st.comm_seconds = traffic, seconds, comm_seconds
        st.coefficients, st.n_trainable = self._codec.coefficients, n_trainable
        st.energy = self._codec.last_energy
        st.steps += 1
        st.total_seconds += seconds
        st.total_comm_seconds += comm_seconds
        return st


_INHERIT = TensorSettings()


def warn_if_stateful(optimizer: Optimizer) -> Optional[str]:
    """A message if ``optimizer`` keeps its own momentum (``update="sign"`` expects plain SGD)."""
    for group in optimizer.param_groups:
        if group.get("momentum", 0) or "betas" in group or group.get("lam", 0):
            return (
                f"update='sign' is DeMo's rule for plain SGD, but {type(optimizer).__name__} keeps its own momentum "
                "or moments on top of the sign; use torch.optim.SGD(momentum=0), or update='raw' for this optimizer"
            )
    return None

