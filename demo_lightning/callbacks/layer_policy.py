"""Per-layer settings: momentum decay, keep ratio, tile size, dense sync and lambda by layer kind.

A :class:`LayerPolicy` is an ordered list of :class:`LayerRule`; each rule matches parameters by
name (a glob such as ``"*.attn.*"``, or ``"re:<regex>"`` searched in the name) and optionally by
layer kind (see :mod:`demo_lightning.callbacks.layer_kinds`: ``embedding``, ``norm``, ``conv``,
``attention_qk``, ``attention_v``, ``attention_out``, ``attention`` (all three), ``ffn``,
``linear``, ``other``). For every parameter and every setting, the first matching rule that sets
it wins (so a specific rule before ``"*"`` overrides it). The user's rules come before a preset's.

Settings and where they go:

* ``beta``: the DeMo exchange's momentum decay of the tensor under ``strategy="demo"``; otherwise
  the ``beta`` of :class:`demo_lightning.optim.DecoupledMomentum`.
* ``keep_ratio`` / ``topk``, ``chunk``, ``dense``: the DeMo codec for that tensor (ignored, with a
  warning, without a DeMo exchange). With :class:`AdaptiveKeepRatio` also on the Trainer, a rule's
  ``keep_ratio`` / ``topk`` is the tensor's *base* ratio ``r_p`` (``topk / tile_numel`` for
  ``topk``), which the adaptive callback scales: it applies
  ``k_p = clamp(ceil(level_p * r_p / r_strategy))``, where ``r_strategy`` is the strategy's own ratio
  (``keep_ratio``, or ``topk / chunk**2``) and ``level_p`` is what the schedule or the energy
  controller would give a tensor without a rule (see :mod:`.adaptive_keep_ratio`). So a rule keeping
  twice the strategy's ratio keeps twice the adaptive level. The order of the two callbacks in
  ``Trainer(callbacks=...)`` does not matter: this callback never sets the strength then, it only
  answers :meth:`LayerPolicy.strength_at`, which the adaptive callback reads at every step.
* ``lam``: the lambda of :class:`demo_lightning.optim.DecoupledMomentum` (a user rule setting it
  with another optimizer raises ``ValueError``; a preset's is skipped).

``beta``, ``keep_ratio`` and ``lam`` take a number or a :class:`Schedule` (e.g. a ramp of beta from
0.9 to 0.99, lambda raised stepwise).

Presets: the owner's advice, our reading
-----------------------------------------

``preset="language"`` / ``"vision"`` add rules after the user's, built by :func:`preset_rules` from
:data:`PRESETS`. The owner's documents (seed 000 §2.2 and §5, seed 001 §3.2 and §6) are operating
advice, not measurements of ours; ``benchmarks/presets.py`` measures them. Which numbers apply
depends on what carries the tensor:

=====================  ==============================  ==============================  =====================
setting                language                        vision                          source
=====================  ==============================  ==============================  =====================
keep ratio             0.08; attention Q/K 0.12,       0.15; convolutions 0.20         seed 000 §2.2 (8 %,
(DeMo exchange)        feed-forward 0.06                                               15 %), §5.1, §5.2
``small_batch``        0.25, each kind scaled by       0.25, convolutions 1/3          seed 000 §5.1
                       0.25 / 0.08 (Q/K 0.375, FFN     (0.20 x 0.25 / 0.15)            (20-30 %)
                       0.1875)
beta (DeMo exchange)   0.99; attention Q/K 0.95        0.9                             seed 000 §2.2, §5.2
beta (DecoupledMom.)   linear 0.9 -> 0.99 over the     linear 0.9 -> 0.99 over the     seed 001 §6.1
                       run                             run
lam (DecoupledMom.)    0.1; embeddings 0.2,            0.08; embeddings 0.2,           seed 001 §3.2, §6.1,
                       feed-forward 0.05, norms 0      feed-forward 0.05, norms 0      §6.2
dense                  norms                           norms (BatchNorm included)      ours
=====================  ==============================  ==============================  =====================

Our reading, where the text leaves a choice:

* "convolutions keep more of the high frequencies" (seed 000 §5.1) is read as *a larger share*:
  DeMo's top-k already picks the largest coefficients wherever they are, so keeping more of them
  is what lets more high frequencies through. 0.20 is 4/3 of the 0.15 the other tensors keep; on a
  ResNet nearly every compressed weight is a convolution, so it keeps about 20 %, not 15 %.
* "attention Q/K need higher-frequency sync, FFN can take less" (§5.2): Q/K keep 1.5x the 8 %
  (0.12), feed-forward 0.75x (0.06). "A different beta per layer type" (§5.2): Q/K's exchange decay
  is 0.95 (a half-life of 14 steps instead of 69 at 0.99), so what Q/K leave unsent fades sooner;
  0.95 is seed 001 §3.2's value for noisy data.
* A tensor under a DeMo exchange takes the constant per-kind beta above as its exchange decay
  (seed 000's beta is DeMo's); a tensor stepped only by :class:`~demo_lightning.optim.DecoupledMomentum`
  (``strategy="desloc"``, DDP) takes seed 001's ramp as the optimizer's beta. Lambda always goes to a
  DecoupledMomentum optimizer; with another optimizer the preset's lambda and (without an exchange)
  beta are skipped with a warning, and keep ratios without an exchange are skipped too.
* ``small_batch`` (seed 000 §5.1, "batch size < 1024: keep 20-30 %"): ``True`` keeps 0.25 (the middle
  of the range) and scales every per-kind ratio in proportion (capped at 1); ``False`` keeps the
  preset's; ``None`` (default) decides at fit start from the global batch, the train dataloader's
  batch size x ``trainer.world_size`` x ``accumulate_grad_batches``, small when under 1,024. Every
  rank builds its dataloader with the same batch size and the world size is global, so every rank
  decides the same; a batch size that cannot be read (a custom batch sampler) warns and counts as
  not small.
  The choice is printed with the table, kept in :attr:`LayerPolicy.small_batch_used` and
  :attr:`LayerPolicy.global_batch`, and saved in the callback's checkpoint state.
* Norms are sent densely (their keep ratio is moot) with lambda 0 (seed 001 §6.2's BatchNorm, and
  LayerNorm/RMSNorm with it); embeddings keep the overall ratio with lambda 0.2 (seed 001 §5.2, §6.1).
* With :class:`AdaptiveKeepRatio` on the Trainer the adaptive callback sets the level; a preset then
  gives each kind only its share of that level: language Q/K 1.5x, feed-forward 0.75x, the rest 1x;
  vision convolutions 4/3x, the rest 1x (its ratios are divided by its overall ratio and multiplied
  by the strategy's, so the composition formula above gives exactly these multipliers; ``small_batch``
  does not change the shares). A user rule's ratio keeps the meaning given above.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from demo_lightning.algorithms import DeMoExchange
from demo_lightning.callbacks.context import applied_steps, exchanges_of, named_trainable, total_steps
from demo_lightning.callbacks.layer_kinds import RULE_KINDS, kind_matches, layer_kinds
from demo_lightning.codec import validate_strength
from demo_lightning.schedules import Schedule, as_schedule
from demo_lightning.validation import check_choice, check_instance, check_optional_bool, check_optional_choice, check_optional_int

__all__ = ["PRESETS", "SMALL_BATCH_BELOW", "SMALL_BATCH_KEEP", "LayerPolicy", "LayerRule", "Preset", "preset_rules"]

_CODEC_FIELDS = ("strength", "chunk", "dense")


@dataclass(frozen=True)
class LayerRule:
    """One rule of a :class:`LayerPolicy`; ``None`` settings are left to later rules.

    Args:
        pattern: glob over the parameter's qualified name, or ``"re:<regex>"`` (searched).
        kind: layer kind to match as well (``None``: any); see the module docstring.
        beta: momentum decay in [0, 1), number or :class:`Schedule`.
        keep_ratio: fraction of each tile kept, in (0, 1], number or :class:`Schedule`.
        topk: coefficients kept per tile (exclusive with ``keep_ratio``).
        chunk: DCT tile side.
        dense: ``True`` sends the tensor's whole momentum by an all-reduce (in the codec's ``dense_format``).
        lam: DecoupledMomentum's lambda (>= 0), number or :class:`Schedule`.
    """

    pattern: str = "*"
    kind: Optional[str] = None
    beta: Union[float, Schedule, None] = None
    keep_ratio: Union[float, Schedule, None] = None
    topk: Optional[int] = None
    chunk: Optional[int] = None
    dense: Optional[bool] = None
    lam: Union[float, Schedule, None] = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"LayerRule pattern must be a non-empty glob or 're:<regex>', got {self.pattern!r}")
        if self.pattern.startswith("re:"):
            try:
                re.compile(self.pattern[3:])
            except re.error as err:
                raise ValueError(f"LayerRule pattern {self.pattern!r} is not a valid regex: {err}") from None
        check_optional_choice("LayerRule kind", self.kind, RULE_KINDS)
        object.__setattr__(self, "beta", as_schedule(self.beta, "LayerRule beta", 0.0, 1.0, high_open=True))
        object.__setattr__(self, "keep_ratio", as_schedule(self.keep_ratio, "LayerRule keep_ratio", 0.0, 1.0, low_open=True))
        object.__setattr__(self, "lam", as_schedule(self.lam, "LayerRule lam", 0.0, float("inf")))
        if self.keep_ratio is not None and self.topk is not None:
            raise ValueError("a LayerRule sets either keep_ratio or topk, not both; drop one of them")
        validate_strength(self.topk, None)
        check_optional_int("LayerRule chunk", self.chunk, 1, "tile side")
        check_optional_bool("LayerRule dense", self.dense)

    def matches(self, name: str, kind: str) -> bool:
        if self.kind is not None and not kind_matches(self.kind, kind):
            return False
        if self.pattern.startswith("re:"):
            return re.search(self.pattern[3:], name) is not None
        return fnmatch.fnmatchcase(name, self.pattern)

    def get(self, setting: str) -> Optional[tuple[str, Any]]:
        """``(field, value)`` this rule sets for a setting, or ``None`` (``"strength"`` is
        ``keep_ratio`` or ``topk``, whichever the rule gives)."""
        if setting == "strength":
            if self.keep_ratio is not None:
                return "keep_ratio", self.keep_ratio
            return ("topk", self.topk) if self.topk is not None else None
        value = getattr(self, setting)
        return None if value is None else (setting, value)


@dataclass(frozen=True)
class Preset:
    """The numbers of one preset (see the module docstring's table; kinds as in :mod:`.layer_kinds`).

    Args:
        keep_ratio: fraction of each tile every compressed tensor keeps unless its kind has its own.
        keep_by_kind: per-kind keep ratios.
        beta: the DeMo exchange's decay of tensors whose kind has none in ``beta_by_kind``.
        beta_by_kind: per-kind exchange decays.
        lam: DecoupledMomentum's lambda of tensors whose kind has none in ``lam_by_kind``.
        lam_by_kind: per-kind lambdas.
        beta_ramp: DecoupledMomentum's beta from the first to the last step (linear), for tensors
            without a DeMo exchange.
        dense_kinds: kinds sent densely.
    """

    keep_ratio: float
    keep_by_kind: Mapping[str, float]
    beta: float
    beta_by_kind: Mapping[str, float]
    lam: float
    lam_by_kind: Mapping[str, float]
    beta_ramp: tuple[float, float] = (0.9, 0.99)
    dense_kinds: tuple[str, ...] = ("norm",)


_LAMBDAS = {"embedding": 0.2, "ffn": 0.05, "norm": 0.0}  # seed 001 §6.1 (embeddings, MLP), §6.2 (BatchNorm)
PRESETS: dict[str, Preset] = {
    # seed 000 §2.2: NLP beta 0.99, keep 8 %; §5.2: Q/K synced fuller, FFN less, beta by layer type
    "language": Preset(
        keep_ratio=0.08, keep_by_kind={"attention_qk": 0.12, "ffn": 0.06},
        beta=0.99, beta_by_kind={"attention_qk": 0.95}, lam=0.1, lam_by_kind=_LAMBDAS,
    ),
    # seed 000 §2.2: images beta 0.9, keep 15 %; §5.1: convolutions keep more; seed 001 §3.2: CV lambda 0.08
    "vision": Preset(keep_ratio=0.15, keep_by_kind={"conv": 0.20}, beta=0.9, beta_by_kind={}, lam=0.08, lam_by_kind=_LAMBDAS),
}
SMALL_BATCH_BELOW = 1024  # seed 000 §5.1: "batch size < 1024"
SMALL_BATCH_KEEP = 0.25  # the middle of its 20-30 %


def preset_rules(preset: str, *, small_batch: bool = False, exchange: bool = True) -> tuple[LayerRule, ...]:
    """The rules of ``preset`` for a tensor under a DeMo exchange (``exchange=True``) or stepped only
    by its optimizer (``False``: the beta ramp instead of the exchange decays; keep ratios are then
    unused). ``small_batch`` raises the overall keep ratio to :data:`SMALL_BATCH_KEEP` and every
    per-kind ratio in proportion (capped at 1)."""
    check_choice("preset", preset, tuple(PRESETS))
    numbers = PRESETS[preset]
    scale = SMALL_BATCH_KEEP / numbers.keep_ratio if small_batch else 1.0
    kinds = dict.fromkeys([*numbers.dense_kinds, *numbers.keep_by_kind, *numbers.beta_by_kind, *numbers.lam_by_kind])
    rules = []
    for kind in kinds:
        dense = True if kind in numbers.dense_kinds else None
        keep = numbers.keep_by_kind.get(kind) if dense is None else None
        rules.append(LayerRule(
            kind=kind, dense=dense, keep_ratio=None if keep is None else min(1.0, keep * scale),
            beta=numbers.beta_by_kind.get(kind) if exchange else None, lam=numbers.lam_by_kind.get(kind),
        ))
    start, end = numbers.beta_ramp
    beta: Union[float, Schedule] = numbers.beta if exchange else Schedule(kind="linear", start=start, end=end)
    rules.append(LayerRule(pattern="*", keep_ratio=min(1.0, numbers.keep_ratio * scale), beta=beta, lam=numbers.lam))
    return tuple(rules)


class LayerPolicy(Callback):
    """Per-layer beta / keep ratio / chunk / dense / lambda, with schedules (see the module docstring).

    Beside :class:`AdaptiveKeepRatio` (in either order) the ``keep_ratio`` / ``topk`` rules are base
    ratios that callback scales (``k_p = clamp(ceil(level_p * r_p / r_strategy))``), not dropped.

    Args:
        rules: ordered rules (first match per setting wins); applied before the preset's.
        preset: ``"language"`` or ``"vision"`` rules after the user's (:func:`preset_rules`), or ``None``.
        small_batch: with a preset, ``True`` keeps :data:`SMALL_BATCH_KEEP` (0.25) of each tile
            (per-kind ratios in proportion), ``False`` the preset's ratios, ``None`` decides at fit
            start: small when the global batch (batch size x world size x gradient accumulation)
            is under :data:`SMALL_BATCH_BELOW` (1,024).
        print_settings: print the effective per-tensor settings once at fit start (rank 0).
    """

    def __init__(
        self,
        rules: Optional[list[LayerRule]] = None,
        preset: Optional[Literal["language", "vision"]] = None,
        small_batch: Optional[bool] = None,
        print_settings: bool = True,
    ) -> None:
        check_optional_choice("preset", preset, tuple(PRESETS))
        check_optional_bool("small_batch", small_batch, "(with a preset)")
        if small_batch is not None and preset is None:
            raise ValueError(
                f"small_batch={small_batch} changes a preset's keep ratios, but preset is None: pass preset='language' "
                "or 'vision', or leave small_batch=None"
            )
        rules = list(rules or [])
        for i, rule in enumerate(rules):
            check_instance(f"rules[{i}]", rule, LayerRule)
        self.rules = rules
        self.preset = preset
        self.small_batch = small_batch
        self.print_settings = print_settings
        self.small_batch_used: Optional[bool] = None  # the preset's choice at fit start (small_batch, or detected)
        self.global_batch: Optional[int] = None  # the global batch the detection read (None: not read)
        self.effective: dict[str, dict[str, Any]] = {}
        self._assign: dict[Tensor, dict[str, Any]] = {}  # parameter -> setting -> value or Schedule
        self._names: dict[Tensor, str] = {}
        self._owner: dict[Tensor, DeMoExchange] = {}
        self._optimizers: list[Any] = []
        self._total: Optional[int] = None
        self._scaled = False  # AdaptiveKeepRatio applies (scales) the keep_ratio / topk rules
        self._restored: Optional[dict[str, Any]] = None  # a checkpoint's state, compared at fit start

    def rules_for(self, exchange: bool) -> list[tuple[LayerRule, bool]]:
        """``(rule, from_preset)`` in matching order for a tensor under a DeMo exchange or not
        (the preset's part as chosen at fit start; before it, as ``small_batch`` or not small)."""
        small = self.small_batch_used if self.small_batch_used is not None else bool(self.small_batch)
        preset = preset_rules(self.preset, small_batch=small, exchange=exchange) if self.preset else ()
        return [(r, False) for r in self.rules] + [(r, True) for r in preset]

    @property
    def all_rules(self) -> list[tuple[LayerRule, bool]]:
        """``(rule, from_preset)`` in matching order for tensors under a DeMo exchange."""
        return self.rules_for(exchange=True)

    # ------------------------------------------------------------------ setup
    def _decide_small_batch(self, trainer: Trainer) -> Optional[bool]:
        """The preset's ``small_batch``: the argument, or the global batch against 1,024."""
        self.global_batch = None
        if self.preset is None:
            return None
        if self.small_batch is not None:
            return self.small_batch
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # what Lightning does next anyway (and estimated_stepping_batches does)
        loader = trainer.train_dataloader
        batch = getattr(loader, "batch_size", None)
        if batch is None:
            batch = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            rank_zero_warn(
                f"LayerPolicy(preset={self.preset!r}): cannot read the train dataloader's batch size to tell a small "
                "batch (< 1024 in all); using the preset's ratios. Pass small_batch=True or False to choose."
            )
            return False
        self.global_batch = batch * int(trainer.world_size) * int(trainer.accumulate_grad_batches)
        return self.global_batch < SMALL_BATCH_BELOW

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after the strategy's setup: its exchanges and the optimizers exist
        exchanges = exchanges_of(trainer)
        self._owner = {p: ex for ex in exchanges for p in ex.parameters()}
        self._optimizers = [o for o in trainer.optimizers if hasattr(o, "set_param_options")]
        self._names = named_trainable(pl_module)
        self._total = total_steps(trainer)
        self.small_batch_used = self._decide_small_batch(trainer)
        if self._restored is not None:
            if self._restored.get("small_batch") != self.small_batch_used and self.preset is not None:
                rank_zero_warn(
                    f"LayerPolicy: the checkpoint was written with small_batch={self._restored.get('small_batch')}, this "
                    f"run has {self.small_batch_used}; this run's keep ratios apply from here"
                )
            self._restored = None
        kinds = layer_kinds(pl_module)
        from demo_lightning.callbacks.adaptive_keep_ratio import AdaptiveKeepRatio  # it imports this module

        self._scaled = any(isinstance(cb, AdaptiveKeepRatio) for cb in trainer.callbacks)
        rule_sets = {True: self.rules_for(exchange=True), False: self.rules_for(exchange=False)}
        overall = preset_rules(self.preset, small_batch=bool(self.small_batch_used))[-1].keep_ratio if self.preset else None
        skipped: set[str] = set()
        self._assign = {}
        for p, name in self._names.items():
            chosen: dict[str, Any] = {}  # field -> value or Schedule
            taken: set[str] = set()
            strength_from_preset = False
            for rule, from_preset in rule_sets[p in self._owner]:
                if not rule.matches(name, kinds[name]):
                    continue
                for setting in ("beta", "strength", "chunk", "dense", "lam"):
                    got = rule.get(setting)
                    if got is None or setting in taken:
                        continue
                    field_name, value = got
                    if setting in _CODEC_FIELDS and p not in self._owner:
                        skipped.add(f"{setting} (no DeMo exchange)")
                        continue
                    if setting == "lam" and not self._optimizers:
                        if from_preset:
                            skipped.add("lam (the optimizer is not DecoupledMomentum)")
                            continue
                        raise ValueError(
                            f"LayerRule(pattern={rule.pattern!r}) sets lam for {name}, but no optimizer takes a per-parameter "
                            "lambda: use demo_lightning.optim.DecoupledMomentum, or remove lam from the rule"
                        )
                    if setting == "beta" and p not in self._owner and not self._optimizers:
                        if from_preset:
                            skipped.add("beta (neither a DeMo exchange nor DecoupledMomentum)")
                            continue
                        raise ValueError(
                            f"LayerRule(pattern={rule.pattern!r}) sets beta for {name}, but there is neither a DeMo exchange "
                            "(strategy='demo') nor a DecoupledMomentum optimizer to apply it to: use strategy='demo' or "
                            "demo_lightning.optim.DecoupledMomentum, or remove beta from the rule"
                        )
                    taken.add(setting)
                    chosen[field_name] = value
                    if setting == "strength":
                        strength_from_preset = from_preset
            if strength_from_preset and chosen.get("dense") is True:
                chosen.pop("keep_ratio", None)  # a preset's dense tensor sends everything: its ratio is moot
            elif strength_from_preset and self._scaled and overall is not None and "keep_ratio" in chosen:
                # beside AdaptiveKeepRatio a preset gives shares of the adaptive level: ratio / overall x the strategy's
                share = chosen["keep_ratio"](0) / overall(0)
                chosen["keep_ratio"] = min(1.0, share * _strategy_ratio(self._owner[p]))
            for setting, value in chosen.items():
                if isinstance(value, Schedule) and value.needs_total_steps and self._total is None:
                    raise ValueError(f"the {setting} schedule for {name} ramps until the end of training: set max_steps or its steps")
            self._assign[p] = chosen
        if skipped:
            rank_zero_warn(f"LayerPolicy: not applied: {', '.join(sorted(skipped))}")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply(applied_steps(trainer))
        self.effective = {self._names[p]: self._values(p, applied_steps(trainer)) for p in self._assign}
        table = self.format_table()
        if self.print_settings:
            rank_zero_info(table)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.experiment.add_text("layer_policy/effective", "```\n" + table + "\n```", trainer.global_step)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._apply(applied_steps(trainer))

    # ------------------------------------------------------------------ apply
    def settings_at(self, param: Tensor, step: int) -> dict[str, Any]:
        """What the rules give ``param`` after ``step`` optimizer steps (fields as in :class:`LayerRule`,
        schedules evaluated; empty before fit start or for a tensor no rule matches)."""
        return self._values(param, step)

    def _values(self, p: Tensor, step: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for setting, value in self._assign.get(p, {}).items():
            out[setting] = value(step, self._total) if isinstance(value, Schedule) else value
        return out

    def _apply(self, step: int) -> None:
        for p, chosen in self._assign.items():
            if not chosen:
                continue
            values = self._values(p, step)
            exchange = self._owner.get(p)
            if exchange is not None:
                current = exchange.tensor_settings(p)
                strength: dict[str, Any] = {}  # left alone with AdaptiveKeepRatio: it applies strength_at, scaled
                if "topk" in values and not self._scaled:
                    strength = {"topk": values["topk"], "keep_ratio": None}
                elif "keep_ratio" in values and not self._scaled:
                    strength = {"keep_ratio": values["keep_ratio"], "topk": None}
                wanted = dataclasses.replace(
                    current,
                    decay=values.get("beta", current.decay),
                    chunk=values.get("chunk", current.chunk),
                    dense=values.get("dense", current.dense),
                    **strength,
                )
                if wanted != current:
                    exchange.set_tensor_settings(p, wanted)
            for optimizer in self._optimizers:
                options: dict[str, float] = {}
                if "lam" in values:
                    options["lam"] = float(values["lam"])
                if "beta" in values and exchange is None:
                    options["beta"] = float(values["beta"])
                if options and any(p is q for g in optimizer.param_groups for q in g["params"]):
                    optimizer.set_param_options(p, **options)

    def strength_at(self, param: Tensor, step: int) -> Optional[tuple[str, Union[float, int]]]:
        """The keep strength the rules give ``param`` at optimizer step ``step``: ``("keep_ratio", r)``,
        ``("topk", k)``, or ``None`` when no rule sets one (or ``param`` is not compressed by a DeMo
        exchange). :class:`AdaptiveKeepRatio` reads it as the tensor's base ratio; a pure function of
        the step, so every rank gets the same answer whenever it asks."""
        chosen = self._assign.get(param, {})
        for field_name in ("topk", "keep_ratio"):
            if field_name in chosen:
                value = chosen[field_name]
                return field_name, value(step, self._total) if isinstance(value, Schedule) else value
        return None

    def format_table(self) -> str:
        """The effective per-tensor settings at fit start, as a plain-text table (with
        :class:`AdaptiveKeepRatio`, ``keep`` is the base ratio it scales, marked ``x adaptive``)."""
        rows = [("parameter", "beta", "keep", "chunk", "dense", "lam")]
        for name, values in self.effective.items():
            keep = values.get("keep_ratio", values.get("topk"))
            keep_cell = f"top {keep}" if "topk" in values else _fmt(keep)
            if self._scaled and keep is not None:
                keep_cell += " x adaptive"
            rows.append((name, _fmt(values.get("beta")), keep_cell, *(_fmt(values.get(c)) for c in ("chunk", "dense", "lam"))))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
        head = "LayerPolicy effective settings (- = strategy / optimizer default)"
        if self.preset is not None:
            how = "given" if self.small_batch is not None else (
                f"global batch {self.global_batch} {'<' if self.small_batch_used else '>='} {SMALL_BATCH_BELOW}"
                if self.global_batch is not None else "batch size unknown"
            )
            head += f"; preset {self.preset!r}, small_batch={self.small_batch_used} ({how})"
        return head + "\n" + "\n".join(lines)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        # everything is a function of the applied step count, which Lightning checkpoints
        return {"rules": len(self.rules), "preset": self.preset, "small_batch": self.small_batch_used}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # restored before fit start: small_batch (decided at fit start) is compared there
        self._restored = dict(state_dict)
        if state_dict.get("rules") != len(self.rules) or state_dict.get("preset") != self.preset:
            rank_zero_warn(
                "LayerPolicy: the checkpoint was written with different rules or preset; the current ones apply from here"
            )


def _strategy_ratio(exchange: DeMoExchange) -> float:
    """The strategy's own keep ratio: its ``keep_ratio``, or ``topk / chunk**2``."""
    topk, keep_ratio = exchange.config.codec.strength
    return float(keep_ratio) if keep_ratio is not None else min(1.0, int(topk) / exchange.config.codec.chunk**2)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
