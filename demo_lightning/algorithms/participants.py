"""Step participants: what runs around an optimizer's update, in order, with or without Lightning.

One optimizer step with communication is a list of participants, each implementing
:class:`StepParticipant`::

    for p in participants: p.before_update(step)     # may set step.skip (the guard)
    optimizer.step()                                 # unless skipped
    for p in participants: p.after_update(step)

The strategies build the list ``[NonFiniteGuard, (local clipping), DesLocAverager, DeMoExchange]``
(each only where configured) and iterate it, so DeMo, DES-LOC and both together need no special
cases; a plain training loop does the same with :func:`run_step` (as torchft attaches to an
optimizer, not to a trainer). Each participant keeps its own state and offers
``state_dict()`` / ``load_state_dict()``.

Failure: a participant that raises stops the step there; the ones before it have run, the update
has not. The guard raises before anything changes; DES-LOC's averaging writes nothing unless every
one of its collectives completed; the exchange, when a collective fails, leaves parameters and
gradients untouched but its momenta already hold the step's gradient (see
:mod:`~demo_lightning.algorithms.demo`): resume such a run from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol, TypeVar, runtime_checkable

__all__ = ["StepContext", "StepParticipant", "run_step"]

T = TypeVar("T")


@dataclass
class StepContext:
    """What the participants of one step share.

    Attributes:
        loss: the closure's result (checked by the guard; ``None`` counts as finite).
        step: the caller's step number, for messages (``trainer.global_step`` under Lightning).
        skip: set by a participant (the guard) to skip the update and everything after it.
        plan_agreed: set by the guard when its all-gather showed every rank's exchange plan digest
            equal, so the exchange needs no check of its own this step.
    """

    loss: Any = None
    step: Optional[int] = None
    skip: bool = False
    plan_agreed: bool = False


@runtime_checkable
class StepParticipant(Protocol):
    """Hooks around one optimizer update (see the module docstring). Every rank must run the same
    participants in the same order: their collectives must match."""

    def before_update(self, step: StepContext) -> None: ...

    def after_update(self, step: StepContext) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def run_step(participants: Sequence[StepParticipant], update: Callable[[], T], step: Optional[StepContext] = None) -> Optional[T]:
    """``before_update`` of each participant in order, ``update()``, then ``after_update`` of each.

    Returns ``update()``'s result, or ``None`` when a participant skipped the step (``step.skip``):
    then neither the update nor any later participant's hooks ran.
    """
    step = step if step is not None else StepContext()
    for participant in participants:
        participant.before_update(step)
        if step.skip:
            return None
    result = update()
    for participant in participants:
        participant.after_update(step)
    return result
