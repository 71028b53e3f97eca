"""Non-finite guard: every rank agrees whether any rank saw a NaN or inf in its loss or gradients.

A worker whose loss or gradients are non-finite must not step, and neither may its peers: with
DeMo a NaN would enter the shared update (and every replica), with DES-LOC it would enter the
next average. The decision has to be the same on every rank, or the collectives of the step fall
out of step and the job hangs. So, once per optimizer step and before any exchange::

    bits_r = loss non-finite | gradients non-finite (| NaN seen | inf seen)   # on rank r, 1 byte
    bits   = all_gather(bits_r)                                              # one tiny collective
    skip   = any(bits)                                                       # same on every rank

The collective is an all-gather of one ``uint8`` per rank through the :class:`Communicator`, so it
is in the byte ledger (tag ``guard/nonfinite``: ``W - 1`` bytes per worker per step on a ring; ``9 (W - 1)``
when it also carries the exchange's 8-byte plan digest, which the DeMo strategy does),
and it tells every rank *which* ranks saw what, for the error message. It must be called on every
rank at every step (also when nothing is wrong), which keeps the collectives aligned. The byte is
computed on the communicator's device (``Communicator.device``: the GPU under NCCL) by reductions
that stay there, and the gathered bytes are read back once: the step's only host synchronisation.

No Lightning needed: call :func:`gather_nonfinite` (or :func:`agree_nonfinite`) after
``backward()`` and skip ``optimizer.step()`` (and any exchange) when it reports a problem.

Failure behaviour: the functions themselves never raise on non-finite values (they report them);
:meth:`NonFiniteFlags.error` builds the ``FloatingPointError`` a caller raises on every rank. The
collective raises on every rank after the process group's timeout if a peer does not take part.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from demo_lightning.comm import Communicator
from demo_lightning.profiling import GUARD_NONFINITE, stage_range

__all__ = [
    "FIX",
    "GUARD_TAG",
    "NONFINITE_POLICIES",
    "NonFiniteFlags",
    "NonFiniteGuard",
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


def _any_nan_inf(tensors: Iterable[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """``(any NaN, any inf)`` over ``tensors`` as 0-d bool tensors on ``device``, without a host read.

    Two reductions per floating-point tensor on its own device (``isnan(t).any()``, ``isinf(t).any()``),
    OR-ed per device, then one copy per device to ``device`` (none where they already are).
    """
    per_device: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        v = _values(t.detach())
        if not v.is_floating_point() and not v.is_complex():
            continue  # integers are always finite
        per_device.setdefault(v.device, []).append(torch.stack((torch.isnan(v).any(), torch.isinf(v).any())))
    found = torch.zeros(2, dtype=torch.bool, device=device)
    for parts in per_device.values():
        found |= torch.stack(parts).any(dim=0).to(device)
    return found[0], found[1]


def _flag_byte(params: Iterable[Tensor], loss: Any, device: torch.device) -> Tensor:
    """This rank's flag byte (see :func:`local_nonfinite_flags`) as a one-element ``uint8`` tensor on
    ``device``, computed without a host synchronisation (bits combined on the device with Python
    weights, so nothing is copied from the host either)."""
    byte = torch.zeros(1, dtype=torch.uint8, device=device)
    parts = [(GRAD, [p.grad for p in params if p.grad is not None])]
    if isinstance(loss, Tensor):
        parts.append((LOSS, [loss]))
    for where, tensors in parts:
        nan, inf = _any_nan_inf(tensors, device)
        byte |= (nan | inf).to(torch.uint8) * where
        byte |= nan.to(torch.uint8) * NAN
        byte |= inf.to(torch.uint8) * INF
    if isinstance(loss, (int, float)) and not isinstance(loss, bool) and not math.isfinite(float(loss)):
        byte |= LOSS | (NAN if math.isnan(float(loss)) else INF)
    return byte


def local_nonfinite_flags(params: Iterable[Tensor], loss: Any = None) -> int:
    """This rank's flag byte: :data:`LOSS` / :data:`GRAD` for what is non-finite, :data:`NAN` / :data:`INF` for what was seen.

    Args:
        params: parameters whose ``.grad`` is checked; ``grad is None`` counts as finite.
        loss: a tensor (any shape), a Python number, or anything else (``None``, a dict from a
            manual-optimization closure, ...), which counts as finite.

    Returns:
        0 when everything is finite. This costs two reductions per gradient (any NaN, any inf) on
        its device and one host read (of the byte); :func:`gather_nonfinite` reads nothing before
        its all-gather.
    """
    params = list(params)
    devices = [p.grad.device for p in params if p.grad is not None] + ([loss.device] if isinstance(loss, Tensor) else [])
    return int(_flag_byte(params, loss, devices[0] if devices else torch.device("cpu")).item())


@dataclass(frozen=True)
class NonFiniteFlags:
    """Every rank's flag byte, in rank order (identical on every rank after :func:`gather_nonfinite`).

    Truthy when any rank saw a non-finite loss or gradient.
    """

    per_rank: tuple[int, ...]
    digests: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return any(self.per_rank)

    @property
    def digests_agree(self) -> bool:
        """Whether every rank sent the same plan digest (``True`` when none was sent)."""
        return len(set(self.digests)) <= 1

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
    params: Iterable[Tensor], loss: Any, communicator: Communicator, tag: str = GUARD_TAG, digest: Optional[int] = None
) -> NonFiniteFlags:
    """Agree across ranks on non-finite values: one all-gather of one byte per rank (recorded under ``tag``).

    Every rank must call this at the same point of every step, with or without a problem.

    Args:
        params: this rank's parameters (their ``.grad`` is checked; ``None`` is fine).
        loss: this rank's loss (see :func:`local_nonfinite_flags`).
        communicator: collectives and ledger; the flag byte is computed on its ``device`` (where
            the collective needs it) and read back once, after the all-gather: the step's only host
            synchronisation.
        tag: ledger tag of the collective.
        digest: a signed 64-bit digest of what decides this rank's next collectives (e.g.
            :meth:`~demo_lightning.algorithms.DeMoExchange.plan_digest`), carried in the same
            all-gather (9 bytes per rank instead of 1) so every rank learns whether all agree without
            a collective of its own; every rank must pass one, or none.

    Returns:
        Every rank's flags (and digests), the same on every rank.
    """
    params = list(params)
    device = communicator.device  # NCCL takes no CPU tensor; the byte is computed there, nothing read back
    header = _flag_byte(params, loss, device)
    if digest is not None:  # torch.full: a kernel argument, no host-to-device copy
        header = torch.cat([header, torch.full((1,), digest, dtype=torch.int64, device=device).view(torch.uint8)])
    rows = torch.stack(communicator.all_gather_bytes(header, tag).wait()).cpu()  # the step's one host read
    digests = tuple(int(d) for d in rows[:, 1:].reshape(-1).clone().view(torch.int64).tolist()) if digest is not None else ()
    return NonFiniteFlags(tuple(int(b) for b in rows[:, 0].tolist()), digests)


def agree_nonfinite(params: Iterable[Tensor], loss: Any, communicator: Communicator, tag: str = GUARD_TAG) -> bool:
    """``True`` on every rank if any rank's loss or gradients hold a NaN or inf (see :func:`gather_nonfinite`)."""
    return bool(gather_nonfinite(params, loss, communicator, tag))


