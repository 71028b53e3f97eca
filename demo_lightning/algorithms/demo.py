"""The DeMo exchange: decoupled momentum with a compressed, error-fed exchange of its fast components.

Paper: "DeMo: Decoupled Momentum Optimization", Peng, Quesnelle, Kingma, arXiv 2411.19870.

Per trainable tensor, once per optimizer step, after the backward pass and before the
optimizer's update, on every worker (no gradient all-reduce at all). The momentum is kept in the
DCT domain (:class:`~demo_lightning.algorithms.momentum.SpectralMomentum`; the transform is linear
and orthonormal, so this is the paper's algorithm with two transforms per step instead of three)::

    M  <- decay * M + DCT(pad(g))          # encode: one forward transform, the decay fused into its GEMM
    (I, V) = select(M, k)                  # top-k by magnitude per tile, or the k lowest frequencies
    V^ = wire(V)                           # transport: what receivers decode (value_format)
    M  <- M - (1 - rho) scatter(I, V^)     # error feedback, in coefficient space (no transform); rho = retain_sent, 0 by default
    Q  =  IDCT( sum_r scatter(I_r, V^_r) / W )[:R, :C]   # decode: rank order 0..W-1, one inverse
    p.grad <- sign(Q)   (update="sign", the paper's rule, for plain SGD)
    p.grad <- Q         (update="raw", the shared direction for any optimizer)
    p.grad <- Q / sqrt(mean(Q^2))   (update="normalized", per tensor: the sign's step size, Q's shape)

``DCT`` above is the codec's ``transform`` (:class:`~demo_lightning.algorithms.CodecConfig`,
:mod:`~demo_lightning.codec.bases`): the DCT-II by default, ``"haar"`` (Haar wavelets, the same
GEMMs with another orthonormal matrix) or ``"identity"`` (no transform: the momentum is kept, selected
and error-fed as it is, SparseLoCo's chunked top-k; no GEMM runs). Every step above is the same for
all three.

Momentum compensation (``DeMoConfig.compensation = lambda``, seed 000 §5.1, for small batches):
``g`` above is replaced by ``g_t + lambda (g_t - g_{t-1})`` (``g_1`` at the first step), each worker
keeping its last gradients (in :meth:`DeMoExchange.state_dict`).

Gradient smoothing (``DeMoConfig.gradient_ema = beta_g``, issue 18): ``g`` above is replaced by
``e <- beta_g e + (1 - beta_g) g`` (zeros at first), each worker keeping ``e`` (in
:meth:`DeMoExchange.state_dict`). DeMo's error feedback restarts a component that is sent at every
step from its gradient, so the strongest coefficients carry no momentum; ``e`` gives them Signum's
(arXiv 1802.04434): with every coefficient kept, fp32 values and ``update="sign"`` the step is
``sign(mean_r e_r) = sign(EMA(mean gradient))``, Signum with ``beta = beta_g`` on DDP's gradient.
What is sent still sums to what was fed, so unlike a momentum over the decoded mean nothing is
counted twice. Measured, it does not give Signum's lead back once coefficients are selected: an
ablation, off by default (see ``DeMoConfig.gradient_ema``).

Position groups (``CodecConfig.position_group_size = G > 1``, seed 000 §7, top-k only): the
compressed tensors of one shape and role (:meth:`DeMoExchange.set_parameter_names`; the strategies
name them from the module, so ``blocks.0.fc.weight`` groups with ``blocks.1.fc.weight``) are cut, in
order, into groups of ``G``; per tile index each worker selects ``I = topk(sum_m |M_m|^2, k)`` over
its group's members ``m`` and every member sends its values at ``I``; the positions go on the wire
once per group (in its first member's segment), so ``G - 1`` of every ``G`` members send values only.
Error feedback, the mean and the decode are unchanged. :meth:`DeMoExchange.payload_bytes` is the
per-tensor figure without groups (an upper bound); the ledger counts what is sent.

Tensors with fewer than ``dense_below`` elements, and 1-D tensors (``dense_vectors``), skip the codec: their whole momentum is summed
by an all-reduce in ``dense_format`` (bfloat16 by default; ``"fp32"``: the compute dtype, fp32 for
half-precision parameters) and divided by W; their residual becomes what the rounding to that
format lost, ``m - bf16(m)`` (zero under ``"fp32"``: everything was sent).

Padded tiles: where a shape does not tile exactly the padding's residual is kept in ``M`` (see
:mod:`~demo_lightning.algorithms.momentum`), where the parameter-space form would crop it each step.

Stages (:mod:`~demo_lightning.algorithms.stages`): plan, encode, transport (all-gather of positions
and values, or all-reduce of fixed positions), decode. Work per step: one forward and one inverse
transform per compressed tensor, straight from and into the tensors' own memory (views when the
shape tiles exactly); one ``topk`` per family of equal tiles; energy only when a callback asks
(:meth:`DeMoExchange.request_energy`, :meth:`DeMoExchange.request_energy_curve`); no host
synchronisation in the step (the collectives' own aside), so it runs the same on a GPU. The step
runs inside the stage range ``demo/exchange`` and each stage inside its own (``demo/encode`` with
``demo/encode/transform`` and ``demo/encode/select``; ``demo/transport``: the collectives, their
waits and the unpacking, with ``demo/transport/pack`` and ``demo/transport/unpack``; ``demo/decode``
with ``demo/decode/scatter_add`` and ``demo/decode/inverse``; ``demo/node`` under a node hierarchy),
so ``torch.profiler``, Lightning's profilers and :func:`~demo_lightning.profiling.measure_stages`
show where the exchange's time goes (:mod:`~demo_lightning.profiling`).

Node hierarchy (``node_groups``, after Psyche and FlexDeMo: DeMo between nodes only): the
``G`` ranks of a node first average their gradients densely over the fast intra-node link (one
all-reduce, ``demo/node_reduce``), so the node acts as one DeMo worker. The trainable tensors are
split among the node's local ranks (greedily by payload, from shapes and settings alone, so every
rank computes the same split); local rank ``i`` keeps the momenta of its share only and runs the
exchange above for it with local rank ``i`` of every other node (the inter-node group: ``W`` is the
number of nodes there), so the node's link carries each byte of the node's payload once, not ``G``
times. Each local rank then broadcasts the updates of its share to its node (``demo/node_share``).
Every rank of every node ends the step with the same ``p.grad``: the inter-node exchange is
identical on its ``N`` ranks and the broadcast copies it inside the node.

Differences from the reference implementation (bloc97/DeMo), each deliberate:

* the momentum is state of the exchange, saved and restored with it (:meth:`DeMoExchange.state_dict`);
* the exchange runs after the closure (Lightning's forward/backward), not before it;
* ``grad is None`` counts as a zero gradient, so every rank sends the same sizes;
* the decode is a true mean over all workers in a fixed rank order, so every replica computes
  bitwise the same update; positions are Elias-Fano coded (or bit-packed), values are fp32/bf16/fp16/int8/sign;
* tensors are tiled with padding (no prime-size degeneration; N-D weights work);
* collectives are bucketed: one collective per bucket of up to ``bucket_cap_mb`` megabytes, all
  started before the first is waited on.

Failure behaviour: a collective that cannot complete raises :class:`~demo_lightning.comm.CollectiveError`
on the ranks that wait for it, after the process group's timeout. Parameters and gradients are then
untouched, and error feedback is not applied (it runs only after every collective completed), but
the momenta already hold this step's decayed gradient: such a step cannot be retried in place.
Restart from a checkpoint (after a ``CollectiveError`` the process group is unusable anyway). Every step, before any data moves, every rank's plan
digest (trainable tensors and their codec settings) is compared across ranks
(:meth:`DeMoExchange.check_plan`, or the strategy's guard, which carries it): a rank whose tensors
or settings changed alone makes every rank raise the same ``RuntimeError``.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Optional, get_args

import torch
from torch import Tensor
from torch.optim import Optimizer

from demo_lightning.algorithms.clipping import clip_gradients
from demo_lightning.algorithms.config import DEFAULT_TOPK, CodecConfig, TensorCodec, compute_dtype
from demo_lightning.algorithms.momentum import SpectralMomentum
from demo_lightning.algorithms.participants import StepContext
from demo_lightning.algorithms.stages import (
    ExchangePlan,
    Outgoing,
    Selected,
    TensorPlan,
    Workspace,
    accumulate,
    block_role,
    broadcast_positions,
    build_plan,
    inverse,
    select,
    select_at,
    transform_into,
    transport_for,
    write_magnitudes,
    zeroed_means,
)
from demo_lightning.codec import lowpass_order
from demo_lightning.codec.transform import tile_view
from demo_lightning.comm import Communicator, NodeGroups, StepTraffic, ddp_bytes_for
from demo_lightning.comm.topology import split_by_payload
from demo_lightning.profiling import DEMO, DEMO_CLIP, DEMO_EXCHANGE, DEMO_NODE, stage_range
from demo_lightning.validation import check_choice, check_int, check_number

__all__ = [
    "DEFAULT_CLIP_GRAD_NORM", "DEFAULT_EARLY_STEPS", "DEFAULT_EARLY_TOPK", "DEFAULT_TOPK", "DEMO_STATE_KEY",
    "MIN_DEFAULT_EARLY_STEPS", "UPDATES",
    "DeMoConfig", "DeMoExchange", "ExchangeStats", "TensorEnergy", "TensorSettings", "Update", "default_early_steps",
    "warn_if_stateful",
]

DEMO_STATE_KEY = "demo_momentum"
"""The name of the DeMo momentum among the states DES-LOC averages (``state_sync_every``), and the
optimizer-state key where checkpoints of layout version 1 kept it."""
DEFAULT_EARLY_STEPS = 40
"""Exchanges in the early phase when neither ``topk`` nor ``keep_ratio`` is given, at up to 2
workers (issue 18); past 2 workers :func:`default_early_steps`."""
MIN_DEFAULT_EARLY_STEPS = 20
"""The shortest default early phase (:func:`default_early_steps`): at 2 workers 10 exchanges of 256
a tile left the stall later than 40 did (issue 18)."""
EARLY_TOPK_FACTOR = 4
"""The early phase's multiple of an explicit ``topk`` / ``keep_ratio`` when ``early_topk_factor`` is unset."""
DEFAULT_EARLY_TOPK = EARLY_TOPK_FACTOR * DEFAULT_TOPK
"""Coefficients per tile the default early phase keeps, at any number of workers (256)."""
DEFAULT_CLIP_GRAD_NORM = 1.0
"""The total L2 norm each worker clips its gradient to before its momentum (``DeMoConfig.clip_grad_norm``)."""


