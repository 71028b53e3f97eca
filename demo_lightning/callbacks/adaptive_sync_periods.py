"""DES-LOC periods that adapt to the replicas' measured divergence: a thin Lightning layer over
:class:`~demo_lightning.algorithms.adaptive_periods.AdaptivePeriodController`.

At every DES-LOC sync each rank measures how far its copy of each averaged quantity (the
parameters, each optimizer state) was from the mean, ``d = ||v_r - mean|| / ||mean||``; one small
all-reduce (``desloc/adaptive`` in the ledger) averages it over the ranks, and every rank applies
the same rule: lengthen the period by ``factor`` when ``d < low * target``, shorten it when
``d > high * target``, within ``[min_period, max_period]`` (state periods at least ``K_x``). The
target is given, or the first measurement after ``start_step`` (the drift the configured period
allowed). The rule, its reasons and its failure behaviour are in the controller's module docstring.

Every rank changes the same periods at the same local step, so the collectives stay in step. The
periods and their anchors live in the averager's state (each rank's checkpoint shard), the targets
and history in this callback's state: a resumed run continues the same schedule. The current
periods are logged every step as ``desloc/period/<quantity>`` (e.g. ``desloc/period/params``,
``desloc/period/state/exp_avg``). Needs a strategy with DES-LOC averaging (``strategy="desloc"``,
or ``"demo"`` with ``param_sync_every``); with any other ``on_fit_start`` raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from demo_lightning.algorithms.adaptive_periods import AdaptivePeriodController, AdaptivePeriodsConfig
from demo_lightning.algorithms.desloc import DesLocAverager
from demo_lightning.validation import check_bool

__all__ = ["AdaptiveSyncPeriods"]


class AdaptiveSyncPeriods(Callback):
    """Lengthen or shorten DES-LOC's K_x and each state's period from the replicas' divergence.

    Args:
        min_period: shortest period, for every quantity or ``{quantity: period}`` (quantities:
            ``"params"``, ``"state/<key>"``, e.g. ``"state/exp_avg"``).
        max_period: longest period, for every quantity or ``{quantity: period}``.
        factor: a change multiplies or divides a period by this, > 1.
        low: lengthen when the agreed divergence is below ``low * target``, in (0, 1].
        high: shorten when it is above ``high * target``, >= 1.
        target: the relative divergence to hold, one or ``{quantity: value}``; ``None``: each
            quantity's first measurement after ``start_step``.
        quantities: the quantities adapted; ``None``: all the strategy averages.
        states_follow_params: keep every state period at least the parameters' period.
        start_step: local steps (optimizer steps applied) before the first calibration or change.
        log_periods: log ``desloc/period/<quantity>`` every step.
    """

    def __init__(
        self,
        min_period: Union[int, dict[str, int]] = 1,
        max_period: Union[int, dict[str, int]] = 4096,
        factor: float = 2.0,
        low: float = 0.5,
        high: float = 2.0,
        target: Union[float, dict[str, float], None] = None,
        quantities: Optional[list[str]] = None,
        states_follow_params: bool = True,
        start_step: int = 0,
        log_periods: bool = True,
    ) -> None:
        self.config = AdaptivePeriodsConfig(
            min_period=min_period, max_period=max_period, factor=factor, low=low, high=high, target=target,
            quantities=quantities, states_follow_params=states_follow_params, start_step=start_step,
        )
        self.log_periods = check_bool("log_periods", log_periods)
        self.controllers: list[AdaptivePeriodController] = []
        self._pending: Optional[dict[str, Any]] = None  # restored state, applied when the controllers exist

    @property
    def hparams(self) -> dict[str, Any]:
        """The settings, as they are saved in checkpoints (and shown by LightningCLI's config)."""
        c = self.config
        return {"min_period": c.min_period, "max_period": c.max_period, "factor": c.factor, "low": c.low, "high": c.high,
                "target": c.target, "quantities": None if c.quantities is None else list(c.quantities),
                "states_follow_params": c.states_follow_params, "start_step": c.start_step, "log_periods": self.log_periods}

    @property
    def periods(self) -> dict[str, int]:
        """The current periods of the first averager (empty before the fit starts)."""
        return self.controllers[0].averager.periods if self.controllers else {}

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # a fresh fit starts afresh; a resumed one restores its state after setup
            self._detach()
            self._pending = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        averagers: list[DesLocAverager] = list(getattr(trainer.strategy, "averagers", []))
        if not averagers:
            raise ValueError(
                f"AdaptiveSyncPeriods changes DES-LOC's sync periods, but strategy {type(trainer.strategy).__name__} has no "
                "DES-LOC averager: use Trainer(strategy='desloc') (or DeMoStrategy(param_sync_every=...)), or remove the callback"
            )
        self._detach()
        self.controllers = [AdaptivePeriodController(a, self.config).attach() for a in averagers]
        if self._pending is not None:
            for controller, state in zip(self.controllers, self._pending.get("controllers", [])):
                controller.load_state_dict(state)
            self._pending = None

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.log_periods or not self.controllers:
            return
        for name, period in self.controllers[0].averager.periods.items():
            pl_module.log(f"desloc/period/{name}", float(period), on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._detach(keep=True)

    def _detach(self, keep: bool = False) -> None:
        for controller in self.controllers:
            controller.remove()
        if not keep:
            self.controllers = []

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.controllers:
            controllers = [c.state_dict() for c in self.controllers]
        else:
            controllers = list((self._pending or {}).get("controllers", []))
        return {"settings": self.hparams, "controllers": controllers}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = {"controllers": list(state_dict.get("controllers", []))}