class NonFiniteGuard:
    """The guard as a step participant (:mod:`~demo_lightning.algorithms.participants`).

    ``before_update`` runs :func:`gather_nonfinite` over ``params()`` and the step's loss on every
    rank; with an ``exchange`` it also carries the exchange's plan digest, and if the digests differ
    every rank runs :meth:`~demo_lightning.algorithms.DeMoExchange.check_plan`, which raises the same
    ``RuntimeError`` everywhere; equal digests set ``step.plan_agreed``. On a non-finite value on
    any rank: ``policy="raise"`` raises :meth:`NonFiniteFlags.error` on every rank;
    ``policy="skip"`` drops every gradient (``p.grad = None``) and sets ``step.skip``, and
    :attr:`skipped_steps` counts it. :attr:`last_flags` keeps the agreed flags.

    Args:
        params: the parameters whose gradients are checked (called at every step).
        communicator: collectives and ledger.
        policy: ``"skip"`` or ``"raise"``.
        exchange: the DeMo exchange whose plan digest rides along (``None``: 1 byte per rank).
    """

    def __init__(
        self, params: Callable[[], list[Tensor]], communicator: Communicator, policy: NonFinitePolicy = "skip",
        exchange: Optional[Any] = None,
    ) -> None:
        self.params = params
        self.comm = communicator
        self.policy = check_nonfinite_policy(policy)
        self.exchange = exchange
        self.skipped_steps = 0
        self.last_flags: Optional[NonFiniteFlags] = None

    def before_update(self, step: Any) -> None:
        params = self.params()
        digest = self.exchange.plan_digest() if self.exchange is not None else None
        with stage_range(GUARD_NONFINITE):
            flags = self.last_flags = gather_nonfinite(params, step.loss, self.comm, GUARD_TAG, digest=digest)
        if self.exchange is not None:
            if not flags.digests_agree:
                self.exchange.check_plan()  # every rank learnt of the mismatch: all raise the same RuntimeError here
            step.plan_agreed = True
        if flags:
            if self.policy == "raise":
                raise flags.error(step.step)
            for p in params:
                p.grad = None
            self.skipped_steps += 1
            step.skip = True

    def after_update(self, step: Any) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Any) -> None:
        self.skipped_steps = int(state.get("skipped_steps", self.skipped_steps))
