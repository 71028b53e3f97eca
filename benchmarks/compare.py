"""Every method side by side, in one invocation: bytes, loss, step time, memory and modeled time over real links.

    .venv/bin/python benchmarks/compare.py                    # 10 methods x 2 and 4 workers, 520 steps (~80 min on 2 cores)
    .venv/bin/python benchmarks/compare.py --world-sizes 2 --methods ddp,demo-sign1bit --steps 100
    .venv/bin/python benchmarks/compare.py --render-only --update-readme   # re-render table, plots and README from the JSON

The job is the main example's task (a byte-level GPT on the Python standard library's sources;
``--corpus prose|cpp|PATH`` trains on another named corpus or your own text, ``--corpus digits`` runs the vision
task instead (scikit-learn's bundled digits at 32x32 with a timm ResNet-10t narrowed to channels
(32, 64, 128, 256), 1.27 M parameters, random init; ``--batch-size`` images per worker; validation
accuracy is recorded beside the loss), ``--lr`` sets every method's rate,
``--option KEY=VALUE`` one strategy setting over every non-DDP method's own, ``--schedule-steps N`` a longer
learning-rate schedule of which the run takes the first ``--steps``),
scaled so 4 processes share 2 CPU cores: ``--d-model 128 --n-layer 2`` (443,648 parameters),
16 windows of 128 bytes per worker per step. Every method trains on the same data, from the same
seed, for the same number of optimizer steps, at each world size in turn (runs are sequential, so
they do not compete for the cores):

* ``ddp``: Lightning's ``DDPStrategy`` (fp32 gradient all-reduce every step), AdamW
* ``demo``: DeMo, top-k 64 of every 64x64 DCT tile, fp32 values on the wire, sign update, SGD
* ``demo-lowpass``: DeMo, the 64 lowest frequencies of every tile, bf16 values, all-reduced (no positions)
* ``demo-int8``: DeMo, top-k 64, int8 values (one fp32 scale per tile)
* ``demo-sign1bit``: DeMo, top-k 64, 1-bit signs (one fp32 scale per tile): ``Trainer(strategy="demo")``
* ``desloc``: DES-LOC, AdamW: parameters every 256 steps, ``exp_avg`` every 768, ``exp_avg_sq`` every 1536
* ``local-adam``: Local Adam: parameters and both moments every 512 steps (DES-LOC's long-run bytes)
* ``demo+desloc``: ``demo-sign1bit`` plus DES-LOC averaging: parameters every 256 steps, residual every 512
* ``desloc-compressed``: DES-LOC with parameter syncs through the DeMo codec every 16 steps (top-k 64,
  1-bit signs), moments every 768 / 1536 steps, AdamW
* ``desloc-compressed-local-top128``: the same syncs keeping 128 per tile; Adam's moments stay local
  (never averaged, as DiLoCo's inner optimizer), so the run's bytes are the long-run bytes

Ablations, run only when named in ``--methods``: ``desloc-compressed-int8`` (int8 values in the
compressed parameter syncs), ``desloc-compressed-k64`` (syncs every 64 steps keeping 256 per tile),
``desloc-k16`` (dense syncs every 16 steps, moments every 48 / 96: what the period alone costs),
``desloc-k1`` (parameters and both moments averaged after every local step: local AdamW with no period),
``desloc-compressed-local`` and ``-local-k8`` (moments never averaged; every 8 steps keeping 32),
``desloc-1bit-k32`` / ``-k64`` / ``-k128`` (every coefficient of the change at one bit, no positions),
``desloc-adaptive`` (``desloc-k16``'s periods adapted by ``AdaptiveSyncPeriods`` to the replicas' divergence)
against ``desloc-fixed-equal`` / ``-equal-ratio`` (fixed periods at its bytes: 16 / 32 / 128, and 1 : 3 : 6 at K_x 15),
``ddp-signum-b0.9`` / ``-b0.99`` / ``-b0`` (DDP's exact mean gradient with ``Signum``: DeMo's sign rule without
the codec, at DeMo's rate; beta 0 is signSGD, DeMo's limit when every coefficient is sent exactly), ``demo-adamw`` (``strategy="demo"``'s defaults with ``update="raw"``: the decoded mean is AdamW's gradient
instead of ``SGD``'s sign; same bytes as ``demo-default``) and ``demo-adamw-b0`` (the same with AdamW's first beta at 0:
RMSprop on the decoded mean, whose residual is its momentum already), ``demo-signum-b0.9`` (the same with ``Signum``, beta 0.9:
a momentum over the decoded mean before the sign), ``demo-sign-signum-b0.9`` (the default's per-step sign, then ``Signum``'s
momentum over those signs), ``demo-haar`` / ``demo-identity`` (``demo`` with ``transform="haar"``: Haar wavelet tiles, or
``transform="identity"``: no transform, chunked top-k of the momentum itself; same bytes as ``demo``),
``demo-shared-k39`` / ``-k78`` / ``-k157`` (``selection="shared"``, bf16 values, at ``demo-sign1bit``'s
bytes per worker at 2 / 4 / 8 workers) and ``demo-shared-k48`` (the largest top-k with 100x fewer
inter-node bytes than DDP at every world size, by ``benchmarks/scale.py``'s model).

What is measured, per method and world size (every rank writes its own record; the parent merges):

* ``final_val_loss``: mean validation loss (nats per byte) over the whole validation split after the
  last step, averaged over the workers (under DES-LOC the replicas differ between syncs);
  ``val_curve``: the same every ``--val-every`` steps.
* ``bytes_sent_per_step`` / ``bytes_received_per_step``: from the strategy's byte ledger (ring
  models of every collective this worker joined inside optimizer steps), mean over steps; for
  ``ddp`` the ring all-reduce of every fp32 gradient, ``2 (W - 1) / W * 4 N``. ``ratio_vs_ddp`` is
  DDP's bytes over ours for the same steps; ``steady_ratio_vs_ddp`` the long-run figure of a
  periodic schedule (``1 / sum 1/K``), where the run is shorter than its longest period.
* ``step_time_s``: median wall time of a training batch (forward, backward, exchange, update) on
  rank 0, first ``--warmup`` steps dropped; ``exchange_share``: the time inside the library's
  outermost stage ranges (:mod:`demo_lightning.profiling`, read with a ``StageTimes`` sink:
  ``guard/nonfinite``, ``demo/exchange``, ``desloc/clip``, ``desloc/sync``: codec and collectives)
  over the step time, summed over the run. Until the ranges existed it was the time inside the
  wrapped ``DeMoExchange.step`` and ``DesLocAverager.before_step`` / ``after_step`` calls plus the
  guard's collective; the ranges also count the guard's local finiteness check (a reduction over
  the gradients) and leave out DES-LOC's one-off agreement on its state keys at the first step.
  ``stage_s_per_step``: rank 0's exclusive time per range, per step, over the run. A library without
  the ranges (``benchmarks/exchange_share.py --against`` an older revision) is still timed the old
  way; ``exchange_timing`` says which (``"stage ranges"`` or ``"wrapped calls"``).
* ``peak_rss_mb``: peak resident memory of the largest worker (``getrusage`` ``ru_maxrss``).
* ``compute_s``: step time minus the time this worker spent in collectives (loopback gloo); for
  ``ddp``, whose all-reduce overlaps the backward pass, minus the time of an all-reduce of all
  gradients measured after training (this can only under-state DDP's compute, which favours DDP).
* ``modeled``: for each bandwidth ``B`` in ``--bandwidths`` (Gbit/s), seconds per step
  ``compute_s + sum over collectives (hops x latency + sent bytes x 8 / B)`` averaged over the
  run (periodic syncs amortised), and the modeled wall time to reach DDP's final validation loss:
  the first validation point at or below it, times that. ``None`` when a method never gets there.

Writes ``<out>/latest.json`` (``{"meta": ..., "records": [...]}``), ``<out>/latest.md`` and the
plots ``compare_loss_vs_step.png``, ``compare_loss_vs_bytes.png`` and ``compare_modeled_time.png``
(modeled step time per bandwidth); ``--update-readme`` replaces the README's ``compare`` section with the rendered table.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from readme_section import markers, replace_section

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README_START, README_END = markers("compare")


@dataclass(frozen=True)
class Method:
    """One row of the comparison: a strategy's arguments and the optimizer it runs with."""

    description: str
    kind: str  # "ddp", "demo" or "desloc"
    optimizer: str
    lr: float
    options: dict[str, Any] = field(default_factory=dict)
    keep_ratio: Any = None  # AdaptiveKeepRatio(keep_ratio=...) on the Trainer: "default" (its ramp), a number, a Schedule's
    # fields (a dict); None: no callback
    sync_periods: Any = None  # AdaptiveSyncPeriods(**sync_periods) on the Trainer (a dict of its arguments); None: no callback
    momentum: Optional[float] = None  # the model's ``momentum``: SGD's momentum or Signum's beta (None: the optimizer's default)