def default_early_steps(workers: int) -> int:
    """The default early phase's length in exchanges over ``workers`` DeMo workers (issue 18):
    ``clamp(80 // W, 20, 40)``: 40 at 1 and 2 workers, 26 at 3, 20 from 4 on.

    Why: the phase keeps :data:`DEFAULT_EARLY_TOPK` (256) a tile per worker at any ``W``; the stall it
    cures (the model sitting at the corpus's unigram entropy) was removed by 256 a tile, not by the
    same coefficients gathered from more workers (at 4 workers 4 x 128 stalled where 2 x 256 did
    not). Halving the phase as ``W`` doubles keeps what it gathers, ``W x 256 x steps``, the same
    from 2 to 4 workers, so its bytes over a run do not grow with ``W`` there; measured at 4 workers
    (``benchmarks/parity.py``), 20 exchanges of 256 removed the stalls that 40 of 128 left on the
    1.8 M GPT, at about the bytes of the phase before, but not every stall: on the 0.44 M GPT at
    2e-3 it moved one between seeds. 40 exchanges of 256 stall fewer seeds and take a 520-step run
    from 100x to 86x fewer bytes than DDP (``early_topk_factor=8`` alone gives that phase at 4
    workers). The floor of 20: no shorter phase was measured to work (10 exchanges of 256 at 2
    workers left the stall late); past 4 workers nothing was measured."""
    workers = check_int("workers", workers, 1, "DeMo workers in the exchange")
    return max(MIN_DEFAULT_EARLY_STEPS, min(DEFAULT_EARLY_STEPS, 2 * DEFAULT_EARLY_STEPS // workers))
Update = Literal["sign", "raw", "normalized"]
UPDATES: tuple[str, ...] = get_args(Update)


@dataclass(frozen=True)
class DeMoConfig:
    """Settings of the DeMo exchange.

    Defaults (topk 64 at 2 workers, 1-bit ``sign`` values with a per-tile scale, decay 0.99) were
    chosen by measurement on the bundled GPT job (``benchmarks/first_figures.py``): at about the
    paper's bytes per step (its topk 32 with fp32 values and int64 indices costs 3.7x more) they
    reached the closest loss to AdamW + DDP. With neither ``topk`` nor ``keep_ratio`` given, the
    exchange keeps ``clamp(128 // W, 8, 64)`` per tile over ``W`` DeMo workers
    (:func:`~demo_lightning.algorithms.config.default_topk`), so its bytes per worker do not grow
    with ``W`` up to 16, after an early phase of 256 a tile for the first ``clamp(80 // W, 20, 40)``
    exchanges (:func:`default_early_steps`: 40 at 2 workers, 20 at 4); the codec sends the tensors under ``dense_below`` (1,024 elements)
    and the 1-D ones in bf16 (an explicit ``topk`` or ``keep_ratio`` has no early phase unless
    ``early_steps`` is given); each worker's gradient is clipped at norm 1.0 before its momentum
    (``clip_grad_norm``). Across corpora, sizes and seeds (issue 18, ``benchmarks/parity.py``),
    against DDP + AdamW clipped alike, each at its best rate on a tuning corpus, three seeds: on
    held-out C/C++ 1.02-1.04x DDP's validation loss, on held-out English prose 1.07-1.15x, on the
    tuning corpus 1.05-1.12x (the 0.44 M and 1.8 M GPTs at 2 and 4 workers) at 130-159x fewer
    bytes; unclipped, and before the clip was the default, 1.04x (C/C++) and 1.07x (prose) on
    the 6.4 M GPT (115x) and DDP's validation accuracy on a ResNet-10t (101x).
    The paper's settings are
    ``DeMoConfig(CodecConfig(topk=32, value_format="fp32"), decay=0.999)``.

    Args:
        codec: how momenta are compressed on the wire (:class:`CodecConfig`: chunk, topk or
            keep_ratio, selection, value_format, dense_below, dense_vectors, dense_format, bucket_cap_mb).
        decay: momentum decay beta in [0, 1) (the reference's ``compression_decay``; it used 0.999).
        update: ``"sign"`` writes ``sign(Q)`` into ``p.grad`` (plain SGD); ``"raw"`` writes ``Q``;
            ``"normalized"`` writes ``Q`` over its root mean square per tensor (plain SGD: the sign's
            step size, computed in at least fp32; an all-zero ``Q`` stays zero). Issue 18's test of
            whether the sign discards what a larger global batch gains: on the 0.44 M GPT over 1,040
            steps at 4 workers (prose) it ended at 1.22x DDP's loss (1.29x at lr 3e-3) where the
            sign ended at 1.06x.
        compensation: the seed's momentum compensation for small batches (seed 000 §5.1,
            ``v + lambda (g_t - g_{t-1})``), ``lambda`` in [0, 1]: each worker feeds its momentum
            ``g_t + lambda (g_t - g_{t-1})`` instead of ``g_t`` (the first step, and a tensor with no
            previous gradient, ``g_t`` alone). ``0`` (the default) is DeMo as published. Memory: one
            copy of every exchanged tensor's last gradient (its compute dtype) per worker, saved in
            the exchange's state (checkpoints), so a resume continues bitwise.
        early_steps: the early phase's length in exchanges: while fewer than that many exchanges
            have run (the count is in :meth:`DeMoExchange.state_dict`, so a resume goes on where it
            was), every tensor without a per-tensor strength keeps the early phase's k per tile
            (``early_topk_factor``). ``None`` (the default): :func:`default_early_steps` exchanges
            (``clamp(80 // W, 20, 40)`` over ``W`` workers: 40 at 2, 20 at 4) when the codec's k is
            the default (neither ``topk`` nor ``keep_ratio`` given; 40 when only
            ``early_topk_factor`` is given, as before the phase followed ``W``), none for an explicit strength,
            whose user chose k; an integer: that many exchanges whatever the strength (``topk=64,
            early_steps=40`` keeps 256 a tile for 40 exchanges, a ``keep_ratio`` is multiplied by 4
            and capped at 1). ``0`` switches it off. Issue 18: with k
            64 from the first step, the 1.8 M and 6.4 M GPTs on English prose sat at the corpus's unigram
            entropy for about 80 steps at some seeds (the model knows the bytes' frequencies and
            nothing of their order) and never caught up (1.24x DDP's loss); 256 coefficients a tile
            for the first 40 steps removed or shortened that stall at most seeds, not at every one: the
            1.8 M GPT's seed 0 still sat there from step ~25 to ~75, the 6.4 M GPT's seed 2 from 40
            to 110 (``benchmarks/parity.py``). A phase of 80 exchanges moved the stall between seeds
            rather than removing it (1.02x on the mean of three seeds against 1.07x, per seed 0.90x
            to 1.13x). At 4 workers 40 exchanges of 4 x 32 = 128 a tile left the 1.8 M GPT's prose
            seed 0 at the unigram entropy for ~120 steps (1.27x DDP's loss) and the 0.44 M GPT's seed
            2 at 2e-3 too (1.24x); 20 exchanges of 256 removed both (0.99x, 1.00x) at the bytes of the
            phase before. Over a 520-step run the phase costs about 15 % more bytes; over long runs,
            nothing that shows.
        early_topk_factor: how many times the k the early phase keeps (an integer >= 1;
            ``1`` switches it off); clamped to the whole tile. ``None`` (the default):
            :data:`DEFAULT_EARLY_TOPK` (256) a tile for the default k at any number of workers (4x
            at 1 and 2 workers, 8x at 4), 4x an explicit strength.
        retain_sent: ``rho`` in [0, 1): error feedback takes ``(1 - rho)`` of each sent component out of
            the sender's momentum and keeps ``rho`` of it (dense tensors: ``rho`` of what they sent).
            With ``0`` (DeMo as published) a component sent at every step restarts from its
            gradient each step, so the coefficients that matter most carry no momentum: issue 18
            found the default at 4 workers level with signSGD on the exact mean gradient, where
            Signum (beta 0.9) was 0.18 lower. With ``rho > 0`` a component sent at every step carries
            a momentum of decay ``decay * rho``. Measured there (seed 0, 520 steps) it trains worse
            the larger ``rho``: 1.8660 at 0.2, 1.8958 at 0.5, 2.4364 at 0.9 against 1.8019 at 0, so it
            stays an ablation. The momentum is state as before; nothing else changes (bytes, collectives).
        gradient_ema: ``beta_g`` in [0, 1): each worker feeds its momentum ``e <- beta_g e + (1 -
            beta_g) g`` (zeros at first) instead of ``g``, so a component sent at every step carries
            Signum's momentum instead of none (see the module docstring: with every coefficient
            kept it is Signum on the mean gradient). ``0`` (the default) is DeMo as published.
            Applied after ``compensation``. Memory: one copy of every exchanged tensor (its compute
            dtype) per worker, saved in the exchange's state (checkpoints), so a resume continues
            bitwise. Bytes and collectives are unchanged. Measured (issue 18: the 0.44 M GPT, 4
            workers, the stdlib corpus, seed 0, 520 steps) it trains worse the larger ``beta_g``:
            1.8083 at 0.2, 1.8361 at 0.5 and 2.7643 at 0.9 against 1.7998 at 0; at 0.9 it stalls at
            k 256 too (2.5263), while with every coefficient kept in fp32 it matches Signum (1.6325
            against 1.6234). So it stays an ablation.
        clip_grad_norm: each worker scales its gradient down to this total L2 norm, when larger,
            before the gradient enters its momentum: ``torch.nn.utils.clip_grad_norm_`` over the
            exchanged parameters in ``param_groups`` order (so bitwise what Lightning's
            ``gradient_clip_val`` of the same value does there); under ``hierarchy="node"`` the
            node's mean gradient. ``None`` switches it off. Default :data:`DEFAULT_CLIP_GRAD_NORM`
            (1.0), chosen on issue 18's matrix: at the same learning rate clipping lowered the
            default's validation loss in 44 of 46 cells (3 corpora, 0.44 M and 1.8 M GPTs, 2 and 4
            workers, three seeds; the other two within 0.024; ``benchmarks/parity.py clipping``),
            and it let the 0.44 M GPT at 4 workers train at twice the rate, 0.14 lower on the
            tuning corpus (our reading, not measured: the residual keeps a large early gradient
            for many steps, and the sign rule weighs it by its size). The sign rule is blind to the gradient's scale within a step, so a model
            whose gradients stay above the threshold gets each step's gradient normalised (a
            clip of 0.5 or 0.25 trained bit for bit alike there). A non-finite gradient makes
            every gradient non-finite (the guard skips or raises on such steps before the
            exchange runs).
    """

    codec: CodecConfig = field(default_factory=CodecConfig)
    decay: float = 0.99
    update: Update = "sign"
    compensation: float = 0.0
    early_steps: Optional[int] = None
    early_topk_factor: Optional[int] = None
    retain_sent: float = 0.0
    gradient_ema: float = 0.0
    clip_grad_norm: Optional[float] = DEFAULT_CLIP_GRAD_NORM

    @classmethod
    def of(cls, **settings: Any) -> "DeMoConfig":
        """Build from flat settings: :class:`CodecConfig`'s fields go to ``codec``, the rest
        (``decay``, ``update``, ``compensation``) to the exchange; e.g. ``DeMoConfig.of(topk=32, decay=0.999)``."""
        names = {f.name for f in fields(CodecConfig)}
        codec = {k: v for k, v in settings.items() if k in names}
        own = {k: v for k, v in settings.items() if k not in names}
        unknown = sorted(set(own) - {f.name for f in fields(cls)} - {"codec"})
        if unknown:
            raise TypeError(f"unknown DeMo setting(s) {unknown}; the codec takes {sorted(names)}, the exchange decay, update, "
                            "compensation, early_steps, early_topk_factor, retain_sent, gradient_ema and clip_grad_norm")
        return cls(codec=CodecConfig(**codec), **own)

    def __post_init__(self) -> None:
        if not isinstance(self.codec, CodecConfig):
            raise ValueError(f"codec must be a CodecConfig, got {type(self.codec).__name__}; e.g. DeMoConfig(CodecConfig(topk=32))")
        _check_decay(self.decay)
        check_choice("update", self.update, UPDATES)
        check_number("compensation", self.compensation, 0.0, 1.0,
                     hint="the seed's lambda in v + lambda (g_t - g_{t-1}), for small batches; 0 switches it off")
        if self.early_steps is not None:
            check_int("early_steps", self.early_steps, 0,
                      "exchanges at the start that keep early_topk_factor times the k; 0 switches it off, "
                      "None: clamp(80 // workers, 20, 40) for the default k")
        if self.early_topk_factor is not None:
            check_int("early_topk_factor", self.early_topk_factor, 1,
                      "times the k kept in the early phase; 1 switches it off, None: 256 a tile for the default k, 4x an explicit one")
        check_number("retain_sent", self.retain_sent, 0.0, 1.0, high_open=True,
                     hint="the share of each sent component kept in the sender's momentum; 0 (DeMo's error feedback) takes it all out")
        check_number("gradient_ema", self.gradient_ema, 0.0, 1.0, high_open=True,
                     hint="beta of the moving average of gradients each worker feeds its momentum (Signum's 0.9); 0 feeds the gradient")
        if self.clip_grad_norm is not None:
            check_number("clip_grad_norm", self.clip_grad_norm, 0.0, low_open=True,
                         hint="the total L2 norm each worker clips its gradient to before its momentum; None switches it off")

    def early_exchanges_for(self, workers: int) -> int:
        """How many exchanges the early phase lasts over ``workers`` DeMo workers: ``early_steps``
        when given; else, for the default k, :func:`default_early_steps` ``(workers)`` (with
        ``early_topk_factor`` unset too) or :data:`DEFAULT_EARLY_STEPS` (40, with a factor given),
        and 0 for an explicit strength; 0 when ``early_topk_factor`` is 1."""
        if self.early_topk_factor == 1:
            return 0
        if self.early_steps is not None:
            return self.early_steps
        if not self.codec.default_strength:
            return 0
        # a given factor alone keeps the 40 exchanges it had before the phase followed W (stored runs re-run as they were)
        return default_early_steps(workers) if self.early_topk_factor is None else DEFAULT_EARLY_STEPS

    def early_codec_for(self, workers: int) -> Optional[CodecConfig]:
        """The codec of the early phase over ``workers`` DeMo workers (``None`` without one): the
        codec's k times ``early_topk_factor`` when given (:meth:`CodecConfig.for_workers`); unset,
        :data:`DEFAULT_EARLY_TOPK` (256) a tile for the default k at any ``W``, 4x an explicit
        strength (a ``keep_ratio`` capped at 1, a ``topk`` past the tile keeps the whole tile)."""
        if not self.early_exchanges_for(workers):
            return None
        if self.early_topk_factor is not None:
            return self.codec.for_workers(workers, self.early_topk_factor)
        if self.codec.default_strength:
            return replace(self.codec, topk=DEFAULT_EARLY_TOPK)
        return self.codec.for_workers(workers, EARLY_TOPK_FACTOR)

    @property
    def has_early_phase(self) -> bool:
        """Whether the first exchanges keep more than the codec's k, at any number of workers: not
        when ``early_steps`` is 0 or ``early_topk_factor`` 1, nor for an explicit strength without
        an ``early_steps``."""
        return self.early_exchanges_for(1) > 0


def _check_decay(decay: Any) -> None:
    check_number("decay", decay, 0.0, 1.0, high_open=True, hint="the paper uses 0.999")


@dataclass(frozen=True)
class TensorSettings:
    """One tensor's departures from the :class:`DeMoConfig` (``None`` fields inherit it).

    Set by per-layer policies and the adaptive keep ratio through
    :meth:`DeMoExchange.set_tensor_settings`; every rank must set the same ones at the same step
    (a codec mismatch raises on every rank; a decay mismatch would only change local momenta).

    Args:
        decay: momentum decay beta in [0, 1) for this tensor.
        topk: coefficients kept per tile.
        keep_ratio: fraction of each tile kept, in (0, 1]; exclusive with ``topk``.
        chunk: tile side.
        dense: ``True``: whole momentum all-reduced (in ``dense_format``); ``False``: compressed even when small.
    """

    decay: Optional[float] = None
    topk: Optional[int] = None
    keep_ratio: Optional[float] = None
    chunk: Optional[int] = None
    dense: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.decay is not None:
            _check_decay(self.decay)
        _ = self.codec

    @functools.cached_property
    def codec(self) -> TensorCodec:  # built once per (immutable) settings object: the step reads it per tensor
        return TensorCodec(topk=self.topk, keep_ratio=self.keep_ratio, chunk=self.chunk, dense=self.dense)


@dataclass(frozen=True)
class TensorEnergy:
    """How much of one tensor's momentum energy (squared L2 norm) an exchange sent, on this worker.

    The DCT is orthonormal, so ``total`` is the energy of all the momentum's coefficients (its
    padding's residual included) and ``captured`` that of the selected ones before quantisation;
    a dense tensor sends everything (``captured == total``, ``k == 0``). ``curve[k - 1]`` (only when
    requested) is the fraction of ``total`` the best ``k`` coefficients per tile would keep (for
    ``"lowpass"``: the ``k`` lowest frequencies), for ``k = 1..tile_numel``.
    """

    total: float
    captured: float
    k: int
    tile_numel: int
    n_tiles: int
    curve: Optional[Tensor] = None

    @property
    def fraction(self) -> float:
        """Captured fraction of the energy (1 for an all-zero momentum, which loses nothing)."""
        return self.captured / self.total if self.total > 0 else 1.0

    def k_for(self, target: float) -> int:
        """Smallest ``k`` whose curve reaches ``target`` (the largest ``k`` if none does)."""
        if self.curve is None:
            raise ValueError("this TensorEnergy has no curve: call DeMoExchange.request_energy_curve() before the step")
        hit = torch.nonzero(self.curve >= target - 1e-12)
        return int(hit[0, 0]) + 1 if hit.numel() else int(self.curve.numel())


@dataclass
class ExchangeStats:
    """What the exchanges of this worker did: the last one, and running totals."""

    traffic: StepTraffic = field(default_factory=lambda: StepTraffic(0.0, 0.0, 0, 0, 0.0))
    seconds: float = 0.0
    comm_seconds: float = 0.0
    coefficients: int = 0
    n_trainable: int = 0
    steps: int = 0
    total_seconds: float = 0.0
    total_comm_seconds: float = 0.0
    tiled_elements: int = 0
    energy: list[TensorEnergy] = field(default_factory=list)
    exchanged: list[Tensor] = field(default_factory=list)
    """The parameters this worker exchanged in the last step, in the order of :attr:`energy` (all
    trainable ones; under a node hierarchy its share)."""

    @property
    def keep_ratio(self) -> float:
        """Coefficients sent by the codec over the (padded) elements of the tensors it compressed (last step)."""
        return self.coefficients / self.tiled_elements if self.tiled_elements else 1.0

    @property
    def energy_fraction(self) -> Optional[float]:
        """Fraction of the momenta's energy the last exchange sent (all tensors together); ``None``
        unless that step measured energy (:meth:`DeMoExchange.request_energy`)."""
        if not self.energy:
            return None
        total = sum(e.total for e in self.energy)
        return sum(e.captured for e in self.energy) / total if total > 0 else 1.0

    @property
    def sent_bytes(self) -> float:
        return self.traffic.sent_bytes

    @property
    def received_bytes(self) -> float:
        return self.traffic.received_bytes

    @property
    def payload_bytes(self) -> int:
        return self.traffic.payload_bytes

    @property
    def ratio_vs_ddp(self) -> float:
        return self.traffic.ratio_vs_ddp


class DeMoExchange:
    """Attach the DeMo exchange to an optimizer (no Lightning needed).

    Call :meth:`step` after the backward pass and before ``optimizer.step()``; it replaces every
    trainable parameter's ``grad`` with the shared update. As a step participant
    (:mod:`~demo_lightning.algorithms.participants`) it does that in :meth:`before_update`.

    Args:
        optimizer: the optimizer whose parameters are exchanged (its ``param_groups`` order is the
            exchange order, so it must be the same on every rank).
        config: exchange settings.
        communicator: collectives and ledger; a fresh one over the default group by default.
        node_groups: run the node hierarchy over these groups (see the module docstring;
            :func:`~demo_lightning.comm.build_node_groups`); ``None``: every rank is a DeMo worker.
    """

    name = "demo"

    def __init__(
        self, optimizer: Optimizer, config: Optional[DeMoConfig] = None, communicator: Optional[Communicator] = None,
        node_groups: Optional[NodeGroups] = None,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"DeMoExchange needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if config is not None and not isinstance(config, DeMoConfig):
            raise TypeError(f"config must be a DeMoConfig, got {type(config).__name__}")
        if node_groups is not None and not isinstance(node_groups, NodeGroups):
            raise TypeError(f"node_groups must be NodeGroups (demo_lightning.comm.build_node_groups) or None, got {type(node_groups).__name__}")
        self.optimizer = optimizer
        self.comm = communicator if communicator is not None else Communicator()
        self.node_groups = node_groups
        self.group = node_groups.inter if node_groups is not None else None
        """The group the compressed exchange runs over (``None``: the communicator's own)."""
        config = config if config is not None else DeMoConfig()
        workers = max(1, self.comm.world_size_of(self.group))
        self.early_codec: Optional[CodecConfig] = config.early_codec_for(workers)
        """The early phase's codec for this exchange's workers (``None`` without one):
        :meth:`DeMoConfig.early_codec_for`."""
        self.config = replace(config, codec=config.codec.for_workers(workers), early_steps=config.early_exchanges_for(workers))
        """The given settings, with the default k resolved for this exchange's number of workers
        (:meth:`CodecConfig.for_workers`): the codec after the early phase (:attr:`codec` is the one in
        force), and ``early_steps`` resolved to :meth:`DeMoConfig.early_exchanges_for` (resolving the k
        makes it explicit, which alone would end a default early phase); the phase's codec is
        :attr:`early_codec`."""
        self.stats = ExchangeStats()
        self.transport = transport_for(self.config.codec, self.comm, self.group, names=DEMO)
        self._owners_key: Optional[tuple] = None
        self._owners: list[int] = []
        self._exchanges_done = 0  # exchanges run so far (the same on every rank): picks selection="shared"'s leader
        self._momentum = SpectralMomentum()
        self._previous: dict[Tensor, Tensor] = {}  # compensation > 0: each exchanged tensor's last gradient
        self._averages: dict[Tensor, Tensor] = {}  # gradient_ema > 0: each exchanged tensor's moving average of gradients
        self._settings: dict[Tensor, TensorSettings] = {}
        self._roles: dict[Tensor, str] = {}  # position groups: each named parameter's block_role
        self._want_energy = False
        self._want_curve = False
        self._digest_key: Optional[tuple] = None
        self._digest = 0
        self._plan_key: Optional[tuple] = None  # what the momentum's current plan was built for
        self._workspace: Optional[Workspace] = None
        # momenta of layout version 1 in optimizer.state: taken now, and whenever the optimizer loads a state dict
        self._migrate_optimizer_state()
        self._hooks = [optimizer.register_load_state_dict_post_hook(lambda _: self._migrate_optimizer_state())]

    # ------------------------------------------------------------------ settings
    @property
    def codec(self) -> CodecConfig:
        """The codec settings in force at the next exchange: during the early phase
        :attr:`early_codec`; afterwards ``config.codec``. The same on every rank: the phase
        follows the count of exchanges run, which every rank advances together and checkpoints keep."""
        early = self.early_codec
        return early if early is not None and self._exchanges_done < int(self.config.early_steps or 0) else self.config.codec

    @property
    def in_early_phase(self) -> bool:
        """Whether the next exchange belongs to the early phase (``DeMoConfig.early_steps``), keeping
        :attr:`early_codec`'s k."""
        return self.codec is not self.config.codec

    def parameters(self) -> list[Tensor]:
        """Trainable parameters in exchange order (the optimizer's ``param_groups`` order)."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def _all_parameters(self) -> list[Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def set_tensor_settings(self, param: Tensor, settings: Optional[TensorSettings]) -> None:
        """Give ``param`` its own settings from the next step on (``None`` returns it to the config's)."""
        if settings is None:
            self._settings.pop(param, None)
        elif not isinstance(settings, TensorSettings):
            raise TypeError(f"settings must be a TensorSettings or None, got {type(settings).__name__}")
        else:
            self._settings[param] = settings

    def set_parameter_names(self, names: Mapping[Tensor, str]) -> None:
        """Name the parameters (``{parameter: qualified name}``, e.g. from ``module.named_parameters()``),
        so position groups (``position_group_size > 1``) join only the tensors of one role across
        blocks (:func:`~demo_lightning.algorithms.stages.block_role`: ``blocks.3.mlp.fc.weight`` with
        ``blocks.4.mlp.fc.weight``) and not, say, a position embedding with an attention projection
        of the same shape. Unnamed parameters group by shape alone. Every rank must give the same
        names (they are part of :meth:`plan_digest`); the strategies pass the module's."""
        self._roles = {p: block_role(str(n)) for p, n in names.items()}

    def tensor_settings(self, param: Tensor) -> TensorSettings:
        """The settings ``param`` departs from the config with (all ``None`` when it does not)."""
        return self._settings.get(param, _INHERIT)

    def decay_of(self, param: Tensor) -> float:
        """Momentum decay applied to ``param``."""
        own = self._settings.get(param)
        return float(own.decay) if own is not None and own.decay is not None else float(self.config.decay)

    def payload_bytes(self, param: Tensor, settings: Optional[TensorSettings] = None, *, steady: bool = False) -> int:
        """Bytes this worker puts on the wire for ``param`` at the next exchange (``steady``: once
        the early phase is over), under ``settings`` (default: its current ones), as if it sent its
        own positions: with position groups an upper bound (a group's later members send values
        only; the ledger counts the bytes sent)."""
        own = settings if settings is not None else self.tensor_settings(param)
        return self._codec(steady).payload_bytes(tuple(param.shape), own.codec)

    def tile_numel(self, param: Tensor, settings: Optional[TensorSettings] = None) -> int:
        """Elements per tile of ``param`` under ``settings`` (0 when it is sent densely)."""
        own = settings if settings is not None else self.tensor_settings(param)
        layout, _ = self.config.codec.layout(tuple(param.shape), own.codec)
        return layout.tile_numel if layout is not None else 0

    def k_of(self, param: Tensor, settings: Optional[TensorSettings] = None, *, steady: bool = False) -> int:
        """Coefficients kept per tile of ``param`` at the next exchange (``steady``: once the early
        phase is over) under ``settings`` (0 when it is sent densely)."""
        own = settings if settings is not None else self.tensor_settings(param)
        return self._codec(steady).layout(tuple(param.shape), own.codec)[1]

    def _codec(self, steady: bool) -> CodecConfig:
        return self.config.codec if steady else self.codec

    def request_energy(self) -> None:
        """Make the next :meth:`step` measure every tensor's energy (``stats.energy``: two
        reductions per family and one host read; nothing is measured otherwise)."""
        self._want_energy = True

    def request_energy_curve(self) -> None:
        """Make the next :meth:`step` also compute every tensor's energy curve (a sort per tile)."""
        self._want_energy = self._want_curve = True

    # ------------------------------------------------------------------ state
    def momentum(self, param: Tensor) -> Tensor:
        """The local momentum (residual) of ``param``, parameter-shaped: a new tensor (zeros before
        its first exchange). Read-only access for monitors and tests; the state itself lives in
        coefficient space (:mod:`~demo_lightning.algorithms.momentum`)."""
        return self._momentum.dense(param)

    def has_momentum(self, param: Tensor) -> bool:
        """Whether ``param`` has a momentum on this worker (it took part in an exchange, or one was loaded)."""
        return self._momentum.has(param)

    def averaged_state(self) -> dict[Tensor, Tensor]:
        """The stored momentum of every exchanged parameter (spectra for compressed tensors), for
        DES-LOC to average in place under the state key :data:`DEMO_STATE_KEY`. A mean of spectra
        is the spectrum of the mean (the transform is linear); the layout is the same on every rank
        because the plan is. Empty before the first step and between a :meth:`load_state_dict` and the
        next step (the loaded momenta are laid out by that step)."""
        if self._momentum.plan is None:
            return {}
        return dict(zip(self._momentum.params, self._momentum.views()))

    def _compensated(self, p: Tensor) -> Optional[Tensor]:
        """``g + lambda (g - g_prev)`` for the momentum (``g`` alone without a previous gradient), and
        ``g`` kept as the next step's ``g_prev`` (see ``DeMoConfig.compensation``)."""
        g = p.grad
        if g is None:
            return None
        current = g.detach().to(compute_dtype(g.dtype))
        previous = self._previous.get(p)
        if previous is None or previous.shape != current.shape:
            self._previous[p] = current.clone()
            return g
        out = torch.add(current, current - previous, alpha=self.config.compensation)
        previous.copy_(current)
        return out

    def _smoothed(self, p: Tensor, g: Optional[Tensor]) -> Optional[Tensor]:
        """``e <- beta_g e + (1 - beta_g) g`` for the momentum (see ``DeMoConfig.gradient_ema``), the
        average kept for the next step; ``None`` (no gradient) leaves it as it is."""
        if g is None:
            return None
        current = g.detach().to(compute_dtype(g.dtype))
        average = self._averages.get(p)
        if average is None or average.shape != current.shape:
            average = self._averages[p] = torch.zeros_like(current)
        return average.lerp_(current, 1.0 - self.config.gradient_ema)

    def _fed_gradients(self, params: list[Tensor]) -> list[Optional[Tensor]]:
        """What each tensor's momentum takes this step: its gradient, compensated and smoothed when
        configured (``DeMoConfig.compensation``, ``DeMoConfig.gradient_ema``)."""
        grads = [self._compensated(p) for p in params] if self.config.compensation > 0 else [p.grad for p in params]
        if self.config.gradient_ema > 0:
            grads = [self._smoothed(p, g) for p, g in zip(params, grads)]
        return grads

    def state_dict(self) -> dict[str, Any]:
        """This worker's exchange state: ``{"momentum": {"version": 2, "momenta": {index: ...}},
        "exchanges": n}`` by parameter index (the optimizer ``state_dict`` numbering), copied;
        ``exchanges`` counts the exchanges run (it picks ``selection="shared"``'s leader); with
        ``compensation`` also ``"previous_gradients": {index: tensor}``, with ``gradient_ema``
        ``"gradient_averages": {index: tensor}``."""
        index_of = {p: i for i, p in enumerate(self._all_parameters())}
        state: dict[str, Any] = {"momentum": self._momentum.state_dict(index_of), "exchanges": self._exchanges_done}
        if self._previous:
            state["previous_gradients"] = {index_of[p]: g.clone() for p, g in self._previous.items() if p in index_of}
        if self._averages:
            state["gradient_averages"] = {index_of[p]: e.clone() for p, e in self._averages.items() if p in index_of}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install state saved by :meth:`state_dict` (same model: shapes are checked). Also takes the
        parameter-shaped momenta of layout version 1 (``{index: tensor}``, what checkpoints kept
        before the momentum moved into the exchange). They take their place at the next step, re-tiled
        if the per-tensor settings changed since."""
        params = self._all_parameters()
        if "momentum" in state:
            self._momentum.load_state_dict(state["momentum"], params)
            self._exchanges_done = int(state.get("exchanges", 0))
            self._previous = _per_parameter(state.get("previous_gradients"), params, "previous gradient")
            self._averages = _per_parameter(state.get("gradient_averages"), params, "gradient average")
        else:
            self._momentum.load_dense(state, params)  # type: ignore[arg-type]
        self._plan_key = None  # adopt the loaded momenta at the next step

    def clear_state(self) -> None:
        """Drop every local momentum (they restart from zero), the compensation's previous gradients
        and the gradient averages."""
        self._momentum.clear()
        self._previous = {}
        self._averages = {}

    def follow_parameters(self) -> None:
        """Move this worker's state to its parameters' current devices and drop the step's workspace.

        For after the parameters moved: Lightning moves the model and the optimizer's state to the
        CPU when a fit ends, to free the accelerator, and the strategies then call this so that the
        momenta (a model's worth of coefficients) and the transforms' scratch buffers do not keep
        its memory either. The momenta keep their values bitwise and take their place at the next
        step, laid out again as after :meth:`load_state_dict`. No collective runs; every rank's
        state moves alike. Without it the next step moves them as well (the plan follows the
        parameters' devices), but the accelerator's memory stays held until then.
        """
        self.load_state_dict(self.state_dict())  # to each parameter's device; the old storage is released
        self._workspace = None

    def _migrate_optimizer_state(self) -> None:
        """Momenta of layout version 1 found in ``optimizer.state`` (an optimizer ``state_dict``
        saved before the momentum moved into the exchange, loaded into the optimizer) move here."""
        found = {}
        for index, p in enumerate(self._all_parameters()):
            state = self.optimizer.state.get(p)
            if state and DEMO_STATE_KEY in state:
                found[index] = state.pop(DEMO_STATE_KEY)
        if found:
            self._momentum.load_dense(found, self._all_parameters(), merge=True)
            self._plan_key = None

    def remove(self) -> None:
        """Detach from the optimizer (its ``load_state_dict`` hook); the momenta stay with the exchange."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # ------------------------------------------------------------------ plan agreement
    def plan_digest(self) -> int:
        """A 64-bit digest of what decides this rank's collectives and what receivers decode: the codec's
        settings (chunk, k, selection, value format, transform, ...), the trainable tensors (order,
        shapes, dtypes) and their per-tensor codec settings. Local (no communication); recomputed only
        when they change. Equal on every rank is what :meth:`check_plan` checks."""
        params = self.parameters()
        codec = self.codec
        key = (codec, tuple((tuple(p.shape), p.dtype, self._settings[p].codec if p in self._settings else None, self._role(p)) for p in params))
        if key != self._digest_key:
            text = repr([repr(codec)] + [(shape, str(dtype), repr(own), role) for shape, dtype, own, role in key[1]]).encode()
            self._digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)
            self._digest_key = key
        return self._digest

    def check_plan(self) -> None:
        """Raise ``RuntimeError`` on every rank unless every rank's :meth:`plan_digest` is the same.

        A collective (a 16-byte all-gather, counted in the ledger's totals under ``demo/plan``, not
        in the step's traffic): every rank must call it at the same point. :meth:`step` runs it at
        every step unless the caller agreed on the digests already (the strategies carry the digest
        in their per-step non-finite guard, so they pay no extra collective).
        """
        self.comm.check_same(
            [len(self.parameters()), self.plan_digest()], "demo/plan",
            "the list of tensors to exchange (count, shapes, dtypes), their per-tensor codec settings (topk, keep_ratio, "
            "chunk, dense: set the same TensorSettings on every rank at the same step) or the codec's settings (give every "
            "rank the same strategy arguments: chunk, topk / keep_ratio, selection, value_format, transform, ...)",
        )

    def _prepare(self, params: list[Tensor]) -> tuple[ExchangePlan, Workspace]:
        """The plan for the current tensors and settings; on a change the momenta are re-laid out
        (re-tiled where the tiling changed) identically on every rank (the plan is agreed)."""
        overrides = [self._settings[p].codec if p in self._settings else None for p in params]
        roles = [self._role(p) for p in params]
        codec = self.codec
        key = (codec, tuple((id(p), tuple(p.shape), p.dtype, p.device, o, r) for p, o, r in zip(params, overrides, roles)))
        plan = self._momentum.plan
        if plan is None or key != self._plan_key:
            plan = build_plan(codec, params, overrides, roles)
            self._plan_key = key
            self._workspace = Workspace(plan)
            self._momentum.adopt(plan, params)
        assert self._workspace is not None
        return plan, self._workspace

    def _role(self, param: Tensor) -> Optional[str]:
        """What position groups match besides the shape (``None`` without groups or a name)."""
        return self._roles.get(param) if self.config.codec.position_group_size > 1 else None

    # ------------------------------------------------------------------ node hierarchy
    def owners(self, params: Optional[list[Tensor]] = None) -> list[int]:
        """The local rank that exchanges each trainable tensor (all ``0`` without a node hierarchy).

        Greedy by payload (:func:`~demo_lightning.comm.topology.split_by_payload`): shapes and settings
        decide it, so every rank computes the same split. The payloads are those after the early
        phase, so the split (and with it where each momentum lives) does not change when it ends."""
        params = self.parameters() if params is None else params
        key = tuple((tuple(p.shape), self._settings[p].codec if p in self._settings else None) for p in params)
        if key != self._owners_key:
            ranks = self.node_groups.ranks_per_node if self.node_groups is not None else 1
            self._owners_key, self._owners = key, split_by_payload([self.payload_bytes(p, steady=True) for p in params], ranks)
        return self._owners

    def _node_mean_gradients(self, params: list[Tensor]) -> None:
        """``p.grad <-`` the mean of the node's gradients (``None``: zeros), one all-reduce per dtype."""
        groups = self.node_groups
        assert groups is not None
        by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for p in params:
            if p.grad is None or not p.grad.is_contiguous() or p.grad.shape != p.shape:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format) if p.grad is None else p.grad.contiguous().view_as(p)
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        pending = []
        for members in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in members])  # type: ignore[union-attr]
            pending.append((members, flat, self.comm.all_reduce_sum_(flat, "demo/node_reduce", group=groups.intra)))
        for members, flat, work in pending:
            work.wait()
            flat.div_(groups.ranks_per_node)
            for p, part in zip(members, torch.split(flat, [p.numel() for p in members])):
                p.grad.copy_(part.view_as(p))  # type: ignore[union-attr]

    def _share_updates(self, params: list[Tensor], owners: list[int]) -> None:
        """Every local rank's updates (``p.grad`` of its share) broadcast to its node."""
        groups = self.node_groups
        assert groups is not None
        for owner in range(groups.ranks_per_node):
            grads = [p.grad for p, o in zip(params, owners) if o == owner]
            if grads:
                self.comm.broadcast_tensors_(grads, "demo/node_share", src=owner, group=groups.intra)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, plan_agreed: bool = False) -> ExchangeStats:
        """Run one exchange: update momenta, share their fast components, write ``p.grad``.

        Args:
            plan_agreed: the caller already established, at this step and on every rank, that every
                rank's :meth:`plan_digest` is equal; otherwise :meth:`check_plan` runs first, so a
                rank whose tensors or settings changed alone makes every rank raise the same
                ``RuntimeError`` instead of running mismatched collectives.
        """
        with stage_range(DEMO_EXCHANGE):
            start = time.perf_counter()
            if not plan_agreed:
                self.check_plan()
            every = self.parameters()
            ledger = self.comm.ledger
            comm_before = self.comm.seconds
            hierarchy = self.node_groups
            ledger.begin_step()
            try:
                params = every
                if hierarchy is not None:
                    with stage_range(DEMO_NODE):
                        self._node_mean_gradients(every)
                if self.config.clip_grad_norm is not None:
                    with stage_range(DEMO_CLIP):
                        clip_gradients(every, self.config.clip_grad_norm)
                if hierarchy is not None:
                    owners = self.owners(every)
                    params = [p for p, o in zip(every, owners) if o == hierarchy.local_rank]
                self._exchange(params)
                if hierarchy is not None:
                    with stage_range(DEMO_NODE):
                        self._share_updates(every, owners)
            finally:
                ddp = ddp_bytes_for(every, self.comm.world_size)
                traffic = ledger.end_step(ddp, self.comm.topology.ddp_inter_node_bytes(ddp))
            seconds = time.perf_counter() - start
        comm_seconds = self.comm.seconds - comm_before
        st = self.stats
        st.traffic, st.seconds, st.comm_seconds = traffic, seconds, comm_seconds
        st.n_trainable = sum(p.numel() for p in every)
        st.steps += 1
        st.total_seconds += seconds
        st.total_comm_seconds += comm_seconds
        return st

    def _exchange(self, params: list[Tensor]) -> None:
        """Encode, transport and decode ``params`` (this rank's share) over :attr:`group`."""
        plan, workspace = self._prepare(params)
        want_energy, want_curve = self._want_energy, self._want_curve
        self._want_energy = self._want_curve = False
        world = self.comm.world_size_of(self.group)
        codec = plan.config
        momentum = self._momentum
        decays = [self.decay_of(p) for p in params]
        grads = self._fed_gradients(params)
        with stage_range(DEMO.encode):
            # dense tensors: m <- decay m + g, summed whole by one all-reduce per group (of a copy in the
            # dense wire format; what rounding to it loses stays as the residual, applied after the waits)
            dense_totals = []
            for key, group in plan.dense_groups.items():
                flat = momentum.dense_storage[key]
                for item in group:
                    m = flat[item.span]
                    m.mul_(decays[item.position])
                    if grads[item.position] is not None:
                        m.add_(grads[item.position].reshape(-1).to(m.dtype))
                wire = flat.to(codec.dense_dtype(flat.dtype), copy=True)
                residual = flat - wire.to(flat.dtype) if wire.dtype != flat.dtype else None
                dense_totals.append((group, flat, wire, residual))
            # M <- decay M + DCT(g), then the selection of every family
            with stage_range(DEMO.transform):
                transform_into(plan, grads, momentum.storage, workspace, decays)
            energy = self._energy_before(plan) if want_energy else None
            selected: dict[object, Selected] = {}
            with stage_range(DEMO.select):
                if codec.selection == "shared":
                    selected = self._shared_selection(plan, workspace)
                for key, family in plan.families.items():
                    if codec.selection != "shared":
                        selected[key] = select(family, momentum.storage[key], codec.selection, workspace.family(family), codec.strongest_first)
                    elif want_curve:
                        write_magnitudes(family, momentum.storage[key], workspace.family(family))
                    if want_curve and energy is not None:
                        energy["curves"][key] = self._energy_curve(family, workspace.family(family), momentum.storage[key])
        with stage_range(DEMO.transport):
            # every collective is started before the first is waited on
            dense_work = [self.comm.all_reduce_sum_(wire, "demo/dense", group=self.group) for _, _, wire, _ in dense_totals]
            pending = [
                self.transport.start([Outgoing(run, selected[run.family.key].positions[run.rows], selected[run.family.key].values[run.rows])
                                      for run in bucket], "demo")
                for bucket in plan.buckets
            ]
            for work in dense_work:
                work.wait()
        with stage_range(DEMO.decode):
            means = zeroed_means(plan, workspace)
        for waiting in pending:
            with stage_range(DEMO.transport):
                contributions = list(waiting.contributions())  # waits, then unpacks every rank's bytes
            with stage_range(DEMO.decode), stage_range(DEMO.scatter_add):
                accumulate(means, contributions, selected)  # rank-order sums into the mean spectra
        keep_sent = self.config.retain_sent
        with stage_range(DEMO.decode):
            # every collective completed: error feedback, then the updates
            for bucket, waiting in zip(plan.buckets, pending):
                for run, sent in zip(bucket, waiting.sent):
                    chosen = selected[run.family.key]
                    residual = torch.sub(chosen.values[run.rows], sent, alpha=1.0 - keep_sent)
                    momentum.storage[run.family.key].index_copy_(0, chosen.offsets[run.rows].reshape(-1), residual.reshape(-1))
            for group, flat, wire, residual in dense_totals:
                total = wire.to(flat.dtype).div_(world)
                for item in group:
                    self._write_update(params[item.position], total[item.span].view(item.shape))
                if residual is None and keep_sent == 0:
                    flat.zero_()  # everything was sent (zero_, not mul_(0): no -0.0 that differs between ranks)
                elif residual is None:
                    flat.mul_(keep_sent)  # retain_sent keeps rho of what was sent
                elif keep_sent == 0:
                    flat.copy_(residual)  # what the wire format rounded away
                else:
                    flat.lerp_(residual, 1.0 - keep_sent)  # residual + retain_sent * (what was sent)
            with stage_range(DEMO.inverse):
                inverse(plan, means, workspace, 1.0 / world, lambda item, q: self._write_update(params[item.position], q))
        energies = self._energy_after(plan, energy, selected) if energy is not None else []
        self._exchanges_done += 1
        st = self.stats
        st.coefficients = plan.coefficients
        st.tiled_elements = sum(f.numel for f in plan.families.values())
        st.energy = energies
        st.exchanged = list(params)

    def _shared_selection(self, plan: ExchangePlan, workspace: Workspace) -> dict[object, Selected]:
        """``selection="shared"``: this exchange's leader picks its top-k positions, broadcasts them
        (:mod:`~demo_lightning.algorithms.stages.positions`), every rank takes its values there."""
        storage = self._momentum.storage
        leader = self._exchanges_done % self.comm.world_size_of(self.group)
        chosen = None
        if self.comm.rank_in(self.group) == leader:
            chosen = {key: torch.topk(write_magnitudes(f, storage[key], workspace.family(f)), f.k, dim=1, sorted=False).indices
                      for key, f in plan.families.items()}
        with stage_range(DEMO.transport):
            positions = broadcast_positions(plan, chosen, self.comm, leader, "demo/positions", self.group)
        return {key: select_at(f, storage[key], positions[key]) for key, f in plan.families.items()}

    # ------------------------------------------------------------------ step participant
    def before_update(self, step: StepContext) -> None:
        """Participant hook: the exchange (its plan check skipped when the guard agreed on it)."""
        self.step(plan_agreed=step.plan_agreed)

    def after_update(self, step: StepContext) -> None:
        return None

    def _write_update(self, p: Tensor, q: Tensor) -> None:
        """``p.grad <- sign(q)`` or ``q`` (``q``: the mean, ``R x C`` or parameter-shaped)."""
        grad = p.grad
        if grad is None or not grad.is_contiguous() or grad.shape != p.shape:
            grad = p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
        target = grad.view(q.shape)
        if self.config.update == "sign":
            torch.sign(q, out=target) if target.dtype == q.dtype else target.copy_(torch.sign(q))
        elif self.config.update == "normalized":
            wide = q.to(torch.promote_types(q.dtype, torch.float32))
            rms = wide.pow(2).mean().sqrt().clamp_min(torch.finfo(wide.dtype).tiny)
            target.copy_(wide / rms)
        else:
            target.copy_(q)

    # ------------------------------------------------------------------ energy (on request only)
    def _energy_before(self, plan: ExchangePlan) -> dict[str, Any]:
        totals = {}
        for key, family in plan.families.items():
            flat = self._momentum.storage[key]
            totals[key] = torch.stack([flat[m.span].double().pow(2).sum() for m in family.members])
        dense = {}
        for key, group in plan.dense_groups.items():
            flat = self._momentum.dense_storage[key]
            dense[key] = torch.stack([flat[i.span].double().pow(2).sum() for i in group])
        return {"totals": totals, "dense": dense, "curves": {}}

    def _energy_curve(self, family: Any, magnitudes: Tensor, storage: Tensor) -> Tensor:
        """Per tile, the energy of its best 1, 2, ... coefficients under the selection rule (rows
        of ``(n_tiles, tile_numel)``, float64), from the magnitudes the selection just wrote."""
        n, numel = family.n_tiles, family.tile_numel
        if self.config.codec.selection != "lowpass":  # top-k and shared: the worker's own best k
            squared = magnitudes[: n * numel].view(n, numel).double().pow(2)
            ordered = squared.sort(dim=1, descending=True).values
        else:
            squared = torch.cat([_tile_rows(storage, m) for m in family.members]).double().pow(2)
            ordered = squared[:, lowpass_order(*family.tile_shape, squared.device)]
        return ordered.cumsum(1)

    def _energy_after(self, plan: ExchangePlan, energy: dict[str, Any], selected: dict[object, Selected]) -> list[TensorEnergy]:
        out: list[Optional[TensorEnergy]] = [None] * len(plan.tensors)
        for key, family in plan.families.items():
            values = selected[key].values.double().pow(2).sum(1)
            lengths = torch.tensor([m.n_tiles for m in family.members], device=values.device)
            captured = torch.segment_reduce(values, "sum", lengths=lengths).tolist()
            totals = energy["totals"][key].tolist()
            curve = energy["curves"].get(key)
            for m, total, kept in zip(family.members, totals, captured):
                c = None
                if curve is not None:
                    c = curve[m.rows].sum(0) / total if total > 0 else torch.ones(curve.shape[1], dtype=torch.float64)
                out[m.position] = TensorEnergy(total, kept, m.k, family.tile_numel, m.n_tiles, c)
        for key, group in plan.dense_groups.items():
            for item, total in zip(group, energy["dense"][key].tolist()):
                out[item.position] = TensorEnergy(total, total, 0, 0, 0)
        return [e for e in out if e is not None]


def _tile_rows(storage: Tensor, item: TensorPlan) -> Tensor:
    """``item``'s tiles of ``storage`` as ``(n_tiles, tile_numel)`` rows (a copy)."""
    assert item.layout is not None
    return tile_view(storage[item.span].view(item.matrix_shape), item.layout).reshape(item.n_tiles, -1)


_INHERIT = TensorSettings()


def warn_if_stateful(optimizer: Optimizer) -> Optional[str]:
    """A message if ``optimizer`` keeps its own momentum (``update="sign"`` expects plain SGD)."""
    for group in optimizer.param_groups:
        if group.get("momentum", 0) or "betas" in group or group.get("lam", 0):
            return (
                f"update='sign' is DeMo's rule for plain SGD, but {type(optimizer).__name__} keeps its own momentum "
                "or moments on top of the sign; use torch.optim.SGD(momentum=0), or update='raw' for this optimizer"
            )
    return None


def _per_parameter(saved: Optional[Mapping[Any, Tensor]], params: list[Tensor], what: str) -> dict[Tensor, Tensor]:
    """Saved per-parameter tensors (``{index: tensor}``, :meth:`DeMoExchange.state_dict`) keyed by
    their parameters, in each one's compute dtype and device; a shape that does not match raises
    ``ValueError`` (a checkpoint from a different model)."""
    out: dict[Tensor, Tensor] = {}
    for index, value in dict(saved or {}).items():
        p = params[int(index)]
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"saved {what} for parameter {index} has shape {tuple(value.shape)} for a "
                             f"parameter of shape {tuple(p.shape)}: the checkpoint comes from a different model")
        out[p] = value.detach().to(dtype=compute_dtype(p.dtype), device=p.device).clone()
    return out
