"""DecoupledMomentum: SGD plus a momentum term whose strength is set independently of lr and beta.

Source: the owner's seed document ``001_d0fa5cf59d653e32.txt``, which describes a local update
rule under the name "decoupled momentum" (not the DeMo exchange of arXiv 2411.19870, which
``demo_lightning.algorithms.demo`` implements); see ``design/algorithms.md`` section 3.

Per parameter tensor ``p`` with gradient ``g``, at every step::

    p <- p * (1 - lr * weight_decay)          # decoupled weight decay, as AdamW (before the update)
    m <- beta * m + (1 - beta) * g            # optimizer.state[p]["momentum_buffer"], zeros at first
    v =  ||m|| / max(||g||, eps)              # per tensor, Frobenius norms, a scalar
    p <- p - lr * (g + lam * v * m)

``lam`` (the seed's lambda) scales the momentum term on its own: ``lam = 0`` is plain SGD (the
momentum is still kept, so a schedule can raise ``lam`` later). Since ``v * m`` has the norm
``||m||^2 / ||g||``, the momentum term is ``lam`` times as long as the gradient when ``m`` has the
gradient's size, and grows when the gradient shrinks relative to the momentum.

Defaults: ``beta=0.9``, ``lam=0.1``, ``eps=1e-8``, ``weight_decay=0``; ``lr`` has no default.
The seed's operating advice (to apply through per-layer policies and schedules, not built in):
``lam`` 0.05-0.2 (embeddings ~0.2, MLP ~0.05, normalisation layers 0), ``beta`` ramped from 0.9 to
0.99, ``lam`` raised stepwise late in training, warmup and gradient clipping early.

Per-parameter overrides: :meth:`DecoupledMomentum.set_param_options` stores ``beta`` / ``lam`` for
one tensor in :attr:`DecoupledMomentum.param_options`; they win over the group's values. They are
not part of ``state_dict()``: a per-layer policy callback is expected to re-apply them every step.

Precision: the momentum is kept in fp32 for fp16/bf16 parameters (in the parameter's dtype
otherwise) and the update of such parameters is computed in fp32 and rounded once; a checkpoint
round trip keeps the fp32 momentum (``torch.optim.Optimizer.load_state_dict`` alone would cast it
to the parameter's dtype).

Failure behaviour:

* Invalid hyperparameters raise ``ValueError`` naming the argument, the value and the valid range,
  at construction, in :meth:`~DecoupledMomentum.add_param_group` and
  :meth:`~DecoupledMomentum.set_param_options`, and at :meth:`~DecoupledMomentum.step` for values a
  scheduler or policy wrote into ``param_groups`` later. Sparse gradients raise ``RuntimeError``.
* Parameters whose ``grad`` is ``None`` are skipped: no weight decay, their momentum is untouched.
* A gradient of (near) zero norm with a non-zero momentum makes ``v`` as large as ``||m|| / eps``
  (the seed's rule, kept as written): the step is then ``lr * lam * ||m||^2 / eps`` long. A gradient
  that is exactly zero everywhere while the momentum is not is therefore a hazard; skip such a
  parameter (``grad = None``) or set its ``lam`` to 0.
* Non-finite gradients are not checked (as in ``torch.optim.SGD``): they make the parameter and
  its momentum non-finite; clip gradients or skip such steps upstream.

How it composes:

* Alone: a drop-in ``torch.optim.Optimizer`` (``Trainer`` with any strategy, or a plain loop).
* ``Trainer(strategy="desloc")`` / :class:`~demo_lightning.algorithms.desloc.DesLocAverager`: every
  worker steps its own copy; ``momentum_buffer`` is a first moment there, so by default it is
  averaged every ``3 K_x`` steps (``state_sync_every={"momentum_buffer": K}`` sets another period,
  ``periods_from_betas`` gives ``max(K_x, round(half_life(beta)))``).
* ``Trainer(strategy="demo")`` / :class:`~demo_lightning.algorithms.demo.DeMoExchange` with
  ``update="raw"``: the exchange writes the shared DeMo direction ``Q`` into ``p.grad`` and this
  optimizer takes it as ``g``. Every rank gets the same ``Q`` and starts from the same parameters,
  so the parameters and this optimizer's momentum stay bitwise identical across ranks. (With the
  default ``update="sign"`` it would apply its own momentum on top of ``sign(Q)``; the strategy warns
  only for optimizers with ``momentum``/``betas`` keys, so pick ``update="raw"`` yourself.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT
from typing_extensions import override

from demo_lightning.optim._precision import load_state_dict_keeping_fp32, momentum_dtype
from demo_lightning.validation import check_number

__all__ = ["STATE_KEY", "DecoupledMomentum", "decoupled_momentum_update"]

STATE_KEY = "momentum_buffer"
_OVERRIDABLE = ("beta", "lam")


# (low, high, low_open, high_open) of each option
_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "lr": (0.0, math.inf, True, True),
    "beta": (0.0, 1.0, False, True),
    "lam": (0.0, math.inf, False, True),
    "weight_decay": (0.0, math.inf, False, True),
    "eps": (0.0, math.inf, True, True),
}


def _check(name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``name`` if ``value`` is outside its valid range (``KeyError`` for an unknown name)."""
    low, high, low_open, high_open = _RANGES[name]
    check_number(name, value, low, high, low_open=low_open, high_open=high_open)