ADAMW_LR, DEMO_LR = 1e-3, 1e-3
METHODS: dict[str, Method] = {
    "ddp": Method("Lightning DDP, AdamW", "ddp", "adamw", ADAMW_LR),
    "demo": Method("DeMo top-k 64/4096, fp32 values, SGD", "demo", "sgd", DEMO_LR, {"value_format": "fp32"}),
    "demo-lowpass": Method(
        "DeMo low-pass 64/4096, bf16 values, all-reduce, SGD", "demo", "sgd", DEMO_LR,
        {"selection": "lowpass", "value_format": "bf16"},
    ),
    "demo-int8": Method("DeMo top-k 64/4096, int8 values, SGD", "demo", "sgd", DEMO_LR, {"value_format": "int8"}),
    "demo-sign1bit": Method(
        "DeMo top-k by workers (64 at 2), 1-bit signs, norms in fp32, SGD (the default before issue 18)", "demo", "sgd", DEMO_LR,
        {"value_format": "sign"},
    ),
    "desloc": Method(
        "DES-LOC K_x 256, K_u 768, K_v 1536, AdamW", "desloc", "adamw", ADAMW_LR,
        {"param_sync_every": 256, "state_sync_every": {"exp_avg": 768, "exp_avg_sq": 1536}},
    ),
    "local-adam": Method(
        "Local Adam K 512 (params and both moments), AdamW", "desloc", "adamw", ADAMW_LR,
        {"param_sync_every": 512, "state_sync_every": {"exp_avg": 512, "exp_avg_sq": 512}},
    ),
    "demo+desloc": Method(
        "DeMo 1-bit + DES-LOC params every 256, residual every 512, SGD", "demo", "sgd", DEMO_LR,
        {"value_format": "sign", "param_sync_every": 256, "state_sync_every": {"demo_momentum": 512}},
    ),
    "desloc-compressed": Method(
        "DES-LOC, params through the codec every 16 (top-k 64, 1-bit), K_u 768, K_v 1536, AdamW", "desloc", "adamw",
        ADAMW_LR, {"param_sync_every": 16, "compress_params": True, "state_sync_every": {"exp_avg": 768, "exp_avg_sq": 1536}},
    ),
    "desloc-compressed-local-top128": Method(
        "DES-LOC, params through the codec every 16 (top-k 128, 1-bit), Adam moments never averaged, AdamW", "desloc",
        "adamw", ADAMW_LR, {"param_sync_every": 16, "compress_params": True, "topk": 128, "state_sync_every": {}},
    ),
}
ISSUE_METHODS = tuple(METHODS)  # the default run: the ten methods the README's table compares
# ablations, run on request (``--methods``): what the default table's misses point at
METHODS["desloc-compressed-int8"] = Method(
    "as desloc-compressed, int8 values (one scale per tile) in the parameter syncs", "desloc", "adamw", ADAMW_LR,
    {**METHODS["desloc-compressed"].options, "value_format": "int8"},
)
METHODS["desloc-compressed-k64"] = Method(
    "as desloc-compressed, parameter syncs every 64 steps keeping 256 per tile (about the same codec bytes)", "desloc", "adamw",
    ADAMW_LR, {**METHODS["desloc-compressed"].options, "param_sync_every": 64, "topk": 256},
)
METHODS["desloc-k16"] = Method(
    "DES-LOC K_x 16, K_u 48, K_v 96 (the paper's ratios), dense: what syncing every 16 steps costs without the codec",
    "desloc", "adamw", ADAMW_LR, {"param_sync_every": 16, "state_sync_every": {"exp_avg": 48, "exp_avg_sq": 96}},
)
METHODS["desloc-k1"] = Method(
    "DES-LOC with every period 1: parameters and both Adam moments averaged after every local step (local AdamW, no period)",
    "desloc", "adamw", ADAMW_LR, {"param_sync_every": 1, "state_sync_every": {"exp_avg": 1, "exp_avg_sq": 1}},
)
_LOCAL_MOMENTS = {**METHODS["desloc-compressed"].options, "state_sync_every": {}}  # Adam moments never averaged (as DiLoCo)
METHODS["desloc-compressed-local"] = Method(
    "as desloc-compressed, Adam's moments never averaged", "desloc", "adamw", ADAMW_LR, _LOCAL_MOMENTS,
)
METHODS["desloc-compressed-local-k8"] = Method(
    "compressed parameter syncs every 8 steps keeping 32 per tile, moments never averaged", "desloc", "adamw", ADAMW_LR,
    {**_LOCAL_MOMENTS, "param_sync_every": 8, "topk": 32},
)
for _k in (32, 64, 128):
    METHODS[f"desloc-1bit-k{_k}"] = Method(
        f"DES-LOC, every parameter change sent at 1 bit per DCT coefficient (all kept, one scale per tile, error "
        f"feedback) every {_k} steps, Adam moments never averaged", "desloc", "adamw", ADAMW_LR,
        {"param_sync_every": _k, "compress_params": True, "selection": "lowpass", "keep_ratio": 1.0, "value_format": "sign",
         "state_sync_every": {}},
    )
# the tile transform (issue 16): ``demo`` with Haar wavelets, and with no transform at all (chunked top-k)
METHODS["demo-haar"] = Method(
    "as demo, Haar wavelet tiles (coarse to fine) instead of the DCT", "demo", "sgd", DEMO_LR,
    {**METHODS["demo"].options, "transform": "haar"},
)
METHODS["demo-identity"] = Method(
    "as demo, no transform: top-k 64 of every 64x64 block of the momentum itself (SparseLoCo's chunked top-k)", "demo", "sgd",
    DEMO_LR, {**METHODS["demo"].options, "transform": "identity"},
)
# selection="shared" (ScaleCom's cyclic local top-k, bf16 values all-reduced) at the bytes per worker of
# demo-sign1bit's all-gather at 2, 4 and 8 workers (its bytes grow with W - 1, these do not): k 39, 78, 157
for _k, _w in ((39, 2), (78, 4), (157, 8), (48, 0)):
    METHODS[f"demo-shared-k{_k}"] = Method(
        f"DeMo shared positions (cyclic leader's top-k {_k}/4096, broadcast), bf16 values all-reduced: "
        + (f"demo-sign1bit's bytes at {_w} workers" if _w else "at least 100x fewer inter-node bytes than DDP at every W (planner)")
        + ", SGD", "demo", "sgd", DEMO_LR, {"selection": "shared", "value_format": "bf16", "topk": _k},
    )
# issue 16 item 8, "sync more later" (DeMo-adv): AdaptiveKeepRatio's default cosine ramp of the kept share,
# 1/128 -> 1/32 of each tile (k 32 -> 128), against a constant share with the same mean (k 80: (32 + 128) / 2),
# so the same total coefficients over the run; 1-bit values (the default), whose bytes per tile are linear in k
METHODS["demo-keep-ramp"] = Method(
    "DeMo 1-bit, AdaptiveKeepRatio's default ramp 1/128 -> 1/32 of each tile (cosine), SGD", "demo", "sgd", DEMO_LR,
    {"value_format": "sign"}, keep_ratio="default",
)
METHODS["demo-keep-const"] = Method(
    "DeMo 1-bit, a constant 80/4096 of each tile (the ramp's mean: equal total bytes), SGD", "demo", "sgd", DEMO_LR,
    {"value_format": "sign"}, keep_ratio=80 / 4096,
)


