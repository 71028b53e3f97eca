"""Values that change over training: the keep ratio, a layer's momentum decay, lambda.

A :class:`Schedule` maps an optimizer step (the number of optimizer steps applied so far) to a
value. It is a frozen dataclass, so it can be written in a LightningCLI yaml::

    keep_ratio: {kind: cosine, start: 0.01, end: 0.05}            # over the whole run
    beta: {kind: linear, start: 0.9, end: 0.99, steps: 2000}      # then stays at 0.99
    lam: {kind: milestones, start: 0.05, milestones: {5000: 0.1, 8000: 0.2}}

Kinds:

* ``constant``: ``start`` at every step.
* ``linear`` / ``cosine``: ``start`` until step ``begin``, then a linear or half-cosine ramp to
  ``end`` over ``steps`` steps (``None``: until the end of training), then ``end``.
* ``milestones``: ``start`` until the first milestone, then the value of the latest milestone
  reached (a step function: "sync more later in training").

Pure Python; no Lightning, no torch. Invalid fields raise ``ValueError`` naming them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from demo_lightning.validation import check_choice, check_int, check_number, check_optional_int, is_int, is_number

__all__ = ["SCHEDULE_KINDS", "Schedule", "ScheduleKind", "as_schedule"]

ScheduleKind = Literal["constant", "linear", "cosine", "milestones"]
SCHEDULE_KINDS: tuple[str, ...] = ("constant", "linear", "cosine", "milestones")


@dataclass(frozen=True)
class Schedule:
    """A value over optimizer steps (see the module docstring).

    Args:
        kind: ``"constant"``, ``"linear"``, ``"cosine"`` or ``"milestones"``.
        start: value at step 0.
        end: value at the end of a ramp (``linear`` / ``cosine`` only; required there).
        steps: ramp length in optimizer steps; ``None`` ramps until the last step of training.
        begin: step at which the ramp starts.
        milestones: ``{step: value}`` for ``kind="milestones"``.
    """

    kind: ScheduleKind = "constant"
    start: float = 0.0
    end: Optional[float] = None
    steps: Optional[int] = None
    begin: int = 0
    milestones: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("Schedule kind", self.kind, SCHEDULE_KINDS)
        check_number("Schedule start", self.start)
        if self.kind in ("linear", "cosine"):
            if not is_number(self.end):
                raise ValueError(f"a {self.kind} Schedule needs end (the value the ramp reaches), got {self.end!r}")
            check_optional_int("Schedule steps", self.steps, 1)
        check_int("Schedule begin", self.begin, 0, "a step")
        if self.kind == "milestones":
            if not self.milestones:
                raise ValueError("a milestones Schedule needs milestones, e.g. {5000: 0.1}")
            for step, value in self.milestones.items():
                if not is_int(step, 0):
                    raise ValueError(f"Schedule milestones keys must be non-negative integer steps, got {step!r}")
                if not is_number(value):
                    raise ValueError(f"Schedule milestones values must be numbers, got {value!r} at step {step}")

    @property
    def needs_total_steps(self) -> bool:
        """A ramp that lasts until the end of training needs the total number of steps."""
        return self.kind in ("linear", "cosine") and self.steps is None

    def values(self) -> list[float]:
        """Every value the schedule can take at a ramp's ends and milestones (for range checks)."""
        out = [float(self.start)]
        if self.end is not None and self.kind in ("linear", "cosine"):
            out.append(float(self.end))
        if self.kind == "milestones":
            out += [float(v) for v in self.milestones.values()]
        return out

    def __call__(self, step: int, total_steps: Optional[int] = None) -> float:
        """The value after ``step`` optimizer steps (``total_steps``: the run's length, for open ramps)."""
        if self.kind == "constant":
            return float(self.start)
        if self.kind == "milestones":
            value = float(self.start)
            for at in sorted(self.milestones):
                if step >= at:
                    value = float(self.milestones[at])
            return value
        length = self.steps
        if length is None:
            if total_steps is None:
                raise ValueError("this Schedule ramps until the end of training: give total_steps, or set steps")
            length = max(1, int(total_steps) - self.begin)
        assert self.end is not None
        t = min(1.0, max(0.0, (step - self.begin) / length))
        if self.kind == "cosine":
            t = 0.5 * (1.0 - math.cos(math.pi * t))
        return float(self.start) + (float(self.end) - float(self.start)) * t


def as_schedule(
    value: Union[float, Schedule, None], name: str, low: float, high: float, *, low_open: bool = False, high_open: bool = False,
) -> Optional[Schedule]:
    """A number becomes a constant :class:`Schedule`; every value is checked against the range.

    Raises ``ValueError`` naming ``name`` when a value lies outside ``[low, high]`` (or the open
    ends requested).
    """
    if value is None:
        return None
    if isinstance(value, Schedule):
        schedule = value
    elif is_number(value):
        schedule = Schedule(kind="constant", start=float(value))
    else:
        raise ValueError(f"{name} must be a number or a Schedule, got {value!r}")
    for v in schedule.values():
        too_low = v <= low if low_open else v < low
        too_high = v >= high if high_open else v > high
        if too_low or too_high:
            bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
            raise ValueError(f"{name} must lie in {bounds}, got {v!r}")
    return schedule
