"""DES-LOC: every worker runs its own optimizer; parameters and each optimizer state are averaged
across workers on their own periods.

Paper: "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training Foundation Models",
Iacob et al., arXiv 2505.22549.

After local optimizer step ``t`` (counting from 1) on every worker::

    x <- mean_workers(x)          if t % K_x == 0        (parameters, and floating-point buffers)
    s <- mean_workers(s)          if t % K_s == 0        (each named optimizer-state key s)

* ``K_x = K_u = K_v = K`` is Local Adam; with SGD-momentum and every period 1 it is DDP.
* Default periods follow the paper's half-life rule: first moments (``exp_avg``,
  ``momentum_buffer``) every ``3 K_x`` steps, second moments (``exp_avg_sq``, ``max_exp_avg_sq``)
  every ``6 K_x``; :func:`periods_from_betas` derives them from decay rates instead
  (half-life ``ln 0.5 / ln beta``). Step counters are never averaged.
* Bytes per worker per step, ring all-reduce of ``n`` parameters of ``b`` bytes:
  ``2 (W-1)/W * n * b * (1/K_x + sum_s 1/K_s)``.
* Averaging is SUM then divide (portable to gloo), bucketed (one all-reduce per dtype and
  ``bucket_cap_mb``), one ledger tag per quantity (``desloc/params``, ``desloc/buffers``,
  ``desloc/state/<key>``).
* Compressed parameter sync (``compress_params``): instead of the parameters, each worker sends
  its change since the last sync through the DeMo codec, with its own error feedback ``e``::

      d = x - x_sync + e;   (D, sent) = compressed_mean(d);   e <- d - sent;   x <- x_sync <- x_sync + D

  After the sync all workers hold the same ``x_sync``; what the codec dropped stays in ``e``.

Failure behaviour: a sync is all-or-nothing. All collectives of a step run on copies; nothing is
written back until every one has completed, so a sync that times out raises on the ranks that
reach the timeout and leaves each rank's parameters and states as they were before it.
Invalid configurations raise ``ValueError`` naming the argument; a state key that the optimizer
does not keep, or that is not floating point, is rejected at the first sync.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from demo_lightning.algorithms.compressed_mean import CodecConfig, CompressedMean, compute_dtype
from demo_lightning.comm import Communicator

__all__ = [
    "FIRST_MOMENT_KEYS",
    "SECOND_MOMENT_KEYS",
    "DesLocAverager",
    "DesLocConfig",
    "default_state_periods",
    "half_life",
    "periods_from_betas",
]

FIRST_MOMENT_KEYS = ("exp_avg", "momentum_buffer")
SECOND_MOMENT_KEYS = ("exp_avg_sq", "max_exp_avg_sq")
_NEVER_AVERAGED = ("step",)


def half_life(beta: float) -> float:
    """Steps after which a decay of ``beta`` halves a contribution: ``ln 0.5 / ln beta``."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must lie in (0, 1), got {beta}")
    return math.log(0.5) / math.log(beta)


def default_state_periods(param_sync_every: int) -> dict[str, int]:
    """The paper's ratios: first moments every 3 K_x steps, second moments every 6 K_x."""
    periods = {key: 3 * param_sync_every for key in FIRST_MOMENT_KEYS}
    periods.update({key: 6 * param_sync_every for key in SECOND_MOMENT_KEYS})
    return periods


def periods_from_betas(param_sync_every: int, optimizer: Optimizer) -> dict[str, int]:
    """State periods from the optimizer's own decay rates: ``max(K_x, round(half_life(beta)))``.

    Adam-style ``betas=(b1, b2)`` give ``exp_avg`` / ``exp_avg_sq``; SGD's ``momentum`` and
    :class:`~demo_lightning.optim.DecoupledMomentum`'s ``beta`` give ``momentum_buffer``. The first
    parameter group's values are used.
    """
    group = optimizer.param_groups[0]
    periods: dict[str, int] = {}
    if "betas" in group:
        b1, b2 = group["betas"]
        if b1 > 0:
            periods["exp_avg"] = max(param_sync_every, round(half_life(b1)))
        periods["exp_avg_sq"] = max(param_sync_every, round(half_life(b2)))
        if group.get("amsgrad"):
            periods["max_exp_avg_sq"] = periods["exp_avg_sq"]
    elif group.get("momentum", 0):
        periods["momentum_buffer"] = max(param_sync_every, round(half_life(group["momentum"])))
    elif group.get("beta", 0):
        periods["momentum_buffer"] = max(param_sync_every, round(half_life(group["beta"])))
    return periods


