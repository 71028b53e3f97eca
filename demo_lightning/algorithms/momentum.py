"""The DeMo exchange's own state: each worker's momentum, kept as transform coefficients.

For a tensor the codec compresses, the momentum is stored as its spectrum ``M`` (the ``Rp x Cp``
coefficient matrix of :mod:`~demo_lightning.codec.transform`, in its family's flat buffer), so
that a step needs one forward transform (of the gradient) and one inverse (of the mean)::

    M <- decay * M + T(pad(g));   select from M;   M <- M - sent   (error feedback, no transform)

``T`` is the codec's ``transform`` (DCT-II by default, Haar wavelets, or ``"identity"``: then ``M``
is the padded momentum itself). Every saved momentum records the transform it is in (a checkpoint
without the record is DCT, as every one was before the choice existed); one loaded under another
transform is converted at the next step like a re-tiling, ``M' = T'(T^-1(M))``, exactly up to rounding
(both are orthonormal and the padding is kept).

For a tensor sent densely it is stored as the tensor itself (``m <- decay * m + g``, cleared when
sent). Nothing outside this module reads the buffers: :meth:`SpectralMomentum.dense` gives a
parameter-shaped copy (``IDCT(M)[:R, :C]``) for monitors and tests, :meth:`SpectralMomentum.views`
the stored tensors for DES-LOC's averaging (a mean of spectra is the spectrum of the mean: the
transform is linear), and :meth:`state_dict` / :meth:`load_state_dict` carry it in checkpoints.

Padding: where a shape does not tile exactly, ``M`` also holds the padding's part of the residual
(what was sent outside the ``R x C`` corner is subtracted there too, and decays there like the
rest); the parameter-space algorithm instead crops the residual each step (``m`` has no padding).
Both agree exactly for shapes that tile exactly; for padded ones they differ only in that kept
padding residual, which is why the exchange's oracle test writes the coefficient-space algorithm
out directly.

Re-tiling: when a tensor's tiling changes (per-tensor ``chunk``, ``dense``), its momentum is
converted on every rank at the same step: ``m = IDCT(M)[:R, :C]``, then ``M' = DCT'(pad'(m))``
(dense: ``m`` itself; dense to compressed: ``DCT(pad(m))``). The padding's residual is dropped
in the conversion (there is no place for it in the new tiling). A change of ``k`` alone moves
the coefficients unchanged. Tensors that leave the trainable set keep their momentum until they
return.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from demo_lightning.algorithms.config import compute_dtype
from demo_lightning.algorithms.stages.plan import ExchangePlan, TensorPlan
from demo_lightning.codec import TRANSFORMS, TileLayout
from demo_lightning.codec.transform import accumulate_spectrum, inverse_spectrum

__all__ = ["MOMENTUM_STATE_VERSION", "SpectralMomentum"]

MOMENTUM_STATE_VERSION = 2
"""Layout version of :meth:`SpectralMomentum.state_dict`: 2 = spectra for compressed tensors.
(Version 1, before, kept parameter-shaped momenta in ``optimizer.state[p]["demo_momentum"]``;
:meth:`SpectralMomentum.load_dense` takes those.)"""


@dataclass
class _Loose:
    """A momentum outside the current storage: ``layout`` ``None`` means parameter-shaped; a
    spectrum is in ``transform``'s coefficients."""

    value: Tensor
    layout: Optional[TileLayout]
    transform: str = "dct"


def _layout_fields(layout: Optional[TileLayout]) -> Optional[list[int]]:
    if layout is None:
        return None
    return [layout.rows, layout.cols, layout.tile_rows, layout.tile_cols]


