"""DES-LOC periods that adapt to how far the replicas drift apart (issue 16 item 7, seed 002).

Seed 002 asks for sync periods set "from the gradient norm or the momentum's change rate". Both are
proxies for what a sync repairs: how far the workers' copies of a quantity have moved apart since
the last average. DES-LOC measures that directly, at no extra collective, when it averages: each
rank's relative divergence from the mean (:attr:`DesLocAverager.last_divergence`)::

    d_q,r = ||v_r - mean_r(v)|| / ||mean_r(v)||        (v: the parameters, or one optimizer state)

:class:`AdaptivePeriodController` attaches to a :class:`~demo_lightning.algorithms.desloc.DesLocAverager`
and, after every sync that averaged a quantity ``q`` it adapts, averages ``d_q`` over the ranks with
ONE small all-reduce (float64, one value per quantity averaged at that step, ledger tag
``desloc/adaptive``; every rank reaches it at the same syncs because the schedule is identical on
every rank). Every rank then applies the same rule to the same numbers (``K``: the period,
``tau_q``: the target)::

    d < low  * tau_q:   K <- floor(K * factor)   (at least K + 1)      the replicas stayed close: sync less
    d > high * tau_q:   K <- ceil(K / factor)    (at most  K - 1)      they drifted: sync more
    otherwise:          K unchanged
    K <- clamp(K, min_period_q, max_period_q);   state periods also >= K_x (``states_follow_params``)

and changes the period through :meth:`DesLocAverager.set_period`, which re-anchors that quantity's
schedule at the current step. ``tau_q`` is given (``target``), or calibrated: the first agreed
measurement of ``q`` after local step ``start_step`` (the drift the configured period allowed).
Divergence grows with the period (roughly linearly for parameters under a constant learning rate),
so the dead band ``[low, high]`` must be wider than ``factor`` for a period to settle: with the
defaults (``factor`` 2, band ``[0.5, 2]``) a change of ``K`` by 2 moves ``d`` by about 2, inside the band.

Measurements are mean relative divergences at the sync, i.e. over the last ``K_q`` steps: a rule on
the drift per sync, not per step. The controller neither reads gradients nor adds host syncs
outside the syncs it measures.

A first measurement of exactly 0 (replicas identical, as a DeMo exchange keeps them) calibrates
nothing: the target is the first non-zero one.

Failure behaviour: a divergence that is not finite on any rank (NaN or inf: the mean over the
ranks then is not finite on every rank) leaves that quantity's period as it is, on every rank, and
warns once; the other quantities adapt as usual. A configuration that names unknown quantities raises ``ValueError`` naming the argument when
attached. The controller keeps no copy of the periods: the averager owns them (and checkpoints
them); the controller's :meth:`state_dict` holds the targets and the history.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from demo_lightning.algorithms.desloc import DesLocAverager
from demo_lightning.comm import Communicator
from demo_lightning.validation import check_bool, check_int, check_number, check_period

__all__ = ["ADAPTIVE_TAG", "AdaptivePeriodController", "AdaptivePeriodsConfig", "next_period"]

ADAPTIVE_TAG = "desloc/adaptive"
HISTORY_KEPT = 256  # adaptations kept in the history (and checkpoints)

PerQuantity = Union[int, Mapping[str, int]]


def _check_quantity_name(argument: str, name: Any) -> str:
    if not isinstance(name, str) or not (name == "params" or (name.startswith("state/") and len(name) > 6)):
        raise ValueError(f"{argument} names {name!r}: a quantity is 'params' or 'state/<optimizer-state key>', e.g. 'state/exp_avg'")
    return name


def _check_bound(argument: str, value: Any) -> Union[int, dict[str, int]]:
    if isinstance(value, Mapping):
        return {_check_quantity_name(argument, k): check_period(f"{argument}[{k!r}]", v) for k, v in value.items()}
    return check_period(argument, value)


@dataclass(frozen=True)
class AdaptivePeriodsConfig:
    """The controller's rule (see the module docstring).

    Args:
        min_period: the shortest period, one for every quantity or ``{quantity: period}`` (others: 1).
        max_period: the longest period, one or ``{quantity: period}`` (others: 4096).
        factor: how much one change lengthens or shortens a period, > 1.
        low: lengthen when the divergence is below ``low * target``, in (0, 1].
        high: shorten when it is above ``high * target``, >= 1 and > ``low``.
        target: the divergence to hold, one for every quantity or ``{quantity: value}``; ``None``
            (or a quantity missing from the mapping): calibrated from its first measurement.
        quantities: the quantities adapted (``"params"``, ``"state/<key>"``); ``None``: all.
        states_follow_params: keep every state period at least the parameters' period ``K_x``.
        start_step: neither calibrate nor adapt at syncs up to this local step (learning-rate warm-up).
    """

    min_period: PerQuantity = 1
    max_period: PerQuantity = 4096
    factor: float = 2.0
    low: float = 0.5
    high: float = 2.0
    target: Union[float, Mapping[str, float], None] = None
    quantities: Optional[Sequence[str]] = None
    states_follow_params: bool = True
    start_step: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_period", _check_bound("min_period", self.min_period))
        object.__setattr__(self, "max_period", _check_bound("max_period", self.max_period))
        check_number("factor", self.factor, 1.0, low_open=True, hint="a period changes by this factor, e.g. 2")
        check_number("low", self.low, 0.0, 1.0, low_open=True, hint="lengthen below low * target")
        check_number("high", self.high, 1.0, hint="shorten above high * target")
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high}): the band [low, high] * target keeps a period")
        if isinstance(self.target, Mapping):
            object.__setattr__(self, "target", {
                _check_quantity_name("target", k): check_number(f"target[{k!r}]", v, 0.0, low_open=True, hint="a relative divergence")
                for k, v in self.target.items()
            })
        elif self.target is not None:
            check_number("target", self.target, 0.0, low_open=True, hint="a relative divergence, or None to calibrate")
        if self.quantities is not None:
            if isinstance(self.quantities, str) or not isinstance(self.quantities, Sequence):
                raise ValueError(
                    f"quantities must be a list of quantity names such as ['params', 'state/exp_avg'] or None, got {self.quantities!r}"
                )
            object.__setattr__(self, "quantities", tuple(_check_quantity_name("quantities", q) for q in self.quantities))
        check_bool("states_follow_params", self.states_follow_params)
        check_int("start_step", self.start_step, 0, "local steps before adapting")
        for name in self.named():
            shortest, longest = self.bounds(name)
            if shortest > longest:
                raise ValueError(f"min_period ({shortest}) must not exceed max_period ({longest}) for {name!r}")
        if not isinstance(self.min_period, Mapping) and not isinstance(self.max_period, Mapping) and self.min_period > self.max_period:
            raise ValueError(f"min_period ({self.min_period}) must not exceed max_period ({self.max_period})")

    def named(self) -> set[str]:
        """Every quantity the settings name."""
        names: set[str] = set(self.quantities or ())
        for value in (self.min_period, self.max_period, self.target):
            if isinstance(value, Mapping):
                names |= set(value)
        return names

    def bounds(self, name: str) -> tuple[int, int]:
        """``(min_period, max_period)`` of quantity ``name``."""
        low = self.min_period.get(name, 1) if isinstance(self.min_period, Mapping) else self.min_period
        high = self.max_period.get(name, 4096) if isinstance(self.max_period, Mapping) else self.max_period
        return int(low), int(high)

    def target_of(self, name: str) -> Optional[float]:
        if isinstance(self.target, Mapping):
            return self.target.get(name)
        return None if self.target is None else float(self.target)


def next_period(period: int, divergence: float, target: float, config: AdaptivePeriodsConfig, low: int, high: int) -> int:
    """The rule for one quantity: the new period, clamped to ``[low, high]`` (``high`` wins if they cross).

    A divergence that is not finite keeps ``period`` (unclamped: nothing changes)."""
    if not math.isfinite(divergence):
        return period
    new = period
    if divergence < config.low * target:
        new = max(period + 1, math.floor(period * config.factor))
    elif divergence > config.high * target:
        new = min(period - 1, math.ceil(period / config.factor))
    return min(high, max(low, new))


class AdaptivePeriodController:
    """Adapt a :class:`DesLocAverager`'s periods to the measured replica divergence (module docstring).

    Usable without Lightning: build it on every rank with the same config, :meth:`attach` it (it
    turns on the averager's divergence measurement and runs from the averager's sync observer,
    inside the optimizer step), and save :meth:`state_dict` beside the averager's.

    Args:
        averager: the DES-LOC averager whose periods change.
        config: the rule.
        communicator: collectives and ledger (default: the averager's).
    """

    def __init__(self, averager: DesLocAverager, config: Optional[AdaptivePeriodsConfig] = None,
                 communicator: Optional[Communicator] = None) -> None:
        self.averager = averager
        self.config = config if config is not None else AdaptivePeriodsConfig()
        self.comm = communicator if communicator is not None else averager.comm
        known = set(averager.periods)
        unknown = sorted(self.config.named() - known)
        if unknown:
            raise ValueError(
                f"AdaptivePeriodsConfig names {unknown} (in quantities, min_period, max_period or target), but this DES-LOC "
                f"averager averages {sorted(known)}: name those quantities"
            )
        self.targets: dict[str, float] = {}
        """Agreed target divergence per quantity (given, or calibrated)."""
        self.history: list[dict[str, Any]] = []
        """The last adaptations: ``{"step", "divergence": {q: d}, "periods": {q: K}}`` (at most 256)."""
        self.adaptations = 0
        self.last_divergence: dict[str, float] = {}
        """The agreed divergence of each quantity at its last measured sync."""
        self._warned = False
        self._remove: Optional[Callable[[], None]] = None

    # ------------------------------------------------------------------ wiring
    def attach(self) -> "AdaptivePeriodController":
        """Measure divergence at every sync and adapt after it."""
        if self._remove is None:
            self.averager.measure_divergence = True
            self._remove = self.averager.add_sync_observer(self.on_sync)
        return self

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None
            self.averager.measure_divergence = False

    def adapted(self) -> list[str]:
        """The quantities adapted, in the averager's order."""
        chosen = self.config.quantities
        return [name for name in self.averager.periods if chosen is None or name in chosen]

    # ------------------------------------------------------------------ the rule
    def on_sync(self, averager: DesLocAverager, names: list[str]) -> None:
        """After a sync that averaged ``names`` (local step ``averager.step_count``): agree on the
        divergences and change the periods. Every rank calls it at the same syncs."""
        step = averager.step_count
        adapted = set(self.adapted())
        measured = [name for name in names if name in adapted]
        if not measured or step <= self.config.start_step:
            return
        local = [averager.last_divergence.get(name, math.nan) for name in measured]
        agreed = self.agree(local)
        self.update(step, dict(zip(measured, agreed)))

    def agree(self, local: list[float]) -> list[float]:
        """The mean over the ranks of each value: one float64 all-reduce (``desloc/adaptive``)."""
        if not self.comm.active:
            return list(local)
        values = torch.tensor(local, dtype=torch.float64, device=self.comm.device)
        self.comm.all_reduce_sum_(values, ADAPTIVE_TAG).wait()
        world = self.comm.world_size
        return [v / world for v in values.cpu().tolist()]

    def update(self, step: int, divergence: Mapping[str, float]) -> dict[str, int]:
        """Apply the rule to agreed divergences; returns the periods after it (pure: the same on
        every rank for the same inputs)."""
        self.last_divergence.update(divergence)
        periods = self.averager.periods
        bad = {name: d for name, d in divergence.items() if not math.isfinite(d)}
        if bad and not self._warned:
            self._warned = True
            warnings.warn(
                f"AdaptivePeriodController: the replicas' divergence is not finite at local step {step} ({bad}): "
                "keeping those periods (further cases are not warned)",
                RuntimeWarning, stacklevel=2,
            )
        for name, d in divergence.items():
            if name in bad:
                continue
            target = self.targets.get(name, self.config.target_of(name))
            if target is None:  # calibrate: the drift the current period allowed
                if d > 0:  # identical replicas (DeMo keeps them so) give no scale: wait for a drift
                    self.targets[name] = float(d)
                continue
            self.targets[name] = float(target)
            low, high = self.config.bounds(name)
            if name != "params" and self.config.states_follow_params and "params" in periods:
                low = max(low, periods["params"])
            periods[name] = next_period(periods[name], d, target, self.config, low, high)
        if self.config.states_follow_params and "params" in periods:
            for name in periods:  # the parameters' period grew past a state's: lift the state
                if name != "params" and name in self.adapted() and periods[name] < periods["params"]:
                    periods[name] = min(self.config.bounds(name)[1], periods["params"])
        for name, period in periods.items():
            if period != self.averager.periods[name]:
                self.averager.set_period(name, period)
        self.adaptations += 1
        self.history.append({"step": int(step), "divergence": dict(divergence), "periods": dict(self.averager.periods)})
        del self.history[:-HISTORY_KEPT]
        return self.averager.periods

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Targets, the last agreed divergences, the history and whether it warned (the periods
        themselves are in the averager's state dict)."""
        return {"targets": dict(self.targets), "last_divergence": dict(self.last_divergence),
                "history": [dict(h) for h in self.history], "adaptations": self.adaptations, "warned": self._warned}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.targets = {str(k): float(v) for k, v in state.get("targets", {}).items()}
        self.last_divergence = {str(k): float(v) for k, v in state.get("last_divergence", {}).items()}
        self.history = [dict(h) for h in state.get("history", [])]
        self.adaptations = int(state.get("adaptations", len(self.history)))
        self._warned = bool(state.get("warned", False))