def _check_period(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer period >= 1 (optimizer steps between averages), got {value!r}")


@dataclass(frozen=True)
class DesLocConfig:
    """DES-LOC schedule.

    Args:
        param_sync_every: K_x, steps between parameter (and buffer) averages; ``None`` never averages them.
        state_sync_every: period per optimizer-state key, e.g. ``{"exp_avg": 48, "exp_avg_sq": 96}``.
            ``None``: the paper's 3x/6x ratios for the keys the optimizer keeps (only when
            ``param_sync_every`` is set); ``{}``: never average states.
        sync_buffers: average floating-point module buffers (BatchNorm statistics) with the parameters.
        clip_grad_norm: clip each worker's gradient to this total norm before its local step.
        compress_params: send parameter changes through the DeMo codec (see the module docstring).
        codec: codec settings for ``compress_params``.
        bucket_cap_mb: largest payload of one all-reduce.
    """

    param_sync_every: Optional[int] = 16
    state_sync_every: Optional[Mapping[str, int]] = None
    sync_buffers: bool = True
    clip_grad_norm: Optional[float] = None
    compress_params: bool = False
    codec: CodecConfig = field(default_factory=CodecConfig)
    bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        if self.param_sync_every is not None:
            _check_period("param_sync_every", self.param_sync_every)
        if self.state_sync_every is not None:
            if not isinstance(self.state_sync_every, Mapping):
                raise ValueError(
                    f"state_sync_every must map optimizer-state keys to periods, e.g. {{'exp_avg': 48, 'exp_avg_sq': 96}} "
                    f"({{}}: never average states), got {self.state_sync_every!r}"
                )
            for key, period in self.state_sync_every.items():
                if key in _NEVER_AVERAGED:
                    raise ValueError(f"state_sync_every[{key!r}]: step counters are never averaged; remove {key!r}")
                _check_period(f"state_sync_every[{key!r}]", period)
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, (int, float)) and self.clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm must be > 0 (or None), got {self.clip_grad_norm!r}")
        for name in ("sync_buffers", "compress_params"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.compress_params and self.param_sync_every is None:
            raise ValueError(
                "compress_params=True needs param_sync_every (the parameter sync it compresses): set param_sync_every, "
                "or compress_params=False"
            )
        if not isinstance(self.bucket_cap_mb, (int, float)) or not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")

    @property
    def state_periods(self) -> dict[str, int]:
        """Periods per state key, with the default applied."""
        if self.state_sync_every is not None:
            return dict(self.state_sync_every)
        return default_state_periods(self.param_sync_every) if self.param_sync_every is not None else {}

    @property
    def enabled(self) -> bool:
        return self.param_sync_every is not None or bool(self.state_periods)


@dataclass
class SyncStats:
    """Counters of what was averaged."""

    steps: int = 0
    syncs: dict[str, int] = field(default_factory=dict)


class DesLocAverager:
    """Attach DES-LOC averaging to a module's parameters and an optimizer (no Lightning needed).

    Call :meth:`before_step` before ``optimizer.step()`` (gradient clipping, if configured) and
    :meth:`after_step` after it (averaging when due), or :meth:`attach` to do both through the
    optimizer's step hooks.

    Args:
        optimizer: the worker's optimizer.
        config: the schedule.
        communicator: collectives and ledger.
        buffers: module buffers to average with the parameters (floating point ones only).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        config: Optional[DesLocConfig] = None,
        communicator: Optional[Communicator] = None,
        buffers: Iterable[Tensor] = (),
    ) -> None:
        self.optimizer = optimizer
        self.config = config if config is not None else DesLocConfig()
        self.comm = communicator if communicator is not None else Communicator()
        self.buffers = [b for b in buffers if b.is_floating_point()] if self.config.sync_buffers else []
        self.step_count = 0
        self.stats = SyncStats()
        self._periods: Optional[dict[str, int]] = None
        self._layout_key: Optional[tuple] = None
        self._codec = CompressedMean(self.config.codec, self.comm) if self.config.compress_params else None
        self._anchor: list[Tensor] = []
        self._residual: list[Tensor] = []
        if self._codec is not None:
            self.reset_anchor()
        self._hooks: list[Any] = []

    def reset_anchor(self) -> None:
        """Take the current parameters as the last synced point (compressed sync only).

        Called on construction, so build the averager while the replicas are identical (right after
        the initial broadcast); every rank must call it at the same point.
        """
        params = self.parameters()
        self._anchor = [p.detach().clone() for p in params]
        self._residual = [torch.zeros_like(p) for p in params]

    # ------------------------------------------------------------------ wiring
    def parameters(self) -> list[Tensor]:
        """Trainable parameters in the optimizer's order (frozen ones are identical everywhere)."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def attach(self) -> "DesLocAverager":
        """Run :meth:`before_step` / :meth:`after_step` from the optimizer's own step hooks."""
        self._hooks = [
            self.optimizer.register_step_pre_hook(lambda *_: self.before_step()),
            self.optimizer.register_step_post_hook(lambda *_: self.after_step()),
        ]
        return self

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def before_step(self) -> None:
        """Clip this worker's gradients (if ``clip_grad_norm`` is set)."""
        if self.config.clip_grad_norm is not None:
            grads = [p for p in self.parameters() if p.grad is not None]
            if grads:
                torch.nn.utils.clip_grad_norm_(grads, self.config.clip_grad_norm)

    def due(self, step: Optional[int] = None) -> list[str]:
        """Quantities averaged after local step ``step`` (default: the next one)."""
        t = self.step_count + 1 if step is None else step
        names = []
        if self.config.param_sync_every is not None and t % self.config.param_sync_every == 0:
            names.append("params")
        names += [f"state/{key}" for key, period in self.state_periods.items() if t % period == 0]
        return names

    # ------------------------------------------------------------------ state keys
    def _state_tensors(self, key: str) -> tuple[list[Tensor], list[Optional[Tensor]]]:
        """``(values to average, write-back targets)`` of ``key`` for every trainable parameter.

        Values travel in the parameter's compute dtype (fp32 for half-precision parameters). A
        parameter that has no such state on this worker (it never had a gradient here) contributes
        zeros and receives nothing, so every worker hands the collectives the same sizes and dtypes.
        """
        values: list[Tensor] = []
        targets: list[Optional[Tensor]] = []
        for p in self.parameters():
            value = self.optimizer.state.get(p, {}).get(key)
            if value is None:
                values.append(torch.zeros(p.shape, dtype=compute_dtype(p.dtype), device=p.device))
                targets.append(None)
                continue
            if value.shape != p.shape:
                raise ValueError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)} for a parameter of shape {tuple(p.shape)}; "
                    "only states shaped like their parameter can be averaged: remove it from state_sync_every"
                )
            values.append(value.to(compute_dtype(p.dtype)))
            targets.append(value)
        return values, targets

    @property
    def state_periods(self) -> dict[str, int]:
        """Periods of the state keys averaged (defaults resolved to the keys the optimizer keeps)."""
        return dict(self._periods) if self._periods is not None else self.config.state_periods

    def _resolve_state_keys(self) -> None:
        """Validate named keys against the optimizer's state, once, identically on every rank."""
        if self._periods is not None:
            return
        present: dict[str, Any] = {}
        for p in self.parameters():
            for key, value in self.optimizer.state.get(p, {}).items():
                present.setdefault(key, value)
        explicit = self.config.state_sync_every is not None
        periods: dict[str, int] = {}
        for key, period in self.config.state_periods.items():
            value = present.get(key)
            if value is None:
                if explicit:
                    raise ValueError(
                        f"state_sync_every names {key!r}, but {type(self.optimizer).__name__} keeps only "
                        f"{sorted(present) or 'no state'}; name one of those keys"
                    )
                continue
            if not (isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0):
                raise ValueError(
                    f"state_sync_every[{key!r}]: {type(self.optimizer).__name__}'s {key!r} is not a floating-point "
                    "tensor per parameter, so it cannot be averaged; remove it"
                )
            periods[key] = period
        fingerprint = [len(periods)] + [zlib.crc32(f"{k}={v}".encode()) for k, v in sorted(periods.items())]
        self.comm.check_same(fingerprint, "desloc/keys", "the optimizer-state keys to average")
        self._periods = periods

    # ------------------------------------------------------------------ averaging
    @torch.no_grad()
    def after_step(self) -> list[str]:
        """Count one local step and average what is due; returns the quantities averaged."""
        self._resolve_state_keys()
        names = self.due()
        if names:
            self._sync(names)
        self.step_count += 1
        self.stats.steps = self.step_count
        for name in names:
            self.stats.syncs[name] = self.stats.syncs.get(name, 0) + 1
        return names

    def sync_now(self, names: Optional[list[str]] = None) -> list[str]:
        """Average ``names`` (default: parameters and every configured state) immediately."""
        self._resolve_state_keys()
        names = names if names is not None else ["params", *(f"state/{k}" for k in self.state_periods)]
        self._sync(names)
        return names

    def _check_layout(self) -> None:
        """Compare the averaged tensors' layout across ranks whenever it changes (one tiny all-gather)."""
        tensors = [*self.parameters(), *self.buffers]
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        if key != self._layout_key:
            fingerprint = [len(tensors)] + [v for t in tensors for v in (t.numel(), t.dim(), zlib.crc32(str(t.dtype).encode()))]
            self.comm.check_same(fingerprint, "desloc/layout", "the parameters and buffers to average")
            self._layout_key = key

    @torch.no_grad()
    def _sync(self, names: list[str]) -> None:
        self._check_layout()
        writes: list[tuple[list[Optional[Tensor]], list[Tensor]]] = []
        for name in names:
            if name == "params":
                params = self.parameters()
                if self._codec is not None:
                    writes += self._compressed_param_sync(params)
                else:
                    writes.append((params, self._mean(params, "desloc/params")))
                if self.buffers:
                    writes.append((self.buffers, self._mean(self.buffers, "desloc/buffers")))
            else:
                key = name.split("/", 1)[1]
                values, targets = self._state_tensors(key)
                writes.append((targets, self._mean(values, f"desloc/state/{key}")))
        for targets, means in writes:  # only after every collective completed
            for target, mean in zip(targets, means):
                if target is not None:
                    target.copy_(mean)

    def _mean(self, tensors: list[Tensor], tag: str) -> list[Tensor]:
        """Exact mean over workers, as new tensors (the inputs are not modified).

        One all-reduce per dtype/device group and ``bucket_cap_mb``, in the tensors' own dtype.
        """
        world = self.comm.world_size
        cap = int(self.config.bucket_cap_mb * 1024 * 1024)
        buckets: dict[tuple[torch.dtype, torch.device], list[list[int]]] = {}
        for i, t in enumerate(tensors):
            group = buckets.setdefault((t.dtype, t.device), [[]])
            size = sum(tensors[j].numel() * t.element_size() for j in group[-1])
            if group[-1] and size + t.numel() * t.element_size() > cap:
                group.append([])
            group[-1].append(i)
        out: list[Optional[Tensor]] = [None] * len(tensors)
        for group in buckets.values():
            for bucket in group:
                flat = torch.cat([tensors[j].detach().reshape(-1) for j in bucket])
                self.comm.all_reduce_sum_(flat, tag)
                flat.div_(world)
                for j, part in zip(bucket, torch.split(flat, [tensors[j].numel() for j in bucket])):
                    out[j] = part.view_as(tensors[j])
        return [t for t in out if t is not None]

    def _compressed_param_sync(self, params: list[Tensor]) -> list[tuple[list[Optional[Tensor]], list[Tensor]]]:
        assert self._codec is not None
        deltas = [p.detach() - a + e for p, a, e in zip(params, self._anchor, self._residual)]
        means, sent = self._codec(deltas, "desloc/params_compressed")
        new_anchor = [a + m.to(a.dtype) for a, m in zip(self._anchor, means)]
        new_residual = [d - s.to(d.dtype) for d, s in zip(deltas, sent)]
        return [(list(params), new_anchor), (list(self._anchor), new_anchor), (list(self._residual), new_residual)]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Schedule position (and, with compressed sync, this worker's anchor and residual)."""
        state: dict[str, Any] = {"step_count": self.step_count, "syncs": dict(self.stats.syncs)}
        if self._anchor:
            state["anchor"] = [a.clone() for a in self._anchor]
            state["residual"] = [e.clone() for e in self._residual]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install a :meth:`state_dict`; nothing changes when it does not fit.

        Raises:
            ValueError: the saved anchor or residual (compressed sync) does not match the trainable
                parameters in count and shapes (a checkpoint of a different model).
        """
        params = self.parameters()
        if "anchor" in state:
            for name in ("anchor", "residual"):
                shapes = [tuple(t.shape) for t in state[name]]
                if shapes != [tuple(p.shape) for p in params]:
                    raise ValueError(
                        f"saved DES-LOC {name} holds {len(shapes)} tensors of shapes {shapes[:4]}{'...' if len(shapes) > 4 else ''}; "
                        f"the optimizer's {len(params)} trainable parameters differ: the checkpoint comes from a different "
                        "model (or a different set of trainable parameters)"
                    )
        self.step_count = int(state["step_count"])
        self.stats.steps = self.step_count
        self.stats.syncs = dict(state.get("syncs", {}))
        if "anchor" in state:
            self._anchor = [a.to(p.device, p.dtype).clone() for a, p in zip(state["anchor"], params)]
            self._residual = [e.to(p.device, p.dtype).clone() for e, p in zip(state["residual"], params)]
        elif self._codec is not None:
            self.reset_anchor()