def _keep_early(k: int, steps: int) -> Method:
    """DeMo's default exchange keeping ``k`` of each tile's 4096 coefficients for the first ``steps``, then 64."""
    return Method(
        f"DeMo 1-bit, {k}/4096 of each tile for {steps} steps, then 64/4096 (AdaptiveKeepRatio milestones), SGD", "demo", "sgd",
        DEMO_LR, {"value_format": "sign"}, keep_ratio={"kind": "milestones", "start": k / 4096, "milestones": {steps: 1 / 64}},
    )


# issue 18, the plateau: the 1.8 M GPT on prose sits at ~3.55 nats/byte from step ~40 under every DeMo setting at
# k 64 (decay 0.9 to 0.9995, fp32 values) and leaves it at a step that varies with them; k 256 barely stops there.
# More coefficients early only: k 256 (1/16 of each tile) for the first 40 steps, then the default's 64 (1/64)
METHODS["demo-keep-early"] = _keep_early(256, 40)
# the same, cheaper (issue 18): k 256 or 128 for the first N steps only; at 520 steps an early phase of N steps at
# m times the k costs N (m - 1) / 520 more bytes than the default (the 0.44 M GPT's 106x leaves about 6 %)
for _k, _n in ((256, 10), (256, 20), (128, 20), (128, 40), (128, 80), (96, 80)):
    METHODS[f"demo-keep{_k}-for{_n}"] = _keep_early(_k, _n)
# issue 16 item 9, the seed's local rule (seed 001): DecoupledMomentum (beta 0.9, lam 0.1) under DDP and under
# DES-LOC (parameters every 256, its momentum_buffer every 768), a small learning-rate sweep (it is an SGD-type
# step, so AdamW's 1e-3 does not transfer), against AdamW at the same steps (the ddp and desloc rows)
for _lr in (0.01, 0.03, 0.1, 0.3):
    METHODS[f"ddp-decoupled-lr{_lr:g}"] = Method(f"Lightning DDP, DecoupledMomentum lr {_lr:g}", "ddp", "decoupled", _lr)
    METHODS[f"desloc-decoupled-lr{_lr:g}"] = Method(
        f"DES-LOC K_x 256, momentum_buffer every 768, DecoupledMomentum lr {_lr:g}", "desloc", "decoupled", _lr,
        {"param_sync_every": 256, "state_sync_every": {"momentum_buffer": 768}},
    )
# issue 16 item 5, momentum compensation (seed 000 §5.1, v + lambda (g_t - g_{t-1}), meant for small batches:
# 16 windows of 128 bytes per worker here), on the default 1-bit exchange
for _lam in (0.1, 0.3):
    METHODS[f"demo-compensation{_lam:g}"] = Method(
        f"DeMo 1-bit, momentum compensation lambda {_lam:g}, SGD", "demo", "sgd", DEMO_LR, {"value_format": "sign", "compensation": _lam},
    )
# issue 16 item 7, DES-LOC periods that adapt (seed 002): AdaptiveSyncPeriods from desloc-k16's periods (16 / 48 / 96),
# calibrated at the first syncs after the learning-rate warm-up (20 steps), within [16, 512]; against fixed periods at
# the adaptive run's bytes: its 52 dense syncs in 520 steps (32 + 16 + 4 at 16 / 32 / 128), and the paper's 1 : 3 : 6
# ratios at the closest K_x (15: 34 + 11 + 5 = 50 syncs); figures in benchmarks/results/issue16/adaptive_periods
METHODS["desloc-adaptive"] = Method(
    "DES-LOC AdamW from K_x 16, K_u 48, K_v 96, AdaptiveSyncPeriods (divergence target calibrated after warm-up, "
    "factor 2, band [0.5, 2], periods in [16, 512])", "desloc", "adamw", ADAMW_LR, dict(METHODS["desloc-k16"].options),
    sync_periods={"min_period": 16, "max_period": 512, "start_step": 20},
)
METHODS["desloc-fixed-equal"] = Method(
    "DES-LOC AdamW, fixed K_x 16, K_u 32, K_v 128: desloc-adaptive's 52 syncs in 520 steps", "desloc", "adamw", ADAMW_LR,
    {"param_sync_every": 16, "state_sync_every": {"exp_avg": 32, "exp_avg_sq": 128}},
)
METHODS["desloc-fixed-equal-ratio"] = Method(
    "DES-LOC AdamW, fixed K_x 15, K_u 45, K_v 90 (1 : 3 : 6): 50 syncs in 520 steps, the closest to desloc-adaptive's 52",
    "desloc", "adamw", ADAMW_LR, {"param_sync_every": 15, "state_sync_every": {"exp_avg": 45, "exp_avg_sq": 90}},
)
# issue 16's wire formats: a byte a value (float8, one fp32 scale a tile) and per-frequency mixed precision
# (each tile's strongest quarter in fp16, the rest int8), at the default's k, and fp8 at about the default's bytes
for _name, _fmt, _k, _what in (
    ("demo-fp8", "fp8_e4m3", 64, "fp8 e4m3 values (one scale per tile)"),
    ("demo-fp8-e5m2", "fp8_e5m2", 64, "fp8 e5m2 values (one scale per tile)"),
    ("demo-mixed", "mixed", 64, "mixed values: each tile's strongest quarter in fp16, the rest int8"),
    ("demo-fp8-k40", "fp8_e4m3", 40, "fp8 e4m3 values at about the 1-bit default's bytes per tile (104 vs 108)"),
):
    METHODS[_name] = Method(f"DeMo top-k {_k}/4096, {_what}, SGD", "demo", "sgd", DEMO_LR, {"value_format": _fmt, "topk": _k})

# issue 16 item 4, position groups (seed 000 §7, "layers share base frequencies"): the same projection of the two
# blocks chooses its positions once from the summed energy and sends them once; at the default's k (fewer bytes),
# and at the k that spends about the default's bytes (108: 60 tiles carry positions, 48 send values only)
METHODS["demo-groups2"] = Method(
    "DeMo 1-bit, top-k 64, positions shared by each projection across the 2 blocks, SGD", "demo", "sgd", DEMO_LR,
    {"value_format": "sign", "position_group_size": 2},
)
METHODS["demo-topk38"] = Method(
    "DeMo 1-bit, top-k 38, every tensor its own positions (about demo-groups2's bytes), SGD", "demo", "sgd", DEMO_LR,
    {"value_format": "sign", "topk": 38},
)
METHODS["demo-groups2-k108"] = Method(
    "DeMo 1-bit, top-k 108, positions shared across the 2 blocks (about the default's bytes), SGD", "demo", "sgd", DEMO_LR,
    {"value_format": "sign", "position_group_size": 2, "topk": 108},
)

# issue 18, the default's k against the number of workers: an explicit k at every W (64: the default before the
# rule; 32: W = 4's k under it, so W * k = 128 coefficients of every tile reach every worker per step)
for _k in (32, 64):
    METHODS[f"demo-sign1bit-k{_k}"] = Method(
        f"DeMo top-k {_k}/4096 at every world size, 1-bit signs, SGD", "demo", "sgd", DEMO_LR, {"value_format": "sign", "topk": _k},
    )