class SpectralMomentum:
    """Per-parameter momenta laid out for one :class:`~demo_lightning.algorithms.stages.ExchangePlan`."""

    def __init__(self) -> None:
        self.plan: Optional[ExchangePlan] = None
        self.params: list[Tensor] = []
        self._index: dict[Tensor, int] = {}  # planned parameter -> its position in the plan
        self.storage: dict[object, Tensor] = {}  # family key -> flat spectra
        self.dense_storage: dict[object, Tensor] = {}  # dense group key -> flat momenta
        self._loose: dict[Tensor, _Loose] = {}

    # ------------------------------------------------------------------ layout
    def adopt(self, plan: ExchangePlan, params: list[Tensor]) -> None:
        """Lay the momenta out for ``plan`` (over ``params``, in plan order), converting each
        tensor's current momentum (see the module docstring); new tensors start at zero."""
        staying = set(params)
        for p in self.params:  # a loaded momentum waiting for this layout wins over the one in storage
            if p not in self._loose:
                # a view of the old storage serves a tensor that stays (nothing writes the old storage
                # while the new one is filled); one that leaves the plan keeps a copy of its own
                self._loose[p] = self._take(p, copy=p not in staying)
        storage = {key: torch.zeros(f.numel, dtype=f.dtype, device=f.device) for key, f in plan.families.items()}
        dense = {key: torch.zeros(sum(i.numel for i in group), dtype=key[0], device=key[1]) for key, group in plan.dense_groups.items()}
        self.plan, self.params, self.storage, self.dense_storage = plan, list(params), storage, dense
        self._index = {p: i for i, p in enumerate(self.params)}
        for p, item in zip(params, plan.tensors):
            loose = self._loose.pop(p, None)
            if loose is not None:
                self._install(item, loose)

    def _target(self, item: TensorPlan) -> Tensor:
        if item.dense:
            return self.dense_storage[(item.dtype, item.device)][item.span].view(item.shape)
        return self.storage[item.family][item.span].view(item.matrix_shape)

    def _take(self, p: Tensor, copy: bool) -> _Loose:
        """``p``'s momentum in the current storage (a view of it, or a copy)."""
        assert self.plan is not None
        item = self.plan.tensors[self._index[p]]
        value = self._target(item)
        return _Loose(value.clone() if copy else value, item.layout, self.plan.config.transform)

    def _install(self, item: TensorPlan, loose: _Loose) -> None:
        assert self.plan is not None
        transform = self.plan.config.transform
        target = self._target(item)
        value = loose.value.to(device=target.device, dtype=target.dtype)
        if loose.layout == item.layout and (item.dense or loose.transform == transform):
            target.copy_(value if item.dense else value.view(item.matrix_shape))
            return
        if loose.layout == item.layout:  # same tiles, another transform: T'(T^-1(M)), the padding kept
            assert item.layout is not None
            scratch, padded = torch.empty_like(target), torch.empty_like(target)
            inverse_spectrum(value.view(item.matrix_shape), item.layout, padded, scratch, transform=loose.transform)
            whole = TileLayout(item.matrix_shape, *item.matrix_shape, item.layout.tile_rows, item.layout.tile_cols)
            accumulate_spectrum(padded, whole, target, 0.0, scratch, transform=transform)
            return
        dense = value if loose.layout is None else _to_dense(value, loose.layout, loose.transform)
        if item.dense:
            target.copy_(dense.reshape(item.shape))
        else:
            scratch = torch.empty(item.matrix_shape, dtype=target.dtype, device=target.device)
            accumulate_spectrum(dense.reshape(item.shape), item.layout, target, 0.0, scratch, transform=transform)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ access
    def item(self, p: Tensor) -> Optional[TensorPlan]:
        if self.plan is None or p not in self._index:
            return None
        return self.plan.tensors[self._index[p]]

    def views(self) -> list[Tensor]:
        """The stored momentum of every planned parameter, in plan order (spectra are ``Rp x Cp``):
        the tensors themselves, for in-place averaging."""
        assert self.plan is not None
        return [self._target(item) for item in self.plan.tensors]

    def dense(self, p: Tensor) -> Tensor:
        """``p``'s momentum, parameter-shaped (a new tensor; zeros before its first step)."""
        item = self.item(p)
        loose = self._loose.get(p)
        if item is None and loose is None:
            return torch.zeros(p.shape, dtype=compute_dtype(p.dtype), device=p.device)
        if loose is not None:  # loaded (or left the plan): it takes its place at the next adopt
            value, layout, transform = loose.value, loose.layout, loose.transform
        else:
            assert item is not None and self.plan is not None
            value, layout, transform = self._target(item), item.layout, self.plan.config.transform
        return (value.clone() if layout is None else _to_dense(value, layout, transform)).reshape(p.shape)

    def has(self, p: Tensor) -> bool:
        return self.item(p) is not None or p in self._loose

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, index_of: Mapping[Tensor, int]) -> dict[str, Any]:
        """``{"version": 2, "momenta": {index: {"value", "layout", "transform"}}}``: every momentum this
        worker holds, by parameter index (the optimizer ``state_dict`` numbering), copied; ``transform``
        names the coefficients a spectrum is in (``"dct"``, ``"haar"``, ``"identity"``)."""
        momenta: dict[int, dict[str, Any]] = {}
        if self.plan is not None:
            transform = self.plan.config.transform
            for p, item in zip(self.params, self.plan.tensors):
                momenta[index_of[p]] = {"value": self._target(item).clone(), "layout": _layout_fields(item.layout), "transform": transform}
        for p, loose in self._loose.items():
            if p in index_of:
                momenta[index_of[p]] = {"value": loose.value.clone(), "layout": _layout_fields(loose.layout), "transform": loose.transform}
        return {"version": MOMENTUM_STATE_VERSION, "momenta": momenta}

    def load_state_dict(self, state: Mapping[str, Any], params: list[Tensor]) -> None:
        """Install momenta saved by :meth:`state_dict` (``params``: all parameters by index). They
        take their place at the next :meth:`adopt` (the exchange's next step), re-tiled if the
        settings (tiling or transform) changed since; bitwise when they did not. An entry without a
        ``"transform"`` (saved before the choice existed) is DCT."""
        version = state.get("version")
        if version != MOMENTUM_STATE_VERSION:
            raise ValueError(f"DeMo momentum state of layout version {version!r}; this version reads {MOMENTUM_STATE_VERSION} "
                             "(and, through load_dense, the parameter-shaped momenta of version 1)")
        loose: dict[Tensor, _Loose] = {}
        for index, entry in state["momenta"].items():
            p = _param_at(params, index)
            fields = entry["layout"]
            if fields is None:
                _check_shape(entry["value"], p, index)
                layout = None
            else:
                rows, cols, tile_rows, tile_cols = (int(v) for v in fields)
                layout = TileLayout(tuple(p.shape), rows, cols, tile_rows, tile_cols)
                if rows * cols != p.numel() or tuple(entry["value"].shape) != (layout.padded_rows, layout.padded_cols):
                    raise ValueError(f"saved DeMo momentum for parameter {index} has shape {tuple(entry['value'].shape)} for a "
                                     f"parameter of shape {tuple(p.shape)}: the checkpoint comes from a different model")
            transform = entry.get("transform", "dct")
            if transform not in TRANSFORMS:
                raise ValueError(f"saved DeMo momentum for parameter {index} is in transform {transform!r}; this version reads {TRANSFORMS}")
            loose[p] = _Loose(entry["value"].detach().to(dtype=compute_dtype(p.dtype), device=p.device).clone(), layout, transform)
        self._replace(loose)

    def load_dense(self, momenta: Mapping[int, Tensor], params: list[Tensor], merge: bool = False) -> None:
        """Install parameter-shaped momenta by index (layout version 1: checkpoints written before
        the momentum moved into coefficient space). ``merge`` keeps the other parameters' momenta."""
        loose = {}
        for index, value in momenta.items():
            p = _param_at(params, index)
            _check_shape(value, p, index)
            loose[p] = _Loose(value.detach().to(dtype=compute_dtype(p.dtype), device=p.device).clone(), None)
        if merge:
            self._loose.update(loose)
        else:
            self._replace(loose)

    def _replace(self, loose: dict[Tensor, _Loose]) -> None:
        """Hold exactly ``loose`` (every momentum waits for the next :meth:`adopt`; no layout until then)."""
        self.plan, self.params, self._index, self.storage, self.dense_storage = None, [], {}, {}, {}
        self._loose = loose

    def clear(self) -> None:
        """Drop every momentum (they restart from zero)."""
        for buf in [*self.storage.values(), *self.dense_storage.values()]:
            buf.zero_()
        self._loose = {}


def _to_dense(value: Tensor, layout: TileLayout, transform: str) -> Tensor:
    scratch, out = torch.empty_like(value), torch.empty_like(value)
    return inverse_spectrum(value, layout, out, scratch, transform=transform)[: layout.rows, : layout.cols].reshape(layout.shape).clone()


def _param_at(params: list[Tensor], index: Any) -> Tensor:
    if not 0 <= int(index) < len(params):
        raise ValueError(f"saved DeMo momentum for parameter {index}, but the optimizer has {len(params)}")
    return params[int(index)]


def _check_shape(value: Tensor, p: Tensor, index: Any) -> None:
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(
            f"saved DeMo momentum for parameter {index} has shape {tuple(value.shape)}, the parameter "
            f"{tuple(p.shape)}: the checkpoint comes from a different model"
        )

