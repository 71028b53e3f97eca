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

Profiling (:mod:`~demo_lightning.profiling`): each due average runs inside the stage range
``desloc/sync``, with ``desloc/sync/params`` (the exact mean, or the compressed sync and its
``codec/...`` ranges), ``desloc/sync/buffers`` and ``desloc/sync/state/<key>`` per state key inside
it; local clipping runs inside ``desloc/clip`` and the final average inside ``desloc/final``.

Periods that change at run time (:meth:`DesLocAverager.set_period`, used by
:class:`~demo_lightning.algorithms.adaptive_periods.AdaptivePeriodController`): each quantity ``q``
(``"params"``, ``"state/<key>"``) has a period ``K_q`` and an anchor ``a_q`` (0 until its period is
changed; then the local step at which it was changed), and is averaged after local step ``t`` when
``t > a_q and (t - a_q) % K_q == 0``. With no change this is ``t % K_q == 0``. Periods and anchors
are in :meth:`~DesLocAverager.state_dict` (a checkpoint without them loads as the configured
schedule), so a resume continues the same schedule.

Divergence (:attr:`DesLocAverager.measure_divergence`, off by default): at each sync, for every
quantity averaged, this rank's relative distance from the mean over all its tensors,
``d_q = ||v_r - mean(v)|| / ||mean(v)||`` (a compressed parameter sync compares the replica with the
new synced point), computed locally after the collectives (no extra collective; one host read per
sync), in :attr:`~DesLocAverager.last_divergence`. Off, it costs nothing.