# issue 18 changed three of DeMoStrategy's defaults: the first 40 exchanges keep 4 times the default k (the early phase;
# since, 256 a tile for clamp(80 // W, 20, 40) exchanges),
# tensors sent densely go in bf16, and those are the tensors under 1,024 elements (was 4,096) and every 1-D one.
# "demo-default" is strategy="demo"'s defaults at this revision; every other DeMo row keeps the settings it was measured
# with, so its stored results re-run as they were ("demo-sign1bit" is the default before issue 18)
PREVIOUS_DEFAULTS: dict[str, Any] = {"early_steps": 0, "dense_format": "fp32", "dense_below": 4096, "dense_vectors": False}
for _name, _method in list(METHODS.items()):
    if _method.kind == "demo" or _method.options.get("compress_params"):
        _pinned = PREVIOUS_DEFAULTS if _method.kind == "demo" else {k: PREVIOUS_DEFAULTS[k] for k in ("dense_format", "dense_below", "dense_vectors")}
        METHODS[_name] = replace(_method, options={**_pinned, **_method.options})
METHODS["demo-default"] = Method(
    "DeMo, strategy=\"demo\"'s defaults: k by workers (64 at 2, 32 at 4) after an early phase of 256 a tile (40 steps at 2 "
    "workers, 20 at 4), 1-bit signs, 1-D tensors and those under 1,024 elements dense in bf16, each worker's gradient "
    "clipped at norm 1.0, SGD",
    "demo", "sgd", DEMO_LR,
)
# the early phase of the screens below, as they were measured (issue 18): 4x the default k for 40 exchanges (128 a tile at 4
# workers); the default now keeps 256 a tile for clamp(80 // W, 20, 40), the same at 1 and 2 workers, so their stored
# cells re-run as they were
SCREENS_EARLY_PHASE: dict[str, Any] = {"early_topk_factor": 4, "early_steps": 40}
METHODS["demo-adamw"] = Method(
    "DeMo, strategy=\"demo\"'s defaults but update=\"raw\": the decoded mean as AdamW's gradient (no sign), AdamW",
    "demo", "adamw", ADAMW_LR, {"update": "raw", **SCREENS_EARLY_PHASE},
)
# issue 18, the 4-worker gap: Adam's per-coordinate scale instead of the sign, on the decoded mean. beta1 0: DeMo's
# residual is the momentum already (demo-adamw runs a second one, 0.9, on top of it)
METHODS["demo-adamw-b0"] = Method(
    "DeMo, strategy=\"demo\"'s defaults but update=\"raw\", AdamW with beta1 0 (RMSprop on the decoded mean)",
    "demo", "adamw", ADAMW_LR, {"update": "raw", **SCREENS_EARLY_PHASE}, momentum=0.0,
)
# issue 18, DeMo's sign rule without the codec: DDP all-reduces the exact mean gradient and Signum steps
# lr * sign(momentum) (arXiv 1802.04434), at DeMo's rate; beta 0.9 is the paper's, 0.99 DeMo's decay, 0 signSGD: what
# DeMo becomes when it sends every coefficient exactly (its residual, the only momentum it has, then empties every step)
for _beta in (0.0, 0.9, 0.99):
    METHODS[f"ddp-signum-b{_beta:g}"] = Method(
        f"Lightning DDP, Signum beta {_beta:g} (sign of the exact gradient's momentum: DeMo's rule without the codec)",
        "ddp", "signum", DEMO_LR, momentum=_beta,
    )
# issue 18, the 4-worker gap to Signum: DeMo's exchange, then Signum's momentum (beta 0.9) on the decoded mean before
# the sign (update="raw"): whether what DeMo lacks against Signum is a momentum over the components it sends
METHODS["demo-signum-b0.9"] = Method(
    "DeMo, strategy=\"demo\"'s defaults but update=\"raw\", Signum beta 0.9 on the decoded mean (a momentum over what is sent)",
    "demo", "signum", DEMO_LR, {"update": "raw", **SCREENS_EARLY_PHASE}, momentum=0.9,
)
# issue 18, whether demo-signum-b0.9 stalls because of bursts in the raw decoded mean (a component left unsent builds up
# in the residual and leaves at once): a momentum over each step's sign (update="sign", then Signum) weighs every step
# alike. It stalled as well (README, the screens): the momentum in series with the residual, not the bursts
METHODS["demo-sign-signum-b0.9"] = Method(
    "DeMo, strategy=\"demo\"'s defaults (update=\"sign\"), Signum beta 0.9 over the per-step signs",
    "demo", "signum", DEMO_LR, dict(SCREENS_EARLY_PHASE), momentum=0.9,
)
# issue 18 made Elias-Fano positions the default (position_format="auto"). They are lossless, so every stored cell's loss
# stands; every row but "demo-default" keeps the fixed-width positions it was measured with, so its bytes re-run as they
# were too ("demo-default" cells measured before the change carry the fixed width's bytes: their latest.json says which)
for _name, _method in list(METHODS.items()):
    if _name != "demo-default" and (_method.kind == "demo" or _method.options.get("compress_params")):
        METHODS[_name] = replace(_method, options={"position_format": "packed", **_method.options})
# issue 18 made DeMo clip each worker's gradient at norm 1.0 by default (clip_grad_norm="auto": off when the Trainer's
# gradient_clip_val is set). Every DeMo row but "demo-default" keeps the unclipped exchange it was measured with, so its
# stored cells re-run as they were; "demo-default" cells stored before the change ran unclipped (their latest.json has
# no "demo_clip_grad_norm_default"), and with --gradient-clip-val both revisions run the same clipped exchange
for _name, _method in list(METHODS.items()):
    if _name != "demo-default" and _method.kind == "demo":
        METHODS[_name] = replace(_method, options={"clip_grad_norm": None, **_method.options})


def _demo_clip_default() -> Any:
    """The norm ``strategy="demo"`` clips each worker's gradient at when the Trainer does not (``None``: a revision
    before that default, whose DeMo exchange never clipped on its own)."""
    import demo_lightning.algorithms.demo as demo_module

    return getattr(demo_module, "DEFAULT_CLIP_GRAD_NORM", None)


# ---------------------------------------------------------------------------------------------- worker
def _callbacks(method: Method) -> list[Any]:
    out: list[Any] = []
    if method.keep_ratio is not None:
        from demo_lightning import AdaptiveKeepRatio

        from demo_lightning.schedules import Schedule

        keep = Schedule(**method.keep_ratio) if isinstance(method.keep_ratio, dict) else method.keep_ratio
        out.append(AdaptiveKeepRatio() if keep == "default" else AdaptiveKeepRatio(keep_ratio=keep))
    if method.sync_periods is not None:
        from demo_lightning import AdaptiveSyncPeriods

        out.append(AdaptiveSyncPeriods(**method.sync_periods))
    return out


