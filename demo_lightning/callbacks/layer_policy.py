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
0.9 to 0.99, lambda raised stepwise). Presets follow the owner's operating advice (seed 000 /
001; claims to measure, not facts): attention Q/K and convolutions keep more, feed-forward less,
norms synced densely with lambda 0, embeddings a higher lambda.

The effective per-tensor settings are printed once at fit start on rank 0, kept in
:attr:`LayerPolicy.effective` and written to TensorBoard as text when a TensorBoardLogger is used.
Every rank evaluates the same rules at the same optimizer step, so settings agree across ranks.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
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
from demo_lightning.validation import check_instance, check_optional_bool, check_optional_choice, check_optional_int

__all__ = ["PRESETS", "LayerPolicy", "LayerRule"]

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
        dense: ``True`` sends the tensor's whole momentum by an fp32 all-reduce.
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


PRESETS: dict[str, tuple[LayerRule, ...]] = {
    # seed 000: ~8 % keep with beta 0.99 for language, attention Q/K synced fuller than FFN;
    # seed 001: lambda 0.05-0.2 (embeddings 0.2, MLP 0.05, norms 0), beta ramped 0.9 -> 0.99.
    "language": (
        LayerRule(kind="norm", dense=True, lam=0.0),
        LayerRule(kind="embedding", lam=0.2),
        LayerRule(kind="attention_qk", keep_ratio=1 / 32),
        LayerRule(kind="ffn", keep_ratio=1 / 128, lam=0.05),
        LayerRule(pattern="*", beta=Schedule(kind="linear", start=0.9, end=0.99), lam=0.1),
    ),
    # seed 000: vision keeps more with beta 0.9, convolutions keep more high frequencies.
    "vision": (
        LayerRule(kind="norm", dense=True, lam=0.0),
        LayerRule(kind="embedding", lam=0.2),
        LayerRule(kind="conv", keep_ratio=1 / 16),
        LayerRule(kind="attention_qk", keep_ratio=1 / 32),
        LayerRule(kind="ffn", keep_ratio=1 / 64, lam=0.05),
        LayerRule(pattern="*", beta=0.9, lam=0.1),
    ),
}


class LayerPolicy(Callback):
    """Per-layer beta / keep ratio / chunk / dense / lambda, with schedules (see the module docstring).

    Beside :class:`AdaptiveKeepRatio` (in either order) the ``keep_ratio`` / ``topk`` rules are base
    ratios that callback scales (``k_p = clamp(ceil(level_p * r_p / r_strategy))``), not dropped.

    Args:
        rules: ordered rules (first match per setting wins); applied before the preset's.
        preset: ``"language"`` or ``"vision"`` rules after the user's, or ``None``.
        print_settings: print the effective per-tensor settings once at fit start (rank 0).
    """

    def __init__(
        self,
        rules: Optional[list[LayerRule]] = None,
        preset: Optional[Literal["language", "vision"]] = None,
        print_settings: bool = True,
    ) -> None:
        check_optional_choice("preset", preset, tuple(PRESETS))
        rules = list(rules or [])
        for i, rule in enumerate(rules):
            check_instance(f"rules[{i}]", rule, LayerRule)
        self.rules = rules
        self.preset = preset
        self.print_settings = print_settings
        self.effective: dict[str, dict[str, Any]] = {}
        self._assign: dict[Tensor, dict[str, Any]] = {}  # parameter -> setting -> value or Schedule
        self._names: dict[Tensor, str] = {}
        self._owner: dict[Tensor, DeMoExchange] = {}
        self._optimizers: list[Any] = []
        self._total: Optional[int] = None
        self._scaled = False  # AdaptiveKeepRatio applies (scales) the keep_ratio / topk rules

    @property
    def all_rules(self) -> list[tuple[LayerRule, bool]]:
        """``(rule, from_preset)`` in matching order."""
        return [(r, False) for r in self.rules] + [(r, True) for r in PRESETS.get(self.preset or "", ())]

    # ------------------------------------------------------------------ setup
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after the strategy's setup: its exchanges and the optimizers exist
        exchanges = exchanges_of(trainer)
        self._owner = {p: ex for ex in exchanges for p in ex.parameters()}
        self._optimizers = [o for o in trainer.optimizers if hasattr(o, "set_param_options")]
        self._names = named_trainable(pl_module)
        self._total = total_steps(trainer)
        kinds = layer_kinds(pl_module)
        from demo_lightning.callbacks.adaptive_keep_ratio import AdaptiveKeepRatio  # it imports this module

        self._scaled = any(isinstance(cb, AdaptiveKeepRatio) for cb in trainer.callbacks)
        skipped: set[str] = set()
        self._assign = {}
        for p, name in self._names.items():
            chosen: dict[str, Any] = {}  # field -> value or Schedule
            taken: set[str] = set()
            for rule, from_preset in self.all_rules:
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
                        raise ValueError(
                            f"LayerRule(pattern={rule.pattern!r}) sets beta for {name}, but there is neither a DeMo exchange "
                            "(strategy='demo') nor a DecoupledMomentum optimizer to apply it to: use strategy='demo' or "
                            "demo_lightning.optim.DecoupledMomentum, or remove beta from the rule"
                        )
                    taken.add(setting)
                    chosen[field_name] = value
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
        return "LayerPolicy effective settings (- = strategy / optimizer default)\n" + "\n".join(lines)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        # everything is a function of the applied step count, which Lightning checkpoints
        return {"rules": len(self.all_rules), "preset": self.preset}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("rules") != len(self.all_rules) or state_dict.get("preset") != self.preset:
            rank_zero_warn(
                "LayerPolicy: the checkpoint was written with different rules or preset; the current ones apply from here"
            )


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
