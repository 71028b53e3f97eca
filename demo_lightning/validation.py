"""Argument checks shared by every config, strategy and callback: each raises ``ValueError`` that
names the argument, shows the value it got and says what would be accepted.

The ``check_*`` functions return the checked value (a number as ``float``); the ``is_*``
predicates serve the few messages that need their own wording (a list of numbers, a required
field of one kind only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

__all__ = [
    "check_bool",
    "check_choice",
    "check_fraction",
    "check_instance",
    "check_int",
    "check_number",
    "check_optional_bool",
    "check_optional_choice",
    "check_optional_int",
    "check_period",
    "check_periods",
    "is_int",
    "is_number",
]


def _hint(hint: str) -> str:
    return f" ({hint})" if hint else ""


def is_number(value: Any) -> bool:
    """A real number: an ``int`` or ``float``, not a bool, not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def is_int(value: Any, minimum: Optional[int] = None) -> bool:
    """An ``int`` (not a bool), at least ``minimum`` when given."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def _int_kind(minimum: int) -> str:
    return {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")


def check_int(name: str, value: Any, minimum: int = 0, hint: str = "", *, kind: str = "") -> int:
    """``value`` if it is an ``int`` (not a bool) of at least ``minimum``.

    ``kind`` replaces the words for what is accepted (default ``"a positive integer"`` for
    ``minimum=1``, ``"a non-negative integer"`` for 0, ``"an integer >= N"`` otherwise).
    """
    if not is_int(value, minimum):
        raise ValueError(f"{name} must be {kind or _int_kind(minimum)}{_hint(hint)}, got {value!r}")
    return value


def check_optional_int(name: str, value: Any, minimum: int = 0, hint: str = "", *, kind: str = "") -> Optional[int]:
    """``None``, or ``value`` checked by :func:`check_int` (the message adds "or None")."""
    if value is not None and not is_int(value, minimum):
        raise ValueError(f"{name} must be {kind or _int_kind(minimum)}{_hint(hint)} or None, got {value!r}")
    return value


def check_number(
    name: str, value: Any, low: Optional[float] = None, high: Optional[float] = None,
    low_open: bool = False, high_open: bool = False, hint: str = "",
) -> float:
    """``float(value)`` for a real number (not a bool, not NaN) within the given bounds.

    Out of range: ``"<name> must lie in [low, high)"`` (or ``"must be > low"`` with one bound);
    not a real number: ``"<name> must be a real number in [low, high)"``.
    """
    if low is not None and high is not None:
        bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        in_range = f"lie {bounds}"
    elif low is not None:
        bounds = f"{'>' if low_open else '>='} {low:g}"
        in_range = f"be {bounds}"
    elif high is not None:
        bounds = f"{'<' if high_open else '<='} {high:g}"
        in_range = f"be {bounds}"
    else:
        bounds, in_range = "", "be a number"
    if not is_number(value):
        raise ValueError(f"{name} must be {f'a real number {bounds}' if bounds else 'a number'}{_hint(hint)}, got {value!r}")
    v = float(value)
    if (low is not None and not (v > low if low_open else v >= low)) or (high is not None and not (v < high if high_open else v <= high)):
        raise ValueError(f"{name} must {in_range}{_hint(hint)}, got {value!r}")
    return v


def check_fraction(name: str, value: Any, hint: str = "") -> float:
    """A number in ``(0, 1]``."""
    return check_number(name, value, 0.0, 1.0, low_open=True, hint=hint)


def check_choice(name: str, value: Any, choices: Sequence[Any], hint: str = "") -> Any:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}{_hint(hint)}, got {value!r}")
    return value


def check_optional_choice(name: str, value: Any, choices: Sequence[Any], hint: str = "") -> Any:
    """``None``, or one of ``choices`` (the message adds "or None")."""
    if value is not None and value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)} or None{_hint(hint)}, got {value!r}")
    return value


def check_bool(name: str, value: Any, hint: str = "") -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False{_hint(hint)}, got {value!r}")
    return value


def check_optional_bool(name: str, value: Any, hint: str = "") -> Optional[bool]:
    """``None``, ``True`` or ``False``."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be True, False or None{_hint(hint)}, got {value!r}")
    return value


def check_instance(name: str, value: Any, cls: type) -> Any:
    """``value`` if it is an instance of ``cls``."""
    if not isinstance(value, cls):
        raise ValueError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    return value


_PERIOD = "an integer period >= 1"
_PERIOD_HINT = "optimizer steps between averages"


def check_period(name: str, value: Any) -> int:
    """A period in optimizer steps: an ``int`` >= 1."""
    return check_int(name, value, 1, _PERIOD_HINT, kind=_PERIOD)


def check_periods(name: str, value: Any, keys: str, example: str, never: Optional[Mapping[str, str]] = None) -> dict[str, int]:
    """A copy of a mapping of ``keys`` to periods, each checked by :func:`check_period`.

    ``example`` shows a valid mapping in the message; ``never`` maps a refused key to the reason.
    """
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must map {keys} to periods, e.g. {example}, got {value!r}")
    for key, period in value.items():
        if never and key in never:
            raise ValueError(f"{name}[{key!r}]: {never[key]}; remove {key!r}")
        check_period(f"{name}[{key!r}]", period)
    return dict(value)