def parse_options(options: Iterable[str]) -> dict[str, Any]:
    """``--option KEY=VALUE`` items as ``{KEY: VALUE}``, VALUE read as JSON (``256``, ``0.999``, ``true``), else a string."""
    out: dict[str, Any] = {}
    for item in options:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--option expects KEY=VALUE (e.g. --option topk=256), got {item!r}")
        try:
            out[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[key.strip()] = text
    return out


def with_options(method: Method, options: list[str] | None) -> Method:
    """``method`` with ``--option KEY=VALUE`` settings laid over its strategy options (VALUE read as JSON, else a string).

    For ablations of one setting (``--option topk=256``, ``--option decay=0.999``) without a named method;
    the record keeps the method's name and lists the settings under ``options``."""
    if not options or method.kind == "ddp":  # Lightning's DDPStrategy: no settings of ours
        return method
    extra = parse_options(options)
    said = ", ".join(f"{k}={v!r}" for k, v in extra.items())
    return Method(f"{method.description}; {said}", method.kind, method.optimizer, method.lr, {**method.options, **extra},
                  method.keep_ratio, method.sync_periods)


def _strategy(method: Method, timeout: float) -> Any:
    import demo_lightning

    if method.kind == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo", start_method="popen")
    if method.kind == "demo":
        options = dict(method.options)
        known = inspect.signature(demo_lightning.DeMoStrategy).parameters
        if options.get("clip_grad_norm", "auto") is None and "clip_grad_norm" not in known:
            del options["clip_grad_norm"]  # a revision from before the setting (exchange_share.py --against): it never clipped
        return demo_lightning.DeMoStrategy(timeout=timeout, **options)
    return demo_lightning.DesLocStrategy(timeout=timeout, **method.options)


def worker(args: argparse.Namespace) -> None:
    """Train one method at one world size; every rank writes ``<out>.rank<r>.json``."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    import demo_lightning
    from demo_lightning.callbacks.communication_monitor import ddp_modeled_seconds, modeled_seconds
    from demo_lightning.comm import ddp_bytes_per_step
    from demo_lightning.data import ImageDataModule, TextDataModule
    from demo_lightning.models import GPTLightningModule, ImageClassifier
    StageTimes = add_sink = None  # a revision before the stage ranges (exchange_share.py --against): time the calls
    try:
        from demo_lightning import profiling
    except ImportError:
        profiling = None
    # the module must belong to the demo_lightning that runs (an editable install's finder can supply
    # this checkout's module to an older revision's package, whose exchange opens no ranges)
    if profiling is not None and Path(profiling.__file__).resolve().parent == Path(demo_lightning.__file__).resolve().parent:
        StageTimes, add_sink = profiling.StageTimes, profiling.add_sink

    method = with_options(METHODS[args.method], args.option)
    bandwidths = [float(b) for b in args.bandwidths.split(",")]
    latency = args.latency_ms / 1000
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []
            self.val_curve: list[tuple[int, float]] = []
            self.val_acc_curve: list[tuple[int, float]] = []  # the digits task's accuracy
            self._t0 = self._comm0 = self._inside0 = 0.0
            # the library's stage ranges (guard, exchange, averaging), timed; None: a library without them
            self.stages = StageTimes() if StageTimes is not None else None
            self.timing = "stage ranges" if self.stages is not None else "wrapped calls"
            self._sink: Any = None
            self._wrapped_s = self._wrapped_comm_s = 0.0

        def _comm_seconds(self, trainer: pl.Trainer) -> float:
            strat = trainer.strategy
            return strat.communicator.seconds if isinstance(strat, demo_lightning.strategies.CommunicationStrategy) else 0.0

        def _exchange_seconds(self, trainer: pl.Trainer) -> float:
            """Seconds of exchange so far: inside the outermost stage ranges, or (a library without them)
            inside the wrapped exchange and averaging calls plus the collectives outside them (the guard's)."""
            if self.stages is not None:
                return self.stages.total
            return self._wrapped_s + self._comm_seconds(trainer) - self._wrapped_comm_s

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            """Time the stage ranges the guard, the exchange and the averaging open (codec and collectives)."""
            strat = trainer.strategy
            if not isinstance(strat, demo_lightning.strategies.CommunicationStrategy):
                return
            if self.stages is not None:
                self.stages.reset()
                if self._sink is None:
                    self._sink = add_sink(self.stages)
                return
            for obj, names in [(x, ("step",)) for x in strat.exchanges] + [(a, ("before_step", "after_step")) for a in strat.averagers]:
                for name in names:
                    setattr(obj, name, self._timed(getattr(obj, name), strat.communicator))

        def _timed(self, fn: Any, comm: Any) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                start, comm0 = time.perf_counter(), comm.seconds
                try:
                    return fn(*a, **k)
                finally:
                    self._wrapped_s += time.perf_counter() - start
                    self._wrapped_comm_s += comm.seconds - comm0

            return call

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if self._sink is not None:
                self._sink.remove()
                self._sink = None

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
            self._t0, self._comm0 = time.perf_counter(), self._comm_seconds(trainer)
            self._inside0 = self._exchange_seconds(trainer)

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
            seconds = time.perf_counter() - self._t0
            comm = self._comm_seconds(trainer) - self._comm0
            strat = trainer.strategy
            row: dict[str, Any] = {"step": trainer.global_step, "seconds": seconds, "comm_s": comm,
                                   "loss": float(outputs["loss"]) if isinstance(outputs, dict) else float("nan")}
            if isinstance(strat, demo_lightning.strategies.CommunicationStrategy):
                traffic, records = strat.ledger.last_step, list(strat.ledger.step_records)
                inside = self._exchange_seconds(trainer) - self._inside0
                by_tag: dict[str, float] = {}
                for rec in records:
                    by_tag[rec.tag] = by_tag.get(rec.tag, 0.0) + rec.sent_bytes
                row.update(sent=traffic.sent_bytes, received=traffic.received_bytes, calls=traffic.calls, sent_by_tag=by_tag,
                           exchange_s=inside, modeled={f"{b:g}": modeled_seconds(records, b, latency) for b in bandwidths})
                if method.sync_periods is not None and strat.averagers:  # the periods in force after this step
                    row["periods"] = dict(getattr(strat.averagers[0], "periods", {}))
            else:
                n = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
                ddp = ddp_bytes_per_step(n, trainer.world_size)
                row.update(sent=ddp, received=ddp, calls=1, exchange_s=0.0,
                           modeled={f"{b:g}": ddp_modeled_seconds(ddp, n, trainer.world_size, b, latency) for b in bandwidths})
            self.rows.append(row)

        def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if not trainer.sanity_checking and trainer.state.fn == "fit":
                self.add_validation(int(trainer.global_step), trainer.callback_metrics)

        def add_validation(self, step: int, metrics: Any) -> None:
            """One validation's loss, and its accuracy where the model logs one (the digits)."""
            self.val_curve.append((step, float(metrics["val/loss"])))
            if "val/acc" in metrics:
                self.val_acc_curve.append((step, float(metrics["val/acc"])))

    pl.seed_everything(args.seed, workers=True, verbose=False)
    schedule = dict(optimizer=method.optimizer, lr=method.lr if args.lr is None else args.lr, momentum=method.momentum,
                    warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
                    max_steps=args.steps if args.schedule_steps is None else args.schedule_steps)
    if args.corpus == DIGITS:
        model: pl.LightningModule = ImageClassifier(DIGITS_MODEL, model_kwargs=dict(DIGITS_KWARGS), **schedule)
        data: pl.LightningDataModule = ImageDataModule(image_size=DIGITS_SIZE, batch_size=args.batch_size)
    else:
        model = GPTLightningModule(block_size=args.block_size, d_model=args.d_model, n_layer=args.n_layer, **schedule)
        named = args.corpus in CORPUS_NAMES
        data = TextDataModule(path=None if named else args.corpus, corpus=args.corpus if named else "stdlib",
                              block_size=args.block_size, batch_size=args.batch_size, max_bytes=args.max_bytes)
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.world_size, strategy=_strategy(method, args.timeout), max_steps=args.steps,
        gradient_clip_val=args.gradient_clip_val,
        val_check_interval=args.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0, logger=False,
        callbacks=[recorder, *_callbacks(method)], enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=data)
    if not recorder.val_curve or recorder.val_curve[-1][0] != trainer.global_step:
        recorder.add_validation(int(trainer.global_step), trainer.validate(model, datamodule=data, verbose=False)[0])
    allreduce_s = 0.0
    if method.kind == "ddp" and dist.is_initialized():  # the all-reduce DDP overlapped with backward, timed alone
        flat = torch.zeros(sum(p.numel() for p in model.parameters() if p.requires_grad))
        dist.barrier()
        start = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(flat)
        allreduce_s = (time.perf_counter() - start) / 5
    record = {
        "rank": trainer.global_rank, "world_size": trainer.world_size, "steps": trainer.global_step,
        "n_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "rows": recorder.rows, "val_curve": recorder.val_curve, "val_acc_curve": recorder.val_acc_curve, "ddp_allreduce_s": allreduce_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "sync_periods": sync_periods(trainer.strategy),
        "position_format": position_format(trainer.strategy),
        "stage_exclusive_s": recorder.stages.snapshot()["exclusive"] if recorder.stages is not None else {},
        "exchange_timing": recorder.timing,
        "library": str(Path(demo_lightning.__file__).resolve().parent.parent),  # which demo_lightning ran
    }
    Path(f"{args.out}.rank{trainer.global_rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():  # leave together and close the group: gloo's threads abort a process exiting with it open
        dist.barrier()
        dist.destroy_process_group()


def position_format(strategy: Any) -> str | None:
    """How the run's top-k positions travelled (``"packed"`` or ``"elias_fano"``), ``None`` where no codec
    sent positions (DDP, DES-LOC without ``compress_params``). Cells written before issue 18 made
    Elias-Fano the default lack the key: theirs were ``"packed"``."""
    demo = getattr(strategy, "demo_config", None)
    desloc = getattr(strategy, "desloc_config", None)
    codec = demo.codec if demo is not None else (desloc.codec if desloc is not None and desloc.compress_params else None)
    return codec.position_format if codec is not None and codec.sends_positions else None


def sync_periods(strategy: Any) -> dict[str, int]:
    """Ledger tag prefix -> period in optimizer steps, for every periodic average the strategy runs."""
    periods: dict[str, int] = {}
    for averager in getattr(strategy, "averagers", []):
        config = averager.config
        if config.param_sync_every is not None:
            periods["desloc/params"] = periods["desloc/buffers"] = config.param_sync_every  # also desloc/params_compressed
        current = getattr(averager, "periods", None)  # the periods at the end (AdaptiveSyncPeriods changes them)
        if current is not None and "params" in current:
            periods["desloc/params"] = periods["desloc/buffers"] = current["params"]
        states = getattr(averager, "state_periods", config.state_periods)
        periods.update({f"desloc/state/{key}": period for key, period in states.items()})
    return periods


# ---------------------------------------------------------------------------------------------- parent
CORPUS_NAMES = ("stdlib", "prose", "cpp")
# --corpus digits: the vision task (the model and data of benchmarks/presets.py's digits rows)
DIGITS, DIGITS_MODEL, DIGITS_KWARGS, DIGITS_SIZE = "digits", "resnet10t", {"channels": (32, 64, 128, 256)}, 32


def _corpus_digest(args: argparse.Namespace) -> str:
    """The trained text's digest (demo_lightning.data.corpora.corpus_digest), to tell machines' corpora apart;
    for the digits, the same digest of the images' and labels' bytes as the workers load them."""
    from demo_lightning.data import corpus_digest, load_text_corpus

    if args.corpus == DIGITS:
        from demo_lightning.data import load_digits_tensors

        images, labels = load_digits_tensors(DIGITS_SIZE)
        return corpus_digest(images.numpy().tobytes(), labels.numpy().tobytes())
    named = args.corpus in CORPUS_NAMES
    train, val = load_text_corpus(None if named else args.corpus, args.max_bytes, 0.05, args.corpus if named else "stdlib")
    return corpus_digest(train, val)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_method(name: str, world_size: int, args: argparse.Namespace, workdir: Path, script: Path | None = None) -> dict[str, Any]:
    """Launch one run (Lightning starts the other ranks) and merge its rank records into one record.

    ``script``: the file run as the worker (default this one; ``benchmarks/presets.py`` runs itself,
    adding its rows to this file's worker)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"{name.replace('+', '_')}_w{world_size}"
    for stale in workdir.glob(f"{out.name}.*rank*.json"):
        stale.unlink()
    cmd = [sys.executable, str((script or Path(__file__)).resolve()), "--worker", "--method", name, "--world-size", str(world_size),
           "--out", str(out), *args.shared]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")}
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    print(f"$ {name} at {world_size} workers, {args.steps} steps", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.run_timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} at {world_size} workers failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(workdir.glob(f"{out.name}.rank*.json"))]
    if len(ranks) != world_size:
        raise SystemExit(f"{name} at {world_size} workers: {len(ranks)} rank records, expected {world_size}")
    record = merge(name, ranks, args.warmup, args.option)
    record["wall_s"] = time.perf_counter() - start
    print(f"  val {record['final_val_loss']:.4f}  ratio {record['ratio_vs_ddp']:.1f}x  step {1000 * record['step_time_s']:.0f} ms"
          f"  exchange {100 * record['exchange_share']:.1f} %  ({record['wall_s']:.0f} s)", flush=True)
    return record


def merge(name: str, ranks: list[dict[str, Any]], warmup: int, options: list[str] | None = None) -> dict[str, Any]:
    """One record per method and world size: traffic and time from rank 0, memory the largest rank's."""
    method = with_options(METHODS[name], options)
    r0 = next(r for r in ranks if r["rank"] == 0)
    rows = r0["rows"]
    timed = rows[warmup:] or rows
    step_time = statistics.median(r["seconds"] for r in timed)
    comm = statistics.median(r["comm_s"] for r in timed)
    compute = max(0.0, step_time - (r0["ddp_allreduce_s"] if method.kind == "ddp" else comm))
    n, world, steps = r0["n_trainable"], r0["world_size"], len(rows)
    ddp_bytes = 2 * (world - 1) / world * 4 * n
    sent = sum(r["sent"] for r in rows) / steps
    received = sum(r["received"] for r in rows) / steps
    steady = long_run_ratio(rows, r0.get("sync_periods", {}), ddp_bytes)
    changes = _period_changes(rows)
    if len(changes) > 1:  # the periods moved (AdaptiveSyncPeriods): no one period to extrapolate from
        steady = None
    modeled_comm = {b: sum(r["modeled"][b] for r in rows) / steps for b in rows[0]["modeled"]}
    cumulative, total = [], 0.0
    for r in rows:
        total += r["sent"]
        cumulative.append(total)
    return {
        "method": name, "description": method.description, "world_size": world, "steps": r0["steps"], "n_trainable": n,
        "final_val_loss": r0["val_curve"][-1][1], "val_curve": r0["val_curve"],
        **({"final_val_acc": r0["val_acc_curve"][-1][1], "val_acc_curve": r0["val_acc_curve"]} if r0.get("val_acc_curve") else {}),
        "bytes_sent_per_step": sent, "bytes_received_per_step": received, "ddp_bytes_per_step": ddp_bytes,
        "ratio_vs_ddp": ddp_bytes / sent if sent > 0 else math.inf, "steady_ratio_vs_ddp": steady,
        "collectives_per_step": sum(r["calls"] for r in rows) / steps,
        "step_time_s": step_time, "compute_s": compute,
        "exchange_share": sum(r["exchange_s"] for r in rows) / max(1e-12, sum(r["seconds"] for r in rows)),
        "stage_s_per_step": {name: s / steps for name, s in sorted(r0.get("stage_exclusive_s", {}).items())},
        "exchange_timing": r0.get("exchange_timing", "wrapped calls"),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "modeled_comm_s_per_step": modeled_comm,
        "train_loss": [r["loss"] for r in rows], "cumulative_sent_bytes": cumulative, "library": r0.get("library"),
        "sync_periods": r0.get("sync_periods", {}),
        **({"position_format": r0["position_format"]} if r0.get("position_format") else {}),
        **({"period_changes": changes} if changes else {}),
        **({"options": list(options)} if options and method.kind != "ddp" else {}),
    }


def _period_changes(rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, int]]]:
    """``(step, periods)`` at the first step and wherever the periods changed (AdaptiveSyncPeriods runs)."""
    out: list[tuple[int, dict[str, int]]] = []
    for r in rows:
        if "periods" in r and (not out or out[-1][1] != r["periods"]):
            out.append((r["step"], r["periods"]))
    return out