@torch.no_grad()
def decoupled_momentum_update(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    *,
    lr: float,
    beta: float,
    lam: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One update of one tensor, in place on ``param`` and ``momentum`` (the rule in the module docstring).

    Args:
        param: the parameter.
        grad: its gradient (same shape).
        momentum: its momentum: fp32 for fp16/bf16 parameters, else the parameter's dtype.
        lr: learning rate.
        beta: momentum decay.
        lam: strength of the momentum term.
        eps: floor of the gradient norm in ``v``.
        weight_decay: decoupled weight decay (multiplies ``param`` by ``1 - lr * weight_decay``).
    """
    g = grad.to(momentum.dtype)
    momentum.mul_(beta).add_(g, alpha=1.0 - beta)
    target = param if param.dtype == momentum.dtype else param.to(momentum.dtype)
    if weight_decay != 0:
        target.mul_(1.0 - lr * weight_decay)
    if lam == 0:
        direction = g
    else:
        v = torch.linalg.vector_norm(momentum) / torch.linalg.vector_norm(g).clamp_min(eps)
        direction = g.add(momentum * v, alpha=lam)
    target.add_(direction, alpha=-lr)
    if target is not param:
        param.copy_(target)


class DecoupledMomentum(Optimizer):
    """The "decoupled momentum" local rule: ``p -= lr * (g + lam * ||m|| / max(||g||, eps) * m)``.

    Args:
        params: parameters or parameter groups (groups may set any of the options below).
        lr: learning rate, > 0 (required).
        beta: momentum decay, in [0, 1).
        lam: strength of the momentum term (the seed's lambda), >= 0; 0 is plain SGD.
        eps: floor of ``||g||`` in ``v = ||m|| / max(||g||, eps)``, > 0.
        weight_decay: decoupled weight decay, >= 0 (``p *= 1 - lr * weight_decay`` before the update).

    Attributes:
        param_options: per-parameter overrides of ``beta`` / ``lam`` (see :meth:`set_param_options`);
            not saved by ``state_dict()``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        beta: float = 0.9,
        lam: float = 0.1,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        for name, value in (("lr", lr), ("beta", beta), ("lam", lam), ("eps", eps), ("weight_decay", weight_decay)):
            _check(name, value)
        defaults = {"lr": lr, "beta": beta, "lam": lam, "eps": eps, "weight_decay": weight_decay}
        self.param_options: dict[Tensor, dict[str, float]] = {}
        super().__init__(params, defaults)

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its options are validated after the defaults are filled in."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise

    @staticmethod
    def _check_group(group: Mapping[str, Any]) -> None:
        for name in ("lr", "beta", "lam", "eps", "weight_decay"):
            _check(name, group[name])

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # checkpoints from before an option existed
            group.setdefault("beta", 0.9)
            group.setdefault("lam", 0.1)
            group.setdefault("eps", 1e-8)
            group.setdefault("weight_decay", 0.0)
        if "param_options" not in self.__dict__:
            self.param_options = {}

    # ------------------------------------------------------------------ per-parameter overrides
    def set_param_options(self, param: Tensor, *, beta: Optional[float] = None, lam: Optional[float] = None) -> None:
        """Override ``beta`` and/or ``lam`` for one parameter (``None`` leaves that option as it is).

        Overrides win over the parameter's group and persist until :meth:`clear_param_options`.

        Args:
            param: one of this optimizer's parameters.
            beta: momentum decay for this parameter, in [0, 1).
            lam: momentum strength for this parameter, >= 0.
        """
        if not any(q is param for group in self.param_groups for q in group["params"]):
            raise ValueError(
                f"param (a tensor of shape {tuple(param.shape)}) is not a parameter of this optimizer; "
                "pass one of the tensors in its param_groups"
            )
        new: dict[str, float] = {}
        if beta is not None:
            _check("beta", beta)
            new["beta"] = float(beta)
        if lam is not None:
            _check("lam", lam)
            new["lam"] = float(lam)
        if new:
            self.param_options.setdefault(param, {}).update(new)

    def clear_param_options(self, param: Optional[Tensor] = None) -> None:
        """Drop the overrides of ``param``, or of every parameter when ``param`` is ``None``."""
        if param is None:
            self.param_options.clear()
        else:
            self.param_options.pop(param, None)

    # ------------------------------------------------------------------ checkpoints
    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s, but fp16/bf16 parameters keep their momentum in fp32."""
        load_state_dict_keeping_fp32(self, state_dict, STATE_KEY)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Union[float, Tensor]]] = None) -> Optional[Union[float, Tensor]]:  # type: ignore[override]
        """Update every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (run with gradients enabled).

        Returns:
            The closure's loss, or ``None`` without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._check_group(group)  # schedules and policies may have rewritten it
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("DecoupledMomentum does not support sparse gradients")
                state = self.state[p]
                dtype = momentum_dtype(p.dtype)
                buf = state.get(STATE_KEY)
                if buf is None:
                    buf = state[STATE_KEY] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                elif buf.dtype != dtype or buf.device != p.device:
                    buf = state[STATE_KEY] = buf.to(device=p.device, dtype=dtype)
                options = self.param_options.get(p, {})
                decoupled_momentum_update(
                    p,
                    p.grad,
                    buf,
                    lr=group["lr"],
                    beta=options.get("beta", group["beta"]),
                    lam=options.get("lam", group["lam"]),
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                )
        return loss
