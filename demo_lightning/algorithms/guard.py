"""Non-finite guard: every rank agrees whether any rank saw a NaN or inf in its loss or gradients.

A worker whose loss or gradients are non-finite must not step, and neither may its peers: with
DeMo a NaN would enter the shared update (and every replica), with DES-LOC it would enter the
next average. The decision has to be the same on every rank, or the collectives of the step fall
out of step and the job hangs. So, once per optimizer step and before any exchange::

    bits_r = loss non-finite | gradients non-finite (| NaN seen | inf seen)   # on rank r, 1 byte
    bits   = all_gather(bits_r)                                              # one tiny collective
    skip   = any(bits)                                                       # same on every rank

The collective is an all-gather of one ``uint8`` per rank through the :class:`Communicator`, so it
is in the byte ledger (tag ``guard/nonfinite``: ``W - 1`` bytes per worker per step on a ring),
and it tells every rank *which* ranks saw what, for the error message. It must be called on every
rank at every step (also when nothing is wrong), which keeps the collectives aligned.

No Lightning needed: call :func:`gather_nonfinite` (or :func:`agree_nonfinite`) after
``backward()`` and skip ``optimizer.step()`` (and any exchange) when it reports a problem.

Failure behaviour: the functions themselves never raise on non-finite values (they report them);
:meth:`NonFiniteFlags.error` builds the ``FloatingPointError`` a caller raises on every rank. The
collective raises on every rank after the process group's timeout if a peer does not take part.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from demo_lightning.comm import Communicator

__all__ = [
    "FIX",
    "GUARD_TAG",
    "NONFINITE_POLICIES",
    "NonFiniteFlags",
    "NonFinitePolicy",
    "agree_nonfinite",
    "check_nonfinite_policy",
    "gather_nonfinite",
    "local_nonfinite_flags",
]

GUARD_TAG = "guard/nonfinite"
NonFinitePolicy = Literal["skip", "raise"]
NONFINITE_POLICIES: tuple[str, ...] = ("skip", "raise")

# bits of one rank's flag byte
LOSS = 1  # the loss is non-finite
GRAD = 2  # at least one gradient element is non-finite
NAN = 4  # a NaN was seen (in the loss or a gradient)
INF = 8  # an inf was seen

FIX = (
    "lower the learning rate, clip gradients (Trainer(gradient_clip_val=...)), or train in precision='bf16-mixed' "
    "instead of fp16"
)


def check_nonfinite_policy(nonfinite: Any) -> NonFinitePolicy:
    """Return ``nonfinite`` if it is ``"skip"`` or ``"raise"``; otherwise raise ``ValueError`` naming it."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"nonfinite must be one of {NONFINITE_POLICIES} (what every rank does when a loss or gradient is NaN/inf "
            f"on any rank), got {nonfinite!r}"
        )
    return nonfinite  # type: ignore[return-value]


def _values(t: Tensor) -> Tensor:
    return t.coalesce().values() if t.is_sparse else t


def _nan_inf_bits(tensors: Iterable[Tensor]) -> int:
    """NAN / INF bits of tensors known to hold a non-finite value (the rare path: syncs per tensor)."""
    bits = 0
    for t in tensors:
        v = _values(t.detach())
        if not v.is_floating_point() and not v.is_complex():
            continue
        if bool(torch.isnan(v).any()):
            bits |= NAN
        if bool(torch.isinf(v).any()):
            bits |= INF
    return bits