def long_run_ratio(rows: list[dict[str, Any]], periods: dict[str, int], ddp_bytes: float) -> float | None:
    """DDP's bytes over ours in a run long enough for every periodic average to recur at its period.

    Per ledger tag: every-step traffic counts at its mean over the run; a periodic average (tag
    prefix in ``periods``) counts at its mean bytes per sync held, divided by its period. A dense
    average of the parameters or of one optimizer state that the run never held is counted as one
    fp32 all-reduce of every trainable parameter, DDP's bytes for one step (exact without float
    buffers). ``None`` when the strategy averages nothing periodically (its run ratio is its
    long-run ratio).
    """
    if not periods:
        return None
    steps = len(rows)
    every_step = 0.0
    held: dict[str, list[float]] = {prefix: [] for prefix in periods}
    for row in rows:
        per_prefix: dict[str, float] = {}
        for tag, sent in row.get("sent_by_tag", {}).items():
            # the longest prefix ending at a separator: desloc/state/exp_avg_sq is not desloc/state/exp_avg's
            matches = [p for p in periods if tag == p or (tag.startswith(p) and tag[len(p)] in "/_")]
            prefix = max(matches, key=len) if matches else None
            if prefix is None:
                every_step += sent / steps
            else:
                per_prefix[prefix] = per_prefix.get(prefix, 0.0) + sent
        for prefix, sent in per_prefix.items():
            held[prefix].append(sent)
    long_run = every_step
    for prefix, syncs in held.items():
        if syncs:
            long_run += sum(syncs) / len(syncs) / periods[prefix]
        elif prefix == "desloc/params" or prefix.startswith("desloc/state/"):
            long_run += ddp_bytes / periods[prefix]
    return ddp_bytes / long_run if long_run > 0 else math.inf