Failure behaviour: a sync is all-or-nothing. All collectives of a step run on copies; nothing is
written back until every one has completed, so a sync that times out raises on the ranks that
reach the timeout and leaves each rank's parameters and states as they were before it.
Invalid configurations raise ``ValueError`` naming the argument; a state key that the optimizer
does not keep, or that is not floating point, is rejected at the first sync.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from demo_lightning.algorithms.clipping import clip_gradients
from demo_lightning.algorithms.compressed_mean import CompressedMean
from demo_lightning.algorithms.config import CodecConfig, compute_dtype
from demo_lightning.comm import Communicator
from demo_lightning.profiling import (
    DESLOC_CLIP,
    DESLOC_FINAL,
    DESLOC_SYNC,
    DESLOC_SYNC_BUFFERS,
    DESLOC_SYNC_PARAMS,
    desloc_sync_state,
    stage_range,
)
from demo_lightning.validation import check_bool, check_number, check_period, check_periods

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
        final_sync: average parameters and buffers once more when training ends (the strategies call
            :meth:`DesLocAverager.final_sync` from ``on_train_end``), so every rank holds, saves and
            evaluates the averaged model rather than its own replica up to ``K_x - 1`` steps past the
            last average.
    """

    param_sync_every: Optional[int] = 16
    state_sync_every: Optional[Mapping[str, int]] = None
    sync_buffers: bool = True
    clip_grad_norm: Optional[float] = None
    compress_params: bool = False
    codec: CodecConfig = field(default_factory=CodecConfig)
    bucket_cap_mb: float = 25.0
    final_sync: bool = True

    def __post_init__(self) -> None:
        if self.param_sync_every is not None:
            check_period("param_sync_every", self.param_sync_every)
        if self.state_sync_every is not None:
            periods = check_periods(
                "state_sync_every", self.state_sync_every, "optimizer-state keys",
                "{'exp_avg': 48, 'exp_avg_sq': 96} ({}: never average states)",
                never={key: "step counters are never averaged" for key in _NEVER_AVERAGED},
            )
            object.__setattr__(self, "state_sync_every", periods)
        if self.clip_grad_norm is not None:
            check_number("clip_grad_norm", self.clip_grad_norm, 0.0, low_open=True, hint="a total gradient norm, or None")
        for name in ("sync_buffers", "compress_params", "final_sync"):
            check_bool(name, getattr(self, name))
        if self.compress_params and self.param_sync_every is None:
            raise ValueError(
                "compress_params=True needs param_sync_every (the parameter sync it compresses): set param_sync_every, "
                "or compress_params=False"
            )
        check_number("bucket_cap_mb", self.bucket_cap_mb, 0.0, low_open=True, hint="megabytes per all-reduce")
        if self.codec.selection == "shared":
            raise ValueError(
                "codec selection='shared' is for the DeMo exchange (DeMoStrategy); DES-LOC's compressed parameter sync "
                "takes selection='topk' or 'lowpass'"
            )

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
    optimizer's step hooks. Call :meth:`final_sync` once when training ends (every rank), so the
    model every rank holds, saves and evaluates is the averaged one.

    Every method that communicates must be called on every rank at the same point: the schedule
    is a function of the local step count, which advances identically everywhere.

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
        self._adopt_into_empty = False
        self._codec = CompressedMean(self.config.codec, self.comm) if self.config.compress_params else None
        # compressed sync: per parameter, the last synced point and this worker's unsent change
        self._anchor: dict[Tensor, Tensor] = {}
        self._residual: dict[Tensor, Tensor] = {}
        self._synced: list[Tensor] = self.parameters()  # the trainable set of the last parameter sync
        self._params_synced_at: Optional[int] = None
        self._local_replica: Optional[tuple[list[Tensor], list[Tensor]]] = None
        if self._codec is not None:
            self.reset_anchor()
        self._hooks: list[Any] = []
        # periods changed at run time: quantity -> period, and the local step it was changed at
        self._period_override: dict[str, int] = {}
        self._period_anchor: dict[str, int] = {}
        self.measure_divergence = False
        """Measure each rank's relative divergence from the mean at every sync (see the module docstring)."""
        self.last_divergence: dict[str, float] = {}
        """Quantity -> this rank's ``||v_r - mean|| / ||mean||`` at the last sync that averaged it
        (cleared at every sync; filled only with :attr:`measure_divergence`)."""
        self._observers: list[Callable[["DesLocAverager", list[str]], None]] = []
        self._sources: dict[str, Callable[[], Mapping[Tensor, Tensor]]] = {}
        self._source_groups: dict[str, dist.ProcessGroup] = {}

    def add_state_source(
        self, key: str, tensors: Callable[[], Mapping[Tensor, Tensor]], group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """Average, under the state key ``key``, state that lives outside the optimizer: ``tensors()``
        returns the stored tensors by parameter (any shape, the same on every rank; written in
        place). The DeMo exchange registers its momentum (:meth:`DeMoExchange.averaged_state`)
        as ``"demo_momentum"`` this way. When a sync of ``key`` runs, the source must hold a tensor
        for every trainable parameter on every rank, laid out alike (the exchange does after each of
        its steps, which is when the strategies sync): the mean is taken over the ranks that hold one,
        and nothing is adopted into the optimizer's state.

        ``group``: average over this process group instead (the exchange's inter-node group under a
        node hierarchy, whose ranks hold the same share of the tensors): exactly the tensors
        ``tensors()`` returns, which must then be the same list, shapes and order on every rank of it."""
        self._sources[key] = tensors
        if group is not None:
            self._source_groups[key] = group

    def reset_anchor(self) -> None:
        """Take the current parameters as the last synced point (compressed sync only).

        Called on construction, so build the averager while the replicas are identical (right after
        the initial broadcast); every rank must call it at the same point.
        """
        params = self.parameters()
        self._anchor = {p: p.detach().clone() for p in params}
        self._residual = {p: torch.zeros_like(p) for p in params}
        self._synced = params
        self._local_replica = None

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

    def follow_parameters(self) -> None:
        """Move the compressed sync's anchors and unsent changes, and a local replica kept by
        :meth:`final_sync`, to their parameters' (buffers') current devices; drop the codec's
        scratch buffers. For after the model moved (see :meth:`DeMoExchange.follow_parameters`);
        values are kept bitwise. Every rank must call it alike (the codec's plan is compared across
        ranks when it is rebuilt at the next compressed sync)."""
        for store in (self._anchor, self._residual):
            for p, value in store.items():
                store[p] = value.to(p.device)
        if self._local_replica is not None:
            params, buffers = self._local_replica
            self._local_replica = ([t.to(p.device) for t, p in zip(params, self.parameters())],
                                   [t.to(b.device) for t, b in zip(buffers, self.buffers)])
        if self._codec is not None:
            self._codec.drop_workspace()

    # step participant hooks (demo_lightning.algorithms.participants)
    def before_update(self, step: Any) -> None:
        self.before_step()

    def after_update(self, step: Any) -> None:
        self.after_step()

    def before_step(self) -> None:
        """Clip this worker's gradients (if ``clip_grad_norm`` is set)."""
        if self.config.clip_grad_norm is not None:
            with stage_range(DESLOC_CLIP):
                clip_gradients(self.parameters(), self.config.clip_grad_norm)

    def due(self, step: Optional[int] = None) -> list[str]:
        """Quantities averaged after local step ``step`` (default: the next one): ``q`` is due when
        ``step > a_q`` and ``(step - a_q) % K_q == 0`` (anchor ``a_q`` 0 unless its period was changed)."""
        t = self.step_count + 1 if step is None else step
        return [
            name for name, period in self.periods.items()
            if t > (anchor := self._period_anchor.get(name, 0)) and (t - anchor) % period == 0
        ]

    @property
    def periods(self) -> dict[str, int]:
        """The current period of every quantity averaged: ``"params"`` (when ``param_sync_every`` is
        set) and ``"state/<key>"`` per state key, with run-time changes (:meth:`set_period`) applied."""
        out: dict[str, int] = {}
        if self.config.param_sync_every is not None:
            out["params"] = self._period_override.get("params", self.config.param_sync_every)
        out.update({f"state/{key}": period for key, period in self.state_periods.items()})
        return out

    def set_period(self, name: str, period: int) -> None:
        """Average quantity ``name`` (``"params"`` or ``"state/<key>"``) every ``period`` local steps
        from now on: its schedule is re-anchored at the current step, so the next average is after
        local step ``step_count + period``. Every rank must make the same change at the same step.

        Raises:
            ValueError: ``name`` is not a quantity this averager averages (naming those it does), or
                ``period`` is not an integer >= 1.
        """
        known = self.periods
        if name not in known:
            raise ValueError(
                f"set_period: name={name!r} is not averaged by this DES-LOC averager; it averages {sorted(known)}"
            )
        check_period("period", period)
        if period == known[name]:
            return  # unchanged: keep the phase
        self._period_override[name] = int(period)
        self._period_anchor[name] = self.step_count

    def add_sync_observer(self, observer: Callable[["DesLocAverager", list[str]], None]) -> Callable[[], None]:
        """Call ``observer(averager, names)`` at the end of every :meth:`after_step` that averaged
        ``names`` (inside the optimizer step, so its collectives count in the step's traffic; never
        for :meth:`sync_now` or :meth:`final_sync`). Returns a function that removes it."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    # ------------------------------------------------------------------ state keys
    def _state_tensors(self, key: str) -> tuple[list[Tensor], list[Optional[Tensor]], list[bool]]:
        """``(values to average, write-back targets, held here)`` of ``key`` for every trainable parameter.

        Values travel in the parameter's compute dtype (fp32 for half-precision parameters). A
        parameter that has no such state on this worker (it never had a gradient here) contributes
        zeros and is not counted in the mean, so every worker hands the collectives the same sizes
        and dtypes and the mean is taken over the workers that hold the state.
        """
        values: list[Tensor] = []
        targets: list[Optional[Tensor]] = []
        held: list[bool] = []
        source = self._sources[key]() if key in self._sources else None
        for p in self.parameters():
            if source is not None:
                value = source.get(p)
                if value is not None:  # the source's own layout (e.g. spectra), agreed by its owner
                    values.append(value)
                    targets.append(value)
                    held.append(True)
                    continue
            else:
                value = self.optimizer.state.get(p, {}).get(key)
            if value is None:
                values.append(torch.zeros(p.shape, dtype=compute_dtype(p.dtype), device=p.device))
                targets.append(None)
                held.append(False)
                continue
            if value.shape != p.shape:
                raise ValueError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)} for a parameter of shape {tuple(p.shape)}; "
                    "only states shaped like their parameter can be averaged: remove it from state_sync_every"
                )
            values.append(value.to(compute_dtype(p.dtype)))
            targets.append(value)
            held.append(True)
        return values, targets, held

    @property
    def state_periods(self) -> dict[str, int]:
        """Periods of the state keys averaged (defaults resolved to the keys the optimizer keeps;
        run-time changes by :meth:`set_period` applied)."""
        base = dict(self._periods) if self._periods is not None else self.config.state_periods
        return {key: self._period_override.get(f"state/{key}", period) for key, period in base.items()}

    def _resolve_state_keys(self) -> None:
        """Decide, once and identically on every rank, which state keys are averaged.

        Every rank reports, per configured key, whether its optimizer keeps it (for any
        parameter), and whether any parameter's value is not a floating-point tensor shaped like
        its parameter (0-D parameters have 0-D states: those are fine); one all-gather of a byte
        per key. A key is averaged if some rank keeps it; a key named in ``state_sync_every`` that
        no rank keeps, or one malformed anywhere, raises ``ValueError`` on every rank.
        """
        if self._periods is not None:
            return
        configured = sorted(self.config.state_periods.items())
        fingerprint = [len(configured)] + [zlib.crc32(f"{k}={v}".encode()) for k, v in configured]
        self.comm.check_same(fingerprint, "desloc/keys", "the optimizer-state keys and periods to average (state_sync_every)")
        present: set[str] = {key for key, tensors in self._sources.items() if tensors()}
        malformed: dict[str, str] = {}
        for p in self.parameters():
            for key, value in self.optimizer.state.get(p, {}).items():
                present.add(key)
                if key in malformed or key not in self.config.state_periods:
                    continue
                if not isinstance(value, Tensor) or not value.is_floating_point():
                    malformed[key] = f"a {type(value).__name__ if not isinstance(value, Tensor) else value.dtype}"
                elif value.shape != p.shape:
                    malformed[key] = f"shape {tuple(value.shape)} for a parameter of shape {tuple(p.shape)}"
        codes = [2 if key in malformed else int(key in present) for key, _ in configured]
        extra = int(bool(present - set(self.config.state_periods)))  # keys kept beside the averaged ones (a step counter)
        mine = torch.tensor([*codes, extra], dtype=torch.uint8, device=self.comm.device)
        rows = [g.cpu().tolist() for g in self.comm.all_gather_bytes(mine, "desloc/keys", per_step=False).wait()]
        optimizer = type(self.optimizer).__name__
        periods: dict[str, int] = {}
        for index, (key, period) in enumerate(configured):
            bad = [rank for rank, row in enumerate(rows) if row[index] == 2]
            if bad:
                detail = f" (here: {malformed[key]})" if key in malformed else ""
                raise ValueError(
                    f"state_sync_every[{key!r}]: {optimizer}'s {key!r} is not a floating-point tensor shaped like its "
                    f"parameter on rank(s) {bad}{detail}, so it cannot be averaged; remove it"
                )
            if not any(row[index] for row in rows):
                if self.config.state_sync_every is not None:
                    raise ValueError(
                        f"state_sync_every names {key!r}, but {optimizer} keeps only {sorted(present) or 'no state'}; "
                        "name one of those keys (no rank's optimizer keeps it)"
                    )
                continue
            periods[key] = period
        self._adopt_into_empty = not any(row[-1] for row in rows)
        self._periods = periods

    # ------------------------------------------------------------------ averaging
    @torch.no_grad()
    def after_step(self) -> list[str]:
        """Count one local step and average what is due; returns the quantities averaged."""
        self._local_replica = None
        self._resolve_state_keys()
        names = self.due()
        if names:
            with stage_range(DESLOC_SYNC):
                self._sync(names)
        self.step_count += 1
        self.stats.steps = self.step_count
        if "params" in names:
            self._params_synced_at = self.step_count
        for name in names:
            self.stats.syncs[name] = self.stats.syncs.get(name, 0) + 1
        if names:
            for observer in list(self._observers):
                observer(self, names)
        return names

    def sync_now(self, names: Optional[list[str]] = None) -> list[str]:
        """Average ``names`` (default: parameters and every configured state) immediately."""
        self._resolve_state_keys()
        names = names if names is not None else ["params", *(f"state/{k}" for k in self.state_periods)]
        with stage_range(DESLOC_SYNC):
            self._sync(names)
        if "params" in names:
            self._params_synced_at = self.step_count
        return names

    @torch.no_grad()
    def final_sync(self) -> bool:
        """Average the parameters (exactly, in their own dtype) and buffers once more when training ends.

        Between syncs each replica is up to ``K_x - 1`` local steps past the last average; this makes
        every rank hold the averaged model for checkpoints' weights, validation, test and export.
        Skipped (returns ``False``) when parameters are not averaged at all (``param_sync_every=None``),
        when nothing was trained, when the last local step ended on a parameter sync, or when it
        already ran since that step. Each rank's replica as it was before this average is kept in
        :meth:`local_replica` until the next local step, so a checkpoint can still resume every
        rank's own trajectory bitwise; the schedule, optimizer state and (compressed sync) anchor and
        residual are left as they were. Recorded under ``desloc/final/*``, outside any step's traffic.
        Every rank must call it.
        """
        if (
            self.config.param_sync_every is None
            or self.step_count == 0
            or self._params_synced_at == self.step_count
            or self._local_replica is not None
        ):
            return False
        with stage_range(DESLOC_FINAL):
            self._final_sync()
        return True

    def _final_sync(self) -> None:
        params = self.parameters()
        current = set(params)
        left = [p for p in self._synced if p not in current]  # frozen since the last sync: averaged too
        self._check_layout(params, [len(left)])
        params = [*params, *left]
        writes: list[tuple[list[Optional[Tensor]], list[Tensor]]] = [(list(params), self._mean(params, "desloc/final/params"))]
        if self.buffers:
            writes.append((self.buffers, self._mean(self.buffers, "desloc/final/buffers")))
        replica = ([p.detach().clone() for p in params[: len(current)]], [b.detach().clone() for b in self.buffers])
        self._write(writes)
        self._local_replica = replica
        self.stats.syncs["final"] = self.stats.syncs.get("final", 0) + 1

    def local_replica(self) -> tuple[list[Tensor], list[Tensor]]:
        """This rank's own ``(parameters, buffers)``: as they were before :meth:`final_sync` if it
        ran since the last local step, else the current ones (the tensors themselves)."""
        if self._local_replica is not None:
            return self._local_replica
        return [p.detach() for p in self.parameters()], [b.detach() for b in self.buffers]

    def _check_layout(self, params: list[Tensor], changes: list[int]) -> None:
        """Compare the averaged tensors' layout across ranks (one 16-byte all-gather, at every sync).

        Every rank runs it at every sync, whatever changed locally, so a rank whose trainable set
        changed alone still meets its peers in the same collective and every rank raises the same
        ``RuntimeError`` (a check only on the ranks that changed would leave the collectives out of
        step). ``changes`` adds the counts of tensors that joined or left the trainable set.
        """
        tensors = [*params, *self.buffers]
        fingerprint = [len(tensors)] + [v for t in tensors for v in (t.numel(), t.dim(), zlib.crc32(str(t.dtype).encode()))]
        self.comm.check_same(fingerprint + changes, "desloc/layout", "the parameters and buffers to average")

    @torch.no_grad()
    def _sync(self, names: list[str]) -> None:
        params = self.parameters()
        current = set(params)
        left = [p for p in self._synced if p not in current] if "params" in names else []
        joined = [p for p in params if p not in self._anchor] if "params" in names and self._codec is not None else []
        self._check_layout(params, [len(left), len(joined)])
        writes: list[tuple[list[Optional[Tensor]], list[Tensor]]] = []
        adoptions: list[tuple[Tensor, str, Tensor]] = []
        new_codec_state: Optional[tuple[dict[Tensor, Tensor], dict[Tensor, Tensor]]] = None
        compared: dict[str, tuple[list[Tensor], list[Tensor]]] = {}  # quantity -> (this rank's values, means)
        self.last_divergence = {}
        for name in names:
            if name == "params":
                with stage_range(DESLOC_SYNC_PARAMS):
                    if left:  # frozen since the last sync: one last exact average, so replicas stay identical
                        writes.append((list(left), self._mean(left, "desloc/params_left")))
                    if self._codec is not None:
                        pairs, new_codec_state = self._compressed_param_sync(params, joined)
                        writes += pairs
                        synced = {p: m for targets, means in pairs for p, m in zip(targets, means) if p is not None}
                        compared[name] = (list(params), [synced[p] for p in params])
                    else:
                        writes.append((list(params), self._mean(params, "desloc/params")))
                        compared[name] = (list(params), writes[-1][1])
                if self.buffers:
                    with stage_range(DESLOC_SYNC_BUFFERS):
                        writes.append((self.buffers, self._mean(self.buffers, "desloc/buffers")))
            else:
                key = name.split("/", 1)[1]
                with stage_range(desloc_sync_state(key)):
                    if key in self._source_groups:  # a share of the tensors, averaged over the ranks that hold the same share
                        shared = list(self._sources[key]().values())
                        writes.append((list(shared), self._mean(shared, f"desloc/state/{key}", group=self._source_groups[key])))
                        compared[name] = (shared, writes[-1][1])
                        continue
                    values, targets, held = self._state_tensors(key)
                    means = self._mean(values, f"desloc/state/{key}", held=held)
                writes.append((targets, means))
                kept = [i for i, (h, m) in enumerate(zip(held, means)) if h and m is not _NOBODY]
                compared[name] = ([values[i] for i in kept], [means[i] for i in kept])
                adoptions += self._adoptions(key, params, held, means)
        if self.measure_divergence:
            self.last_divergence = self._divergence(compared)
        self._write(writes)
        for p, key, mean in adoptions:
            self.optimizer.state[p][key] = mean.to(p.dtype).clone()
        if "params" in names:
            self._synced = params
            if new_codec_state is not None:
                self._anchor, self._residual = new_codec_state

    @staticmethod
    def _divergence(compared: Mapping[str, tuple[list[Tensor], list[Tensor]]]) -> dict[str, float]:
        """Per quantity ``||v - m|| / ||m||`` over all its tensors, in float64, with one host read for
        all of them (``0`` where both norms are 0, ``inf`` where only the mean's is; NaN propagates)."""
        rows: list[Tensor] = []
        for values, means in compared.values():
            parts = [
                torch.stack([(v.detach().double() - m.detach().double()).pow(2).sum(), m.detach().double().pow(2).sum()])
                for v, m in zip(values, means)
            ]
            device = parts[0].device if parts else torch.device("cpu")
            rows.append(torch.stack([part.to(device) for part in parts]).sum(0) if parts else torch.zeros(2, dtype=torch.float64))
        table = torch.stack([row.to(rows[0].device) for row in rows]).cpu().tolist() if rows else []  # the one host read
        out: dict[str, float] = {}
        for name, (diff, norm) in zip(compared, table):
            if norm > 0 or math.isnan(norm):
                out[name] = math.sqrt(diff / norm) if not math.isnan(diff) else math.nan
            else:
                out[name] = 0.0 if diff == 0 else math.inf
        return out

    @staticmethod
    def _write(writes: list[tuple[list[Optional[Tensor]], list[Tensor]]]) -> None:
        for targets, means in writes:  # only after every collective completed
            for target, mean in zip(targets, means):
                if target is not None:
                    target.copy_(mean)

    def _adoptions(self, key: str, params: list[Tensor], held: list[bool], means: list[Tensor]) -> list[tuple[Tensor, str, Tensor]]:
        """Where ranks without ``key`` for a parameter take the holders' mean: ``(param, key, mean)``.

        Where this rank's optimizer keeps other state for the parameter, the missing key is added.
        Where it keeps nothing for the parameter yet, the mean is adopted only if no rank's optimizer
        keeps any key beside the averaged ones: SGD's ``momentum_buffer`` is its whole state, but
        Adam's moments without its ``step`` counter would break its next step, so Adam-style states
        start from zero at this rank's first gradient for the parameter, as the optimizer itself does.
        """
        if key in self._sources:  # state outside the optimizer: its owner lays it out, never adopted here
            return []
        return [
            (p, key, mean) for p, h, mean in zip(params, held, means)
            if not h and mean is not _NOBODY and (self.optimizer.state.get(p) or self._adopt_into_empty)
        ]

    def _mean(
        self, tensors: list[Tensor], tag: str, held: Optional[list[bool]] = None, group: Optional[dist.ProcessGroup] = None,
    ) -> list[Tensor]:
        """Exact mean over workers, as new tensors (the inputs are not modified).

        One all-reduce per dtype/device group and ``bucket_cap_mb``, in the tensors' own dtype.
        With ``held`` (states), each bucket carries one count per tensor (``1`` where this rank
        holds it) in the same all-reduce, and each mean is the sum over the holders divided by
        their number; a tensor no rank holds comes back as :data:`_NOBODY`.
        """
        world = self.comm.world_size_of(group)
        cap = int(self.config.bucket_cap_mb * 1024 * 1024)
        buckets: dict[tuple[torch.dtype, torch.device], list[list[int]]] = {}
        for i, t in enumerate(tensors):
            lanes = buckets.setdefault((t.dtype, t.device), [[]])
            size = sum(tensors[j].numel() * t.element_size() for j in lanes[-1])
            if lanes[-1] and size + t.numel() * t.element_size() > cap:
                lanes.append([])
            lanes[-1].append(i)
        out: list[Optional[Tensor]] = [None] * len(tensors)
        for (dtype, device), lanes in buckets.items():
            for bucket in lanes:
                parts = [tensors[j].detach().reshape(-1) for j in bucket]
                if held is not None:
                    parts.append(torch.tensor([float(held[j]) for j in bucket], dtype=dtype, device=device))
                flat = torch.cat(parts)
                self.comm.all_reduce_sum_(flat, tag, group=group).wait()
                sizes = [tensors[j].numel() for j in bucket]
                if held is None:
                    flat.div_(world)
                    divisors = None
                else:
                    divisors = flat[sum(sizes):].cpu().tolist()  # holders per tensor (a host read per state sync)
                for n, (j, part) in enumerate(zip(bucket, torch.split(flat[: sum(sizes)], sizes))):
                    if divisors is not None:
                        if divisors[n] == 0:
                            out[j] = _NOBODY
                            continue
                        part = part.div_(divisors[n])
                    out[j] = part.view_as(tensors[j])
        return [t for t in out if t is not None]

    def _compressed_param_sync(
        self, params: list[Tensor], joined: list[Tensor]
    ) -> tuple[list[tuple[list[Optional[Tensor]], list[Tensor]]], tuple[dict[Tensor, Tensor], dict[Tensor, Tensor]]]:
        """The compressed sync of the parameters that have an anchor; parameters that joined the
        trainable set since the last sync (a new param group, an unfrozen layer) are averaged
        exactly once and take that mean as their fresh anchor, with an empty residual."""
        assert self._codec is not None
        joined_set = set(joined)
        old = [p for p in params if p not in joined_set]
        writes: list[tuple[list[Optional[Tensor]], list[Tensor]]] = []
        anchor: dict[Tensor, Tensor] = {}
        residual: dict[Tensor, Tensor] = {}
        if old:
            deltas = [p.detach() - self._anchor[p] + self._residual[p] for p in old]
            means, sent = self._codec(deltas, "desloc/params_compressed")
            for p, d, m, s in zip(old, deltas, means, sent):
                anchor[p] = self._anchor[p] + m.to(p.dtype)
                residual[p] = d - s.to(d.dtype)
            writes.append((list(old), [anchor[p] for p in old]))
        if joined:
            for p, mean in zip(joined, self._mean(joined, "desloc/params_joined")):
                anchor[p] = mean.clone()
                residual[p] = torch.zeros_like(p)
            writes.append((list(joined), [anchor[p] for p in joined]))
        return writes, ({p: anchor[p] for p in params}, {p: residual[p] for p in params})

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Schedule position, periods changed at run time (``periods``, ``period_anchors``; absent when
        none was), and, with compressed sync, this worker's anchor and residual, listed in the order of
        :meth:`parameters`."""
        state: dict[str, Any] = {"step_count": self.step_count, "syncs": dict(self.stats.syncs)}
        if self._codec is not None:
            params = self.parameters()
            state["anchor"] = [self._anchor.get(p, p.detach()).clone() for p in params]
            state["residual"] = [self._residual.get(p, torch.zeros_like(p)).clone() for p in params]
        if self._params_synced_at is not None:
            state["params_synced_at"] = self._params_synced_at
        if self._period_override:  # periods changed at run time, and the steps they were changed at
            state["periods"] = dict(self._period_override)
            state["period_anchors"] = dict(self._period_anchor)
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
        synced_at = state.get("params_synced_at")
        self._params_synced_at = None if synced_at is None else int(synced_at)
        self._period_override = {str(k): int(v) for k, v in state.get("periods", {}).items()}
        self._period_anchor = {str(k): int(v) for k, v in state.get("period_anchors", {}).items()}
        self._synced = params
        self._local_replica = None
        if "anchor" in state and self._codec is not None:
            self._anchor = {p: a.to(p.device, p.dtype).clone() for a, p in zip(state["anchor"], params)}
            self._residual = {p: e.to(p.device, p.dtype).clone() for e, p in zip(state["residual"], params)}
        elif self._codec is not None:
            self.reset_anchor()


_NOBODY = torch.empty(0)  # the "mean" of a state no rank holds