def local_nonfinite_flags(params: Iterable[Tensor], loss: Any = None) -> int:
    """This rank's flag byte: :data:`LOSS` / :data:`GRAD` for what is non-finite, :data:`NAN` / :data:`INF` for what was seen.

    Args:
        params: parameters whose ``.grad`` is checked; ``grad is None`` counts as finite.
        loss: a tensor (any shape), a Python number, or anything else (``None``, a dict from a
            manual-optimization closure, ...), which counts as finite.

    Returns:
        0 when everything is finite. In the common case this costs one pass over the gradients and
        one host synchronisation per device.
    """
    bad_by_device: dict[torch.device, Tensor] = {}
    grads: list[Tensor] = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        grads.append(g)
        bad = ~torch.isfinite(_values(g.detach())).all()
        previous = bad_by_device.get(g.device)
        bad_by_device[g.device] = bad if previous is None else previous | bad
    bits = 0
    if any(bool(b) for b in bad_by_device.values()):
        bits |= GRAD | _nan_inf_bits(grads)
    if isinstance(loss, Tensor):
        if not bool(torch.isfinite(_values(loss.detach())).all()):
            bits |= LOSS | _nan_inf_bits([loss])
    elif isinstance(loss, (int, float)) and not isinstance(loss, bool) and not math.isfinite(float(loss)):
        bits |= LOSS | (NAN if math.isnan(float(loss)) else INF)
    return bits


@dataclass(frozen=True)
class NonFiniteFlags:
    """Every rank's flag byte, in rank order (identical on every rank after :func:`gather_nonfinite`).

    Truthy when any rank saw a non-finite loss or gradient.
    """

    per_rank: tuple[int, ...]

    def __bool__(self) -> bool:
        return any(self.per_rank)

    @property
    def ranks(self) -> list[int]:
        """Ranks that saw a non-finite loss or gradient."""
        return [r for r, bits in enumerate(self.per_rank) if bits]

    def describe(self) -> str:
        """E.g. ``"rank 1: loss and gradients (NaN)"``; empty when everything was finite."""
        parts = []
        for r in self.ranks:
            bits = self.per_rank[r]
            where = " and ".join(w for w, b in (("loss", LOSS), ("gradients", GRAD)) if bits & b)
            kinds = "/".join(k for k, b in (("NaN", NAN), ("inf", INF)) if bits & b) or "NaN/inf"
            parts.append(f"rank {r}: {where} ({kinds})")
        return "; ".join(parts)

    def summary(self, step: Optional[int] = None) -> str:
        """``"Non-finite values (NaN/inf) at optimizer step 3 ... on 1 of 2 rank(s): rank 1: loss (NaN)"``."""
        at = f"at optimizer step {step} (trainer.global_step, counted from 0)" if step is not None else "in this optimizer step"
        return f"Non-finite values (NaN/inf) {at} on {len(self.ranks)} of {len(self.per_rank)} rank(s): {self.describe()}"

    def error(self, step: Optional[int] = None) -> FloatingPointError:
        """The error every rank raises under ``nonfinite="raise"``, naming the step, the ranks and the fix."""
        return FloatingPointError(
            f"{self.summary(step)}. No rank has updated its parameters, optimizer state or exchange state for this "
            f"step. To fix: {FIX}, or pass nonfinite='skip' to the strategy to skip such steps on every rank (they "
            "are counted in guard/skipped_steps)."
        )


def gather_nonfinite(
    params: Iterable[Tensor], loss: Any, communicator: Communicator, tag: str = GUARD_TAG
) -> NonFiniteFlags:
    """Agree across ranks on non-finite values: one all-gather of one byte per rank (recorded under ``tag``).

    Every rank must call this at the same point of every step, with or without a problem.

    Args:
        params: this rank's parameters (their ``.grad`` is checked; ``None`` is fine).
        loss: this rank's loss (see :func:`local_nonfinite_flags`).
        communicator: collectives and ledger.
        tag: ledger tag of the collective.

    Returns:
        Every rank's flags, the same on every rank.
    """
    params = list(params)
    bits = local_nonfinite_flags(params, loss)
    if params:
        device = params[0].device
    elif isinstance(loss, Tensor):
        device = loss.device
    else:
        device = torch.device("cpu")
    flag = torch.tensor([bits], dtype=torch.uint8, device=device)
    gathered = communicator.all_gather_bytes(flag, tag)
    return NonFiniteFlags(tuple(int(b) for b in torch.cat(gathered).cpu().tolist()))


def agree_nonfinite(params: Iterable[Tensor], loss: Any, communicator: Communicator, tag: str = GUARD_TAG) -> bool:
    """``True`` on every rank if any rank's loss or gradients hold a NaN or inf (see :func:`gather_nonfinite`)."""
    return bool(gather_nonfinite(params, loss, communicator, tag))