def add_time_to_target(records: list[dict[str, Any]]) -> None:
    """Modeled wall time to DDP's final validation loss, per bandwidth, for every record (in place)."""
    for world in {r["world_size"] for r in records}:
        group = [r for r in records if r["world_size"] == world]
        ddp = next((r for r in group if r["method"] == "ddp"), None)
        target = ddp["final_val_loss"] if ddp else None
        for r in group:
            r["target_val_loss"] = target
            reached = next((step for step, loss in r["val_curve"] if target is not None and loss <= target), None)
            r["steps_to_target"] = reached
            r["modeled"] = {
                b: {"step_s": r["compute_s"] + c, "time_to_target_s": None if reached is None else reached * (r["compute_s"] + c)}
                for b, c in r["modeled_comm_s_per_step"].items()
            }


# ---------------------------------------------------------------------------------------------- output
def _bytes(x: float) -> str:
    return f"{x / 1e6:.2f} MB" if x >= 1e6 else f"{x / 1e3:.1f} kB" if x >= 1e3 else f"{x:.0f} B"


def _seconds(x: float | None) -> str:
    return "not reached" if x is None else f"{x:,.0f} s" if x >= 100 else f"{x:.1f} s"


def _job(meta: dict[str, Any]) -> str:
    """The model and the data per worker per step, as the table's header states them."""
    if meta.get("corpus") == DIGITS:
        return (f"{meta['n_trainable']:,}-parameter timm {DIGITS_MODEL} on the digits at {DIGITS_SIZE}x{DIGITS_SIZE}, "
                f"{meta['batch_size']} images per worker per step")
    return (f"{meta['n_trainable']:,}-parameter GPT (d_model {meta['d_model']}, {meta['n_layer']} layers), "
            f"{meta['batch_size']} x {meta['block_size']} bytes per worker per step")


