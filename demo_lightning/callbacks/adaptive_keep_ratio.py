"""How many DCT coefficients DeMo keeps, changed over training: a schedule, an energy controller,
and a bandwidth budget.

Three rules, applied to every tensor the codec compresses (densely sent tensors are left alone):

* **schedule** (``keep_ratio``): the fraction of each tile kept follows a :class:`Schedule`
  (constant, linear or cosine ramp, milestones), e.g. DeMo-adv's "sync more later in training".
* **energy controller** (``energy``): every ``update_every`` optimizer steps, each worker finds per
  tensor the smallest ``k`` whose best ``k`` coefficients per tile hold ``energy`` of its momentum's
  energy (measured on the exchange's own DCT, no extra transform), clamped to
  ``[min_keep_ratio, max_keep_ratio]``. The workers' ``k`` are averaged by one all-reduce
  (``adaptive/k`` in the ledger) and rounded up, so every rank sets the identical ``k``; the new
  ``k`` applies from the next step (the measurement is one step old).
* **budget** (``max_bytes_per_step``): if the chosen ``k`` would put more payload bytes per
  worker per step on the wire than the budget, every tensor's ``k`` is scaled by the largest
  common factor that fits (at least one coefficient per tile; a warning if even that exceeds).

With a :class:`~demo_lightning.callbacks.LayerPolicy` on the same Trainer (in either order), its
``keep_ratio`` / ``topk`` rules are per-tensor base ratios this callback scales, not overrides it
drops. For a tensor ``p`` with ``tile_numel`` elements per tile, the rule's ratio ``r_p``
(``topk / tile_numel`` for a ``topk`` rule, evaluated at the step for a scheduled one) and the
strategy's ratio ``r_s`` (its ``keep_ratio``, or ``topk / chunk**2``: 64/4096 by default), the
multiplier is ``m_p = r_p / r_s`` (1 without a rule) and, before the budget::

    schedule:  k_p = clamp(ceil(m_p * keep_ratio(step) * tile_numel), 1, tile_numel)
    energy:    k_p = clamp(ceil(m_p * k_energy_p), ceil(min_keep_ratio * tile_numel), floor(max_keep_ratio * tile_numel))

where ``k_energy_p`` is the controller's ``k`` for ``p`` (the strategy's ``k``, bounded, until the
first measurement). So the schedule or the controller sets the level a tensor without a rule
keeps, and the policy keeps its tensors at their ratio relative to the strategy's (a rule keeping
1/32 under the default 1/64 keeps twice the level). A preset's ratios count relative to the
preset's own overall ratio instead: the language preset's attention Q/K keep 1.5x the level, its
feed-forward 0.75x (see :mod:`.layer_policy`).
The composition reads :meth:`LayerPolicy.strength_at` at this callback's own step, so the order
of the callbacks does not change any ``k``.

Every rank computes the same settings at the same optimizer step (schedules from the step count,
the controller from an all-reduced value), so exchanges never mismatch in size; a mismatch would
still raise on every rank (the codec compares its plan across ranks when it changes).
The controller's chosen ``k`` is checkpointed: a resumed run continues with the same settings.
Needs ``strategy="demo"``; with any other strategy ``setup`` raises ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from demo_lightning.algorithms import DeMoExchange, TensorSettings
from demo_lightning.callbacks.context import applied_steps, communicator_of, exchanges_of, named_trainable, total_steps
from demo_lightning.callbacks.layer_policy import LayerPolicy
from demo_lightning.schedules import Schedule, as_schedule
from demo_lightning.validation import check_fraction, check_int, check_optional_int

__all__ = ["AdaptiveKeepRatio"]

_DEFAULT_RAMP = Schedule(kind="cosine", start=1 / 128, end=1 / 32)


class AdaptiveKeepRatio(Callback):
    """Adapt DeMo's keep ratio per tensor over training (see the module docstring); beside a
    :class:`LayerPolicy` it scales each tensor's rule ratio by ``level / strategy ratio``.

    Args:
        keep_ratio: fraction of each tile kept, a number or a :class:`Schedule`; used when
            ``energy`` is not set. Default: a cosine ramp from 1/128 to 1/32 over the run
            (DeMo-adv's "sync more later"; not tuned on our benchmarks).
        energy: target fraction of each tensor's momentum energy to send, in (0, 1]; turns on
            the controller (``keep_ratio`` is then ignored).
        min_keep_ratio: the controller's lower bound, in (0, 1].
        max_keep_ratio: the controller's upper bound, in (0, 1], at least ``min_keep_ratio``.
        update_every: the controller re-measures every this many optimizer steps.
        max_bytes_per_step: cap on the exchange's payload bytes per worker per optimizer step
            (all tensors, dense ones included); ``None``: no cap.
    """

    def __init__(
        self,
        keep_ratio: Union[float, Schedule, None] = None,
        energy: Optional[float] = None,
        min_keep_ratio: float = 1 / 4096,
        max_keep_ratio: float = 0.25,
        update_every: int = 10,
        max_bytes_per_step: Optional[int] = None,
    ) -> None:
        self.keep_ratio = as_schedule(keep_ratio if keep_ratio is not None else _DEFAULT_RAMP, "keep_ratio", 0.0, 1.0, low_open=True)
        if energy is not None:
            energy = check_fraction("energy", energy, "fraction of the momentum's energy to send")
        min_keep_ratio = check_fraction("min_keep_ratio", min_keep_ratio)
        max_keep_ratio = check_fraction("max_keep_ratio", max_keep_ratio)
        if min_keep_ratio > max_keep_ratio:
            raise ValueError(f"min_keep_ratio ({min_keep_ratio}) must not exceed max_keep_ratio ({max_keep_ratio})")
        check_int("update_every", update_every, 1, "optimizer steps")
        check_optional_int("max_bytes_per_step", max_bytes_per_step, 1, "bytes")
        self.energy = None if energy is None else float(energy)
        self.min_keep_ratio = float(min_keep_ratio)
        self.max_keep_ratio = float(max_keep_ratio)
        self.update_every = update_every
        self.max_bytes_per_step = max_bytes_per_step
        self.controller_k: dict[str, int] = {}  # the controller's last agreed k per tensor name
        self.current_k: dict[str, int] = {}  # k applied to each compressed tensor
        self.planned_bytes = 0
        self._names: dict[Tensor, str] = {}
        self._exchanges: list[DeMoExchange] = []
        self._policies: list[LayerPolicy] = []  # whose keep_ratio / topk rules this scales
        self._measured_at = -1
        self._seen_exchanges = 0
        self._curve_requested = False  # a curve was asked of the exchanges and not yet read
        self._warned_budget = False

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # a fresh fit starts afresh; a resumed one restores its state after setup
            self.controller_k, self.current_k, self._measured_at = {}, {}, -1

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after the strategy's setup, which attaches the exchanges
        self._exchanges = exchanges_of(trainer)
        if not self._exchanges:
            raise ValueError(
                f"AdaptiveKeepRatio changes the DeMo exchange's keep ratio, but strategy {type(trainer.strategy).__name__} "
                "has no DeMo exchange: use Trainer(strategy='demo') or remove the callback"
            )
        self._names = named_trainable(pl_module)
        self._policies = [cb for cb in trainer.callbacks if isinstance(cb, LayerPolicy)]
        self._seen_exchanges = sum(ex.stats.steps for ex in self._exchanges)
        if self.energy is None and self.keep_ratio is not None and self.keep_ratio.needs_total_steps and total_steps(trainer) is None:
            raise ValueError("AdaptiveKeepRatio's keep_ratio ramps until the end of training: set max_steps, or the Schedule's steps")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = applied_steps(trainer)
        if self.energy is not None and step % self.update_every == 0 and step != self._measured_at:
            for exchange in self._exchanges:
                exchange.request_energy_curve()  # consumed by this optimizer step's exchange
            self._curve_requested = True  # the same on every rank (decided by the step)
        self._apply(self._targets(trainer, step))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.energy is None:
            return
        exchanged = sum(ex.stats.steps for ex in self._exchanges)
        if exchanged == self._seen_exchanges:
            return  # no exchange since the last look (a micro-batch of gradient accumulation)
        self._seen_exchanges = exchanged
        if not self._curve_requested:
            return
        self._curve_requested = False
        # every rank measured the tensors it exchanged (under a node hierarchy: its share); the mean is
        # taken per tensor over the ranks that measured it, in one vector of the same size on every rank
        measured = {p: e for ex in self._exchanges for p, e in zip(ex.stats.exchanged, ex.stats.energy) if e.curve is not None}
        every = [(ex, p) for ex in self._exchanges for p in ex.parameters() if ex.tile_numel(p) > 0]
        if not every:
            return
        self._measured_at = applied_steps(trainer) - 1  # the step this measurement came from
        sums = [float(self._bounded(measured[p].k_for(self.energy), measured[p].tile_numel)) if p in measured else 0.0 for _, p in every]
        counts = [1.0 if p in measured else 0.0 for _, p in every]
        comm = communicator_of(trainer)
        if comm is not None and comm.world_size > 1:
            # on the communicator's device (NCCL takes no CPU tensor); one host read of the agreed sums
            local = torch.tensor(sums + counts, dtype=torch.float64, device=comm.device)
            comm.all_reduce_sum_(local, "adaptive/k").wait()
            agreed = local.cpu().tolist()
            sums, counts = agreed[: len(every)], agreed[len(every) :]
        for (ex, p), k, n in zip(every, sums, counts):
            if n > 0:
                self.controller_k[self._names[p]] = min(ex.tile_numel(p), math.ceil(k / n - 1e-9))

    # ------------------------------------------------------------------ rules
    def _bounded(self, k: int, tile_numel: int) -> int:
        low = max(1, math.ceil(self.min_keep_ratio * tile_numel - 1e-9))
        high = max(low, math.floor(self.max_keep_ratio * tile_numel + 1e-9))
        return min(high, max(low, k))

    def _targets(self, trainer: Trainer, step: int) -> dict[Tensor, int]:
        """The ``k`` of every compressed tensor at this step, before the budget (the module
        docstring's formulas; ``m_p`` from the LayerPolicy rules, 1 without one)."""
        targets: dict[Tensor, int] = {}
        ratio = None if self.energy is not None or self.keep_ratio is None else self.keep_ratio(step, total_steps(trainer))
        for exchange in self._exchanges:
            for p in exchange.parameters():
                n = exchange.tile_numel(p, self._without_strength(exchange, p))
                if n == 0:
                    continue
                m = self._multiplier(exchange, p, n, step)
                if ratio is not None:
                    targets[p] = max(1, min(n, math.ceil(m * ratio * n - 1e-9)))
                else:
                    default = self._bounded(exchange.k_of(p, self._without_strength(exchange, p), steady=True), n)
                    level = self.controller_k.get(self._names[p], default)
                    targets[p] = self._bounded(math.ceil(m * level - 1e-9), n)
        return targets

    def _multiplier(self, exchange: DeMoExchange, p: Tensor, tile_numel: int, step: int) -> float:
        """``m_p = r_p / r_s``: the first LayerPolicy rule's keep ratio for ``p`` over the strategy's."""
        for policy in self._policies:
            got = policy.strength_at(p, step)
            if got is None:
                continue
            field_name, value = got
            rule_ratio = float(value) if field_name == "keep_ratio" else min(1.0, int(value) / tile_numel)
            topk, keep_ratio = exchange.config.codec.strength
            strategy_ratio = float(keep_ratio) if keep_ratio is not None else min(1.0, int(topk) / exchange.config.codec.chunk**2)
            return rule_ratio / strategy_ratio
        return 1.0

    @staticmethod
    def _without_strength(exchange: DeMoExchange, p: Tensor) -> TensorSettings:
        return dataclasses.replace(exchange.tensor_settings(p), topk=None, keep_ratio=None)

    def _apply(self, targets: dict[Tensor, int]) -> None:
        owner = {p: ex for ex in self._exchanges for p in ex.parameters()}
        targets = self._within_budget(targets, owner)
        for p, k in targets.items():
            exchange = owner[p]
            current = exchange.tensor_settings(p)
            if current.topk != k or current.keep_ratio is not None:
                exchange.set_tensor_settings(p, dataclasses.replace(current, topk=k, keep_ratio=None))
            self.current_k[self._names[p]] = k
        self.planned_bytes = sum(
            ex.payload_bytes(p) for ex in self._exchanges for p in ex.parameters()
        )

    def _within_budget(self, targets: dict[Tensor, int], owner: dict[Tensor, DeMoExchange]) -> dict[Tensor, int]:
        cap = self.max_bytes_per_step
        if cap is None:
            return targets

        def cost(ks: dict[Tensor, int]) -> int:
            total = 0
            for ex in self._exchanges:
                for p in ex.parameters():
                    settings = ex.tensor_settings(p)
                    if p in ks:
                        settings = dataclasses.replace(settings, topk=ks[p], keep_ratio=None)
                    total += ex.payload_bytes(p, settings)
            return total

        def scaled(factor: float) -> dict[Tensor, int]:
            return {p: max(1, math.floor(k * factor)) for p, k in targets.items()}

        if cost(targets) <= cap:
            return targets
        if cost(scaled(0.0)) > cap:
            if not self._warned_budget:
                rank_zero_warn(
                    f"max_bytes_per_step={cap} is below what one coefficient per tile costs ({cost(scaled(0.0))} bytes, "
                    "dense tensors included): keeping one per tile. Raise the budget or compress fewer tensors densely."
                )
                self._warned_budget = True
            return scaled(0.0)
        low, high = 0.0, 1.0  # cost(scaled(low)) <= cap < cost(scaled(high))
        for _ in range(40):
            mid = (low + high) / 2
            if cost(scaled(mid)) <= cap:
                low = mid
            else:
                high = mid
        return scaled(low)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"controller_k": dict(self.controller_k), "measured_at": self._measured_at}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.controller_k = {str(k): int(v) for k, v in state_dict.get("controller_k", {}).items()}
        self._measured_at = int(state_dict.get("measured_at", -1))