def render(meta: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """The markdown table (one per world size) and the targets; pure function of the JSON."""
    bands = meta["bandwidths"]
    band_names = " / ".join(f"{b:g}" for b in bands)
    lines = [
        f"Command: `{meta['command']}` — {meta['date']}, {meta['machine']}; {meta['steps']} optimizer steps, "
        f"{_job(meta)}, seed {meta['seed']}, "
        f"latency {meta['latency_ms']:g} ms per hop. Total run time {meta['wall_s'] / 60:.0f} min.",
        "",
    ]
    for world in sorted({r["world_size"] for r in records}):
        group = [r for r in records if r["world_size"] == world]
        ddp = next((r for r in group if r["method"] == "ddp"), None)
        lines += [
            f"**{world} workers**" + (f" (DDP's final validation loss {ddp['final_val_loss']:.4f})" if ddp else ""),
            "",
            "| method | val loss | vs DDP | sent / step | received / step | ratio vs DDP (run) | (long run) | step time "
            f"| exchange share | peak RSS | modeled step @ {band_names} Gbit/s | to DDP's loss @ {band_names} Gbit/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            rel = f"{r['final_val_loss'] / ddp['final_val_loss']:.3f}x" if ddp else "—"
            steady = r["steady_ratio_vs_ddp"]
            run_ratio = "no sync in run" if r["bytes_sent_per_step"] < 1 else f"{r['ratio_vs_ddp']:,.1f}x"
            modeled = [r["modeled"][f"{b:g}"] for b in bands]
            steps = " / ".join(f"{1000 * m['step_s']:.0f}" for m in modeled) + " ms"
            reached = modeled[0]["time_to_target_s"] is not None
            times = " / ".join(_seconds(m["time_to_target_s"]) for m in modeled) if reached else "not reached"
            lines.append(
                f"| `{r['method']}` | {r['final_val_loss']:.4f} | {rel} | {_bytes(r['bytes_sent_per_step'])} | "
                f"{_bytes(r['bytes_received_per_step'])} | {run_ratio} | {'—' if steady is None else f'{steady:,.1f}x'} | "
                f"{1000 * r['step_time_s']:.0f} ms | {100 * r['exchange_share']:.1f} % | {r['peak_rss_mb']:.0f} MB | "
                f"{steps} | {times} |"
            )
        lines.append("")
    lines += targets(records, bands)
    return "\n".join(lines) + "\n"


def targets(records: list[dict[str, Any]], bands: list[float]) -> list[str]:
    """Issue 6's targets, checked against the records: one row each, met or not, with the figures."""
    out = ["| target | workers | figures | met |", "|---|---|---|---|"]
    notes: list[str] = []
    checks = [("demo-sign1bit", 100, 1.05), ("demo", 100, 1.05), ("desloc", 170, 1.05), ("demo+desloc", 1000, 1.10)]
    checks += [(name, 1000, 1.10) for name in METHODS if name.startswith(("desloc-compressed", "desloc-1bit"))]  # combinations
    slowest = f"{min(bands):g}"
    for world in sorted({r["world_size"] for r in records}):
        by = {r["method"]: r for r in records if r["world_size"] == world}
        ddp = by.pop("ddp", None)
        if ddp is None:
            continue
        for name, ratio, loss in checks:
            r = by.get(name)
            if r is None:
                continue
            rel = r["final_val_loss"] / ddp["final_val_loss"]
            run = r["ratio_vs_ddp"]
            long_run = r["steady_ratio_vs_ddp"] or run
            ok = min(run, long_run) >= ratio and rel <= loss
            shown = f"{run:,.0f}x" + (f" (long run {long_run:,.0f}x)" if r["steady_ratio_vs_ddp"] else "")
            out.append(f"| `{name}`: >= {ratio}x fewer bytes, loss <= {loss:.2f}x DDP's | {world} | {shown}, loss {rel:.3f}x | "
                       f"{'yes' if ok else 'no'} |")
        shares = ", ".join(f"`{n}` {100 * r['exchange_share']:.1f} %" for n, r in by.items())
        met = [n for n, r in by.items() if r["exchange_share"] <= 0.10]
        out.append(f"| exchange <= 10 % of step time | {world} | {shares} | {', '.join(f'`{n}`' for n in met) or 'none'} |")
        ddp_t = ddp["modeled"][slowest]["time_to_target_s"]
        ddp_comm = ddp["modeled_comm_s_per_step"][slowest]
        bound = (ddp["compute_s"] + ddp_comm) / max(1e-12, ddp["compute_s"])
        speedups = {n: ddp_t / t for n, r in by.items() if (t := r["modeled"][slowest]["time_to_target_s"]) and ddp_t}
        figures = ", ".join(f"`{n}` {x:.2f}x" for n, x in speedups.items()) or "no method reaches DDP's final loss in the run"
        out.append(f"| >= 10x sooner to DDP's loss @ {slowest} Gbit/s | {world} | {figures}; ceiling for a method needing "
                   f"DDP's steps: {bound:.2f}x | {', '.join(f'`{n}`' for n, x in speedups.items() if x >= 10) or 'none'} |")
        notes.append(
            f"At {world} workers DDP's modeled communication at {slowest} Gbit/s is {1000 * ddp_comm:.0f} ms per step "
            f"against {1000 * ddp['compute_s']:.0f} ms of measured compute, so a method that needs as many steps as DDP "
            f"reaches DDP's loss at most {bound:.2f}x sooner; a 10x gain needs compute per step below "
            f"{1000 * ddp_comm / 9:.0f} ms minus 10/9 of the method's own communication."
        )
    return out + [""] + notes


def plot(records: list[dict[str, Any]], bands: list[float], out: Path) -> list[Path]:
    """Three PNGs: validation loss vs step, vs cumulative bytes sent, and modeled step time per bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world_size"] for r in records})
    paths = []
    for kind in ("step", "bytes"):
        fig, axes = plt.subplots(1, len(worlds), figsize=(6.5 * len(worlds), 4.5), squeeze=False)
        for ax, world in zip(axes[0], worlds):
            for r in (r for r in records if r["world_size"] == world):
                steps = [s for s, _ in r["val_curve"]]
                losses = [v for _, v in r["val_curve"]]
                xs = steps if kind == "step" else [max(1.0, r["cumulative_sent_bytes"][min(s, len(r["cumulative_sent_bytes"])) - 1]) for s in steps]
                ax.plot(xs, losses, marker="o", markersize=3, label=r["method"])
            ax.set_title(f"{world} workers")
            ax.set_ylabel("validation loss (nats/byte)")
            if kind == "step":
                ax.set_xlabel("optimizer step")
            else:
                ax.set_xscale("log")  # every method sends at least the guard's byte per step: no zeros
                ax.set_xlabel("cumulative bytes sent per worker")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"compare_loss_vs_{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fig, axes = plt.subplots(1, len(worlds), figsize=(6.5 * len(worlds), 4.5), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        group = [r for r in records if r["world_size"] == world]
        width = 0.8 / len(bands)
        for i, b in enumerate(bands):
            vals = [1000 * r["modeled"][f"{b:g}"]["step_s"] for r in group]
            ax.bar([j + i * width for j in range(len(group))], vals, width, label=f"{b:g} Gbit/s")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(group))], [r["method"] for r in group], rotation=40, ha="right", fontsize=8)
        ax.set_ylabel("modeled ms per step (measured compute + link)")
        ax.set_title(f"{world} workers")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = out / "compare_modeled_time.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(ISSUE_METHODS), help=f"comma-separated, from: {', '.join(METHODS)}")
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--steps", type=int, default=520, help="optimizer steps (520: one Local Adam sync at 512)")
    p.add_argument("--val-every", type=int, default=65)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the step-time median")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=20, help="learning-rate warm-up")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine's final rate over the peak (every method)")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="every method's decoupled weight decay (AdamW's; SGD's under the sign rule is the same)")
    p.add_argument("--gradient-clip-val", type=float, default=None,
                   help="every method's gradient-norm clip (Lightning's gradient_clip_val; under DeMo each worker's own "
                        "gradient before its momentum; default: none)")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="bytes of the corpus read (5 %% validation)")
    p.add_argument("--corpus", default="stdlib",
                   help="a named corpus (stdlib, prose, cpp: demo_lightning.data.corpora), a path to your own text, "
                        "or digits (the vision task: a ResNet-10t on scikit-learn's digits)")
    p.add_argument("--lr", type=float, default=None, help="every method's peak learning rate (default: each method's own)")
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="the learning-rate schedule's length (default --steps): a shorter run follows a longer run's first steps")
    p.add_argument("--option", action="append", default=None, metavar="KEY=VALUE",
                   help="a strategy setting laid over every (non-DDP) method's own, VALUE as JSON (repeatable: --option topk=256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidths", default="1,10,100", help="Gbit/s, comma-separated")
    p.add_argument("--latency-ms", type=float, default=0.5, help="per hop of a collective")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="one run's limit, seconds")
    p.add_argument("--out", default=str(RESULTS), help="results folder (or, with --worker, the record prefix)")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "compare"))
    p.add_argument("--render-only", action="store_true", help="re-render table, plots (and README) from <out>/latest.json")
    p.add_argument("--update-readme", action="store_true")
    p.add_argument("--no-plots", action="store_true", help="write the JSON and the table only")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default=None, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [m for m in args.methods.split(",") if m]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    args.method_names = names
    if args.corpus not in (*CORPUS_NAMES, DIGITS):  # a path: absolute, so the workers (run from the repo root) read the same text
        if not Path(args.corpus).expanduser().exists():
            p.error(f"--corpus: {args.corpus!r} is neither a named corpus ({', '.join(CORPUS_NAMES)}), {DIGITS!r} nor an existing path")
        args.corpus = str(Path(args.corpus).expanduser().resolve())
    try:
        args.world_size_list = [int(w) for w in args.world_sizes.split(",")]
        bands = [float(b) for b in args.bandwidths.split(",")]
    except ValueError as e:
        p.error(f"--world-sizes and --bandwidths are comma-separated numbers ({e})")
    if any(w < 2 for w in args.world_size_list):
        p.error(f"--world-sizes must be >= 2 (a comparison of exchanges needs peers), got {args.world_sizes}")
    if any(b <= 0 for b in bands) or args.latency_ms < 0:
        p.error("--bandwidths must be > 0 and --latency-ms >= 0")
    if args.steps < 1 or args.val_every < 1 or args.warmup < 0:
        p.error("--steps and --val-every must be >= 1, --warmup >= 0")
    if args.weight_decay < 0:
        p.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if args.gradient_clip_val is not None and args.gradient_clip_val <= 0:
        p.error(f"--gradient-clip-val must be > 0 (leave it out for no clipping), got {args.gradient_clip_val}")
    if args.schedule_steps is not None and args.schedule_steps < args.steps:
        p.error(f"--schedule-steps ({args.schedule_steps}) must be >= --steps ({args.steps}): the run follows the schedule's first steps")
    if args.option and not args.worker:
        for name in names:
            try:
                with_options(METHODS[name], args.option)
            except SystemExit as e:
                p.error(str(e))
    keys = ("steps", "val_every", "d_model", "n_layer", "block_size", "batch_size", "warmup_steps", "max_bytes", "seed",
            "bandwidths", "latency_ms", "timeout", "corpus", "lr", "schedule_steps", "min_lr_ratio", "weight_decay",
            "gradient_clip_val")
    args.shared = [x for k in keys if getattr(args, k) is not None for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    args.shared += [x for item in args.option or () for x in ("--option", item)]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        saved = json.loads((out / "latest.json").read_text())
        meta, records = saved["meta"], saved["records"]
    else:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        records = [run_method(m, w, args, workdir) for w in args.world_size_list for m in args.method_names]
        add_time_to_target(records)
        given = " ".join(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--update-readme")
        meta = {
            "command": f"python benchmarks/compare.py {given}".strip(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), torch gloo on loopback",
            "steps": args.steps, "n_trainable": records[0]["n_trainable"], "d_model": args.d_model, "n_layer": args.n_layer,
            "block_size": args.block_size, "batch_size": args.batch_size, "seed": args.seed, "corpus": args.corpus, "lr": args.lr,
            "warmup_steps": args.warmup_steps, "schedule_steps": args.schedule_steps, "min_lr_ratio": args.min_lr_ratio, "weight_decay": args.weight_decay,
            "gradient_clip_val": args.gradient_clip_val, "options": args.option,
            "demo_clip_grad_norm_default": _demo_clip_default(),
            "corpus_digest": _corpus_digest(args),
            "bandwidths": [float(b) for b in args.bandwidths.split(",")], "latency_ms": args.latency_ms,
            "wall_s": time.perf_counter() - start,
        }
        (out / "latest.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    table = render(meta, records)
    (out / "latest.md").write_text(table)
    if not args.no_plots:
        plot(records, meta["bandwidths"], out)
    print(table)
    if args.update_readme:
        replace_section("compare", table)


if __name__ == "__main__":
    main()
