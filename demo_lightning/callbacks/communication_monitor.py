"""Communication accounting in TensorBoard: bytes by tag, ratio to DDP, modeled link time,
keep ratio, momentum energy captured per layer group, replica divergence, and a fit-end summary.

Scalars, every ``log_every`` optimizer steps (values of that step; ``cumulative_*`` since fit start,
continued across resumes):

==========================================  ================================================
``comm/step_sent_bytes/<tag>``              bytes this worker sent in the step, by ledger tag
``comm/cumulative_sent_bytes``,             all bytes of the strategy's optimizer steps
``comm/cumulative_received_bytes``
``comm/cumulative_ratio_vs_ddp``            DDP's bytes for as many steps / ours
``comm/modeled_seconds_per_step/<B>Gbps``   ``sum over collectives (hops x latency + sent x 8 / B)``
``comm/ddp_modeled_seconds_per_step/<B>Gbps``  the same model for DDP's bucketed all-reduce
``comm/modeled_seconds_per_step/links``     with ``inter_gbps`` and ``intra_gbps``: the two-link
``comm/ddp_modeled_seconds_per_step/links`` model below, for us and for DDP
``demo/keep_ratio``                         coefficients sent / elements compressed
``demo/energy_captured/<group>``            energy of what was sent / momentum energy, per layer
                                            group (summed over ranks, then divided)
``desloc/replica_divergence``               ``sqrt(mean_r ||x_r - mean x||^2) / ||mean x||`` over
                                            the parameters, every ``divergence_every`` steps
==========================================  ================================================

Hops in the link model: ``W - 1`` for all-gather and broadcast, ``2 (W - 1)`` for all-reduce (ring
algorithms); DDP is modeled as fp32 gradients in ``bucket_cap_mb`` buckets (25 MB, its default).

Two links (``inter_gbps``, ``intra_gbps``; :func:`link_seconds`): a node's ``G`` ranks share one
inter-node link, so a step's inter-node time is ``G x`` this rank's inter-node bytes (the ledger's
share of the node's link, :mod:`~demo_lightning.comm.topology`) ``x 8 / inter_gbps``; the rest of
its bytes go over its own intra-node link at ``intra_gbps``; plus the hops' latency. DDP's ring over
all ranks (NCCL orders it by node) is modeled the same way: ``1 / G`` of its bytes on the node's link.

Histograms every ``histogram_every`` steps (rank 0's values): ``demo/dct_abs/<group>`` (coefficient
magnitudes of the residual momenta in the exchange's own ``transform``: DCT by default, Haar or
none; the tag keeps its name whatever the transform) and ``demo/residual_norm/<group>``.

Dashboard (into each :class:`~lightning.pytorch.loggers.TensorBoardLogger`'s run directory, by rank
0 only, no collective; open it with ``tensorboard --logdir <the loggers' save_dir>``):

* the **Custom Scalars** tab: at fit start, one category ``demo_lightning`` (:meth:`CommunicationMonitor.dashboard_layout`)
  with the charts ``loss`` (``<loss_tag>``; ``loss vs DDP baseline`` with ``baseline=``, adding
  ``baseline/<loss_tag>``), ``bytes sent per step, by tag`` (``comm/step_sent_bytes/*`` and the
  strategy's ``comm/bytes_sent_per_step``), ``cumulative ratio vs DDP (bytes)``, one ``modeled link
  time`` chart per bandwidth (ours and DDP's; the two-link model with ``inter_gbps``), and, when
  they are logged, ``momentum energy captured, by layer group``, ``keep ratio``, ``replica
  divergence`` and ``skipped optimizer steps (non-finite)``. Every entry is a regular expression
  matched from the start of a tag, as TensorBoard does.
* ``baseline/<loss_tag>``: with ``baseline=``, the loss of a DDP run read at setup (from its
  TensorBoard event files) and copied at fit start into this run, so the loss chart overlays the
  two wherever the baseline's files are.
* the **HParams** tab: at fit start the run's hyperparameters (:meth:`CommunicationMonitor.run_hyperparameters`:
  the strategy's settings, world size and nodes, the trainer's accumulation and precision, the
  module's and datamodule's ``hparams`` as ``model/*`` and ``data/*``) and the names of its
  metrics; at fit end the metrics, logged as scalars at the last step to every logger and kept in
  :attr:`CommunicationMonitor.final_metrics`:

  ==========================================  ================================================
  ``final/loss``                              ``<loss_tag>`` as the run ended (rank 0's)
  ``final/ratio_vs_ddp``                      ``comm/cumulative_ratio_vs_ddp`` at the last step
  ``final/sent_bytes``,                       bytes this worker sent in all optimizer steps, and
  ``final/sent_bytes_per_step``               per step
  ``final/optimizer_steps``                   optimizer steps (continued across resumes)
  ``final/skipped_steps``                     steps the non-finite guard skipped
  ``final/modeled_seconds/<B>Gbps``           modeled communication time of all steps (and
                                              ``/links`` for the two-link model)
  ==========================================  ================================================

TensorBoard keeps the first layout and the first hyperparameters written into a run directory:
the monitor writes its own at fit start, before Lightning logs the module's ``hparams`` (with its
placeholder ``hp_metric``), so this run's HParams entry is the monitor's; a second fit into the
same run directory keeps the first fit's. The HParams tab takes its columns from one run's
summary: runs written by the monitor all have the same strategy columns (``"None"`` for what the
strategy does not use); a run logged without it in the same ``--logdir`` may be the one chosen.

Collectives: the energy reduction (``monitor/reduce``, one small all-reduce per logged step) and
the divergence (``monitor/divergence``, an all-reduce of all parameters) run on every rank at the
same steps; they are recorded in the ledger outside the optimizer steps' windows, so the
strategy's per-step bytes and ratios exclude them and ``comm/monitor_bytes`` reports them. Their
tensors live on the communicator's device (NCCL takes no CPU tensor), each read back once. With
``baseline=``, ``setup`` runs one more, outside the ledger: rank 0 alone reads the baseline and
Lightning's ``strategy.broadcast`` hands its verdict to every rank, so a bad baseline raises the
same ``ValueError`` on every rank before any step.
Works with ``strategy="demo"`` or ``"desloc"``; with any other strategy ``setup`` raises.
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from demo_lightning.algorithms import DeMoConfig
from demo_lightning.algorithms.config import CodecConfig
from demo_lightning.algorithms.desloc import DesLocConfig
from demo_lightning.callbacks.context import communicator_of, exchanges_of, named_trainable
from demo_lightning.callbacks.layer_kinds import layer_kinds
from demo_lightning.codec import plan_tiles, tile_transform, to_tiles
from demo_lightning.comm import ByteLedger, CollectiveRecord
from demo_lightning.validation import check_int, check_number, check_optional_int, is_number

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["CommunicationMonitor", "ddp_link_seconds", "link_seconds", "modeled_seconds", "read_baseline"]

DASHBOARD = "demo_lightning"
"""Title of the Custom Scalars category the monitor writes."""
BASELINE_PREFIX = "baseline/"
"""The baseline's loss is copied into the run as ``baseline/<loss_tag>``."""
FINAL_PREFIX = "final/"
"""The fit-end metrics of the HParams tab: ``final/loss``, ``final/ratio_vs_ddp``, ..."""
HParamValue = Union[int, float, str]

_GROUP_OF_KIND = {
    "embedding": "embedding", "norm": "norm", "conv": "conv", "attention_qk": "attention", "attention_v": "attention",
    "attention_out": "attention", "ffn": "ffn", "linear": "linear", "other": "other",
}


def _hops(record: CollectiveRecord) -> int:
    w = record.world_size
    return 2 * (w - 1) if record.op == "all_reduce" else w - 1


def modeled_seconds(records: list[CollectiveRecord], bandwidth_gbps: float, latency_s: float) -> float:
    """Time these collectives would take on a link of ``bandwidth_gbps`` with ``latency_s`` per hop."""
    return sum(_hops(r) * latency_s + r.sent_bytes * 8 / (bandwidth_gbps * 1e9) for r in records)


def link_seconds(
    records: list[CollectiveRecord], ranks_per_node: int, inter_gbps: float, intra_gbps: float, latency_s: float,
) -> float:
    """Time of these collectives on two links: the node's inter-node link at ``inter_gbps``, which
    its ``ranks_per_node`` ranks share, and this rank's intra-node link at ``intra_gbps`` (see the
    module docstring); ``latency_s`` per hop."""
    return sum(
        _hops(r) * latency_s + r.inter_node_bytes * ranks_per_node * 8 / (inter_gbps * 1e9) + r.intra_node_bytes * 8 / (intra_gbps * 1e9)
        for r in records
    )


def ddp_link_seconds(
    ddp_bytes: float, ddp_inter_node_bytes: float, n_trainable: int, world_size: int, ranks_per_node: int,
    inter_gbps: float, intra_gbps: float, latency_s: float, bucket_cap_mb: float = 25.0,
) -> float:
    """DDP's step on the two links: its bucketed ring all-reduce, ``ddp_inter_node_bytes`` of its
    ``ddp_bytes`` per rank on the node's shared link (see :func:`link_seconds`)."""
    buckets = max(1, math.ceil(n_trainable * 4 / (bucket_cap_mb * 1024 * 1024)))
    inter = ddp_inter_node_bytes * ranks_per_node * 8 / (inter_gbps * 1e9)
    intra = (ddp_bytes - ddp_inter_node_bytes) * 8 / (intra_gbps * 1e9)
    return buckets * 2 * max(0, world_size - 1) * latency_s + inter + intra


def ddp_modeled_seconds(
    ddp_bytes: float, n_trainable: int, world_size: int, bandwidth_gbps: float, latency_s: float, bucket_cap_mb: float = 25.0,
) -> float:
    """DDP's modeled time for one step: one ring all-reduce (``2 (W - 1)`` hops) per gradient bucket
    of ``bucket_cap_mb`` plus ``ddp_bytes`` on a link of ``bandwidth_gbps``."""
    buckets = max(1, math.ceil(n_trainable * 4 / (bucket_cap_mb * 1024 * 1024)))
    return buckets * 2 * max(0, world_size - 1) * latency_s + ddp_bytes * 8 / (bandwidth_gbps * 1e9)


_BASELINE_FIX = (
    "pass baseline= the TensorBoard run directory of the DDP run (the folder holding its events.out.tfevents.* files, "
    "e.g. lightning_logs/ddp/version_0), a folder above exactly one such run, or one event file"
)


def read_baseline(path: Union[str, Path], tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of the scalar ``tag`` (or Lightning's ``<tag>_step``) of a TensorBoard run.

    ``path`` is the run's directory (its ``events.out.tfevents.*`` files, read in order), a folder
    above exactly one such directory, or one event file. Raises ``ValueError`` naming ``baseline``
    or ``loss_tag`` and the fix when the path does not exist, holds no run or several, or the run has
    no such scalar.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = Path(path)
    if not path.exists():
        raise ValueError(f"baseline={str(path)!r} does not exist: {_BASELINE_FIX}")
    source = path
    if path.is_dir():
        runs = sorted({f.parent for f in path.rglob("events.out.tfevents.*") if f.is_file()})
        if not runs:
            raise ValueError(f"baseline={str(path)!r} holds no TensorBoard event file (events.out.tfevents.*): {_BASELINE_FIX}")
        if len(runs) > 1:
            names = ", ".join(repr(str(r)) for r in runs[:4]) + (", ..." if len(runs) > 4 else "")
            raise ValueError(f"baseline={str(path)!r} holds {len(runs)} TensorBoard runs ({names}): pass one of them as baseline=")
        source = runs[0]
    try:
        accumulator = EventAccumulator(str(source), size_guidance={"scalars": 0})
        accumulator.Reload()
        tags = list(accumulator.Tags().get("scalars", []))
    except Exception as e:  # noqa: BLE001 - a file that is not a TensorBoard event file
        raise ValueError(f"baseline={str(path)!r} could not be read as TensorBoard events ({type(e).__name__}: {e}): {_BASELINE_FIX}") from e
    if not tags:
        raise ValueError(f"baseline={str(path)!r} holds no TensorBoard scalars (is it an events.out.tfevents.* file?): {_BASELINE_FIX}")
    for candidate in (tag, f"{tag}_step"):
        if candidate in tags:
            return [(int(e.step), float(e.value)) for e in accumulator.Scalars(candidate)]
    shown = sorted(tags)[:12]
    raise ValueError(
        f"the baseline run {str(source)!r} has no scalar {tag!r} (loss_tag={tag!r}); its scalars are {shown}"
        f"{' ...' if len(tags) > len(shown) else ''}: pass loss_tag= the tag the module logs its training loss under "
        "(self.log(<tag>, loss)), which the baseline run must have logged too"
    )


def _hparam_value(value: Any) -> HParamValue:
    """A value TensorBoard's HParams take (a number or a string): ``None`` and bools as text, a
    one-element tensor as its number, a dataclass or mapping as ``key=value`` pairs, else ``str``."""
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, Tensor) and value.numel() == 1:
        return _hparam_value(value.item())
    if is_dataclass(value) and not isinstance(value, type):
        return ",".join(f"{f.name}={_hparam_value(getattr(value, f.name))}" for f in fields(value))
    if isinstance(value, Mapping):
        return ",".join(f"{k}={_hparam_value(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) or "{}"
    return str(value)


def _flat_hparams(prefix: str, hparams: Mapping[str, Any]) -> dict[str, HParamValue]:
    """A module's or datamodule's ``hparams``, nested mappings flattened with ``/`` (as Lightning's
    TensorBoardLogger does); private keys (``_class_path`` of LightningCLI) left out."""
    out: dict[str, HParamValue] = {}
    for key, value in hparams.items():
        if str(key).startswith("_"):
            continue
        if isinstance(value, Mapping) and value:
            out.update(_flat_hparams(f"{prefix}{key}/", value))
        else:
            out[f"{prefix}{key}"] = _hparam_value(value)
    return out


class CommunicationMonitor(Callback):
    """Log what the strategy sends and what it would cost on a real link (see the module docstring).

    Args:
        log_every: log scalars every this many optimizer steps.
        histogram_every: log histograms every this many optimizer steps (0: never).
        bandwidths_gbps: link speeds in Gbit/s to model communication time at.
        latency_ms: latency per hop of a collective, in milliseconds.
        divergence_every: measure replica divergence every this many steps; ``None``: every 50
            steps when DES-LOC averaging is on (replicas drift between syncs), never otherwise.
        bucket_cap_mb: DDP's bucket size, for its modeled time.
        inter_gbps: bandwidth between nodes (Gbit/s, shared by a node's ranks); with ``intra_gbps``
            it turns on the two-link model (``comm/modeled_seconds_per_step/links``). ``None``: off.
        intra_gbps: bandwidth of each rank's link inside its node (Gbit/s); needs ``inter_gbps``.
        baseline: a DDP run to compare the loss with: its TensorBoard run directory (the folder of its
            ``events.out.tfevents.*`` files, e.g. ``lightning_logs/ddp/version_0``), a folder above
            exactly one such run, or one event file. Rank 0 reads its ``loss_tag`` scalar at setup (a
            missing path or tag raises ``ValueError`` on every rank, before any step) and copies it
            into this run as ``baseline/<loss_tag>`` at fit start. ``None``: no baseline.
        loss_tag: the scalar the module logs its training loss under (``self.log("train/loss", loss)``
            in ``training_step``; Lightning's ``_step`` suffix, added with ``on_epoch=True``, is also
            matched): the loss chart, ``final/loss``, and what is read from ``baseline``.

    Attributes:
        summary: the fit-end summary (see :meth:`format_summary`).
        final_metrics: the fit-end ``final/*`` metrics of the HParams tab (see the module docstring).
    """

    def __init__(
        self,
        log_every: int = 1,
        histogram_every: int = 100,
        bandwidths_gbps: Optional[list[float]] = None,
        latency_ms: float = 0.5,
        divergence_every: Optional[int] = None,
        bucket_cap_mb: float = 25.0,
        inter_gbps: Optional[float] = None,
        intra_gbps: Optional[float] = None,
        baseline: Optional[Union[str, Path]] = None,
        loss_tag: str = "train/loss",
    ) -> None:
        for name, value, low in (("log_every", log_every, 1), ("histogram_every", histogram_every, 0)):
            check_int(name, value, low, "optimizer steps", kind=f"an integer >= {low}")
        check_optional_int("divergence_every", divergence_every, 1)
        bandwidths = [1.0, 10.0] if bandwidths_gbps is None else list(bandwidths_gbps)
        if not bandwidths or not all(is_number(b) and b > 0 for b in bandwidths):
            raise ValueError(f"bandwidths_gbps must be a non-empty list of positive numbers (Gbit/s), got {bandwidths_gbps!r}")
        if not (is_number(latency_ms) and latency_ms >= 0):
            raise ValueError(f"latency_ms must be a number >= 0 (milliseconds per hop), got {latency_ms!r}")
        check_number("bucket_cap_mb", bucket_cap_mb, 0.0, low_open=True, hint="DDP's bucket size, megabytes")
        if (inter_gbps is None) != (intra_gbps is None):
            raise ValueError(
                f"inter_gbps and intra_gbps go together (the two-link model needs both), got inter_gbps={inter_gbps!r}, "
                f"intra_gbps={intra_gbps!r}; e.g. CommunicationMonitor(inter_gbps=10, intra_gbps=400)"
            )
        for name, value in (("inter_gbps", inter_gbps), ("intra_gbps", intra_gbps)):
            if value is not None:
                check_number(name, value, 0.0, low_open=True, hint="Gbit/s")
        if baseline is not None and not (isinstance(baseline, (str, os.PathLike)) and str(baseline).strip()):
            raise ValueError(
                f"baseline must be None or the path (str or pathlib.Path) of a DDP run's TensorBoard directory or event "
                f"file, e.g. baseline='lightning_logs/ddp/version_0', got {baseline!r}"
            )
        if not (isinstance(loss_tag, str) and loss_tag.strip()):
            raise ValueError(
                f"loss_tag must be the name of the scalar the module logs its training loss under, e.g. 'train/loss' "
                f"(self.log('train/loss', loss)), got {loss_tag!r}"
            )
        self.baseline: Optional[Path] = None if baseline is None else Path(baseline)
        self.loss_tag = loss_tag
        self.inter_gbps = None if inter_gbps is None else float(inter_gbps)
        self.intra_gbps = None if intra_gbps is None else float(intra_gbps)
        self.log_every = log_every
        self.histogram_every = histogram_every
        self.bandwidths_gbps = [float(b) for b in bandwidths]
        self.latency_ms = float(latency_ms)
        self.divergence_every = divergence_every
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.totals: dict[str, float] = self._zero_totals()
        self.last_metrics: dict[str, float] = {}
        self.summary: dict[str, Any] = {}
        self.final_metrics: dict[str, float] = {}
        self._baseline_curve: list[tuple[int, float]] = []
        self._ledger: Optional[ByteLedger] = None
        self._seen_steps = 0
        self._groups: dict[Tensor, str] = {}
        self._divergence_every: Optional[int] = None

    def _zero_totals(self) -> dict[str, float]:
        totals = {"steps": 0.0, "sent_bytes": 0.0, "received_bytes": 0.0, "ddp_bytes": 0.0, "inter_node_bytes": 0.0,
                  "ddp_inter_node_bytes": 0.0, "modeled_seconds/links": 0.0, "ddp_modeled_seconds/links": 0.0}
        for b in self.bandwidths_gbps:
            totals[f"modeled_seconds/{b:g}Gbps"] = 0.0
            totals[f"ddp_modeled_seconds/{b:g}Gbps"] = 0.0
        return totals

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        ledger = getattr(trainer.strategy, "ledger", None)
        if not isinstance(ledger, ByteLedger):
            raise ValueError(
                f"CommunicationMonitor reads the byte ledger of our strategies, but {type(trainer.strategy).__name__} has "
                "none: use Trainer(strategy='demo') or 'desloc', or remove the callback"
            )
        self._ledger = ledger
        self._seen_steps = ledger.steps
        self.totals = self._zero_totals()  # a resumed fit restores them after setup
        self._baseline_curve = self._load_baseline(trainer) if self.baseline is not None else []

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.summary = {}
        kinds = layer_kinds(pl_module)
        self._groups = {p: _GROUP_OF_KIND[kinds[name]] for p, name in named_trainable(pl_module).items()}
        desloc = bool(getattr(trainer.strategy, "averagers", []))
        self._divergence_every = self.divergence_every if self.divergence_every is not None else (50 if desloc else None)
        self.final_metrics = {}
        self._start_dashboard(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # the exchange measures energy only on request: ask for it in the steps whose metrics are logged
        if (trainer.global_step + 1) % self.log_every == 0:
            for exchange in exchanges_of(trainer):
                exchange.request_energy()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        ledger = self._ledger
        if ledger is None or ledger.steps == self._seen_steps or ledger.last_step is None:
            return  # no optimizer step closed since the last look (gradient accumulation)
        self._seen_steps = ledger.steps
        traffic, records = ledger.last_step, list(ledger.step_records)
        comm = communicator_of(trainer)
        world = comm.world_size if comm is not None else 1
        n_trainable = sum(p.numel() for p in self._groups)
        t = self.totals
        t["steps"] += 1
        t["sent_bytes"] += traffic.sent_bytes
        t["received_bytes"] += traffic.received_bytes
        t["ddp_bytes"] += traffic.ddp_bytes
        latency = self.latency_ms / 1000
        modeled = {}
        for b in self.bandwidths_gbps:
            ours = modeled_seconds(records, b, latency)
            ddp = self._ddp_seconds(traffic.ddp_bytes, n_trainable, world, b, latency)
            t[f"modeled_seconds/{b:g}Gbps"] += ours
            t[f"ddp_modeled_seconds/{b:g}Gbps"] += ddp
            modeled[f"comm/modeled_seconds_per_step/{b:g}Gbps"] = ours
            modeled[f"comm/ddp_modeled_seconds_per_step/{b:g}Gbps"] = ddp
        t["inter_node_bytes"] += traffic.inter_node_bytes
        t["ddp_inter_node_bytes"] += traffic.ddp_inter_node_bytes
        if self.inter_gbps is not None and self.intra_gbps is not None:
            per_node = comm.topology.ranks_per_node if comm is not None else 1
            ours = link_seconds(records, per_node, self.inter_gbps, self.intra_gbps, latency)
            ddp = ddp_link_seconds(traffic.ddp_bytes, traffic.ddp_inter_node_bytes, n_trainable, world, per_node,
                                   self.inter_gbps, self.intra_gbps, latency, self.bucket_cap_mb)
            t["modeled_seconds/links"] += ours
            t["ddp_modeled_seconds/links"] += ddp
            modeled["comm/modeled_seconds_per_step/links"] = ours
            modeled["comm/ddp_modeled_seconds_per_step/links"] = ddp
        step = int(trainer.global_step)
        metrics: dict[str, float] = {}
        if step % self.log_every == 0:
            by_tag: dict[str, float] = defaultdict(float)
            for r in records:
                by_tag[r.tag] += r.sent_bytes
            metrics.update({f"comm/step_sent_bytes/{tag}": v for tag, v in by_tag.items()})
            metrics.update(modeled)
            metrics["comm/cumulative_sent_bytes"] = t["sent_bytes"]
            metrics["comm/cumulative_received_bytes"] = t["received_bytes"]
            metrics["comm/cumulative_ratio_vs_ddp"] = _ratio(t["ddp_bytes"], t["sent_bytes"])
            metrics["comm/cumulative_inter_node_ratio_vs_ddp"] = _ratio(t["ddp_inter_node_bytes"], t["inter_node_bytes"])
            metrics.update(self._exchange_metrics(trainer))
            metrics["comm/monitor_bytes"] = sum(v.sent_bytes for k, v in ledger.totals.items() if k.startswith("monitor/"))
        if self._divergence_every and step % self._divergence_every == 0:
            metrics["desloc/replica_divergence"] = self._divergence(trainer, pl_module)
        if metrics:
            self.last_metrics = metrics
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        if self.histogram_every and step % self.histogram_every == 0:
            self._histograms(trainer, step)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        t = self.totals
        steps = max(1.0, t["steps"])
        self.summary = {
            "optimizer_steps": int(t["steps"]),
            "sent_bytes_per_step": t["sent_bytes"] / steps,
            "received_bytes_per_step": t["received_bytes"] / steps,
            "ratio_vs_ddp": _ratio(t["ddp_bytes"], t["sent_bytes"]),
            "modeled_seconds": {b: t[f"modeled_seconds/{b:g}Gbps"] for b in self.bandwidths_gbps},
            "ddp_modeled_seconds": {b: t[f"ddp_modeled_seconds/{b:g}Gbps"] for b in self.bandwidths_gbps},
            "inter_node_bytes_per_step": t["inter_node_bytes"] / steps,
            "inter_node_ratio_vs_ddp": _ratio(t["ddp_inter_node_bytes"], t["inter_node_bytes"]),
            "links": None if self.inter_gbps is None else (t["modeled_seconds/links"], t["ddp_modeled_seconds/links"]),
            "by_tag": {tag: (v.calls, v.sent_bytes) for tag, v in (self._ledger.totals.items() if self._ledger else [])},
        }
        self.final_metrics = self._final_metrics(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(self.final_metrics, step=int(trainer.global_step))
        self._end_dashboard(trainer)
        if trainer.is_global_zero:
            rank_zero_info(self.format_summary())

    # ------------------------------------------------------------------ dashboard
    def dashboard_layout(self, trainer: Trainer) -> dict[str, dict[str, list[Any]]]:
        """The Custom Scalars layout (``{category: {chart title: ["Multiline", [tag regexes]]}}``,
        :meth:`torch.utils.tensorboard.SummaryWriter.add_custom_scalars`) for this fit: only charts
        of scalars that this configuration logs."""
        loss = re.escape(self.loss_tag) + "(_step)?$"
        charts: dict[str, list[Any]] = {}
        if self.baseline is not None:
            charts["loss vs DDP baseline"] = ["Multiline", [loss, re.escape(BASELINE_PREFIX + self.loss_tag) + "$"]]
        else:
            charts["loss"] = ["Multiline", [loss]]
        charts["bytes sent per step, by tag"] = ["Multiline", ["comm/step_sent_bytes/", "comm/bytes_sent_per_step$"]]
        ratios = ["comm/cumulative_ratio_vs_ddp$"]
        comm = communicator_of(trainer)
        if comm is not None and comm.topology.num_nodes > 1:
            ratios.append("comm/cumulative_inter_node_ratio_vs_ddp$")
        charts["cumulative ratio vs DDP (bytes)"] = ["Multiline", ratios]
        links = [f"{b:g}Gbps" for b in self.bandwidths_gbps] + (["links"] if self.inter_gbps is not None else [])
        for link in links:
            title = (
                f"modeled link time per step, {self.inter_gbps:g} Gbit/s between nodes, {self.intra_gbps:g} inside"
                if link == "links" else f"modeled link time per step at {link[:-4]} Gbit/s"
            )
            charts[title + ", ours vs DDP"] = [
                "Multiline", [re.escape(f"comm/{who}modeled_seconds_per_step/{link}") + "$" for who in ("", "ddp_")],
            ]
        if exchanges_of(trainer):
            charts["momentum energy captured, by layer group"] = ["Multiline", ["demo/energy_captured/"]]
            charts["keep ratio"] = ["Multiline", ["demo/keep_ratio$"]]
        if self._divergence_every:
            charts["replica divergence"] = ["Multiline", ["desloc/replica_divergence$"]]
        charts["skipped optimizer steps (non-finite)"] = ["Multiline", ["guard/skipped_steps$"]]
        return {DASHBOARD: charts}

    def run_hyperparameters(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, HParamValue]:
        """The run's hyperparameters for the HParams tab, numbers and strings only.

        The strategy's (``strategy``, ``world_size``, ``num_nodes``, ``ranks_per_node``,
        ``hierarchy``, ``nonfinite``; ``demo/<setting>`` for every DeMo setting as the exchange runs it, ``topk`` with its
        default resolved for the exchange's number of workers; ``desloc/<setting>`` for every DES-LOC one; ``"None"`` for what this
        strategy does not use, so every run has the same columns), the trainer's
        (``trainer/accumulate_grad_batches``, ``trainer/precision``), then the module's and the
        datamodule's ``hparams`` as ``model/*`` and ``data/*``.
        """
        strategy = trainer.strategy
        comm = communicator_of(trainer)
        out: dict[str, HParamValue] = {
            "strategy": getattr(strategy, "strategy_name", "") or type(strategy).__name__,
            "world_size": int(trainer.world_size),
            "num_nodes": comm.topology.num_nodes if comm is not None else int(trainer.num_nodes),
            "ranks_per_node": comm.topology.ranks_per_node if comm is not None else int(trainer.num_devices),
            "hierarchy": _hparam_value(getattr(strategy, "hierarchy", None)),
            "nonfinite": _hparam_value(getattr(strategy, "nonfinite", None)),
        }
        demo: Optional[DeMoConfig] = getattr(strategy, "demo_config", None)
        exchanges = exchanges_of(trainer)
        if demo is not None and exchanges:
            demo = exchanges[0].config  # the settings in force: the default k resolved for the exchange's workers
        for f in fields(CodecConfig):
            out[f"demo/{f.name}"] = _hparam_value(getattr(demo.codec, f.name) if demo is not None else None)
        if demo is not None:
            topk, keep_ratio = demo.codec.strength
            out["demo/topk"], out["demo/keep_ratio"] = _hparam_value(topk), _hparam_value(keep_ratio)
        for f in fields(DeMoConfig):
            if f.name != "codec":
                out[f"demo/{f.name}"] = _hparam_value(getattr(demo, f.name) if demo is not None else None)
        desloc: Optional[DesLocConfig] = getattr(strategy, "desloc_config", None)
        for f in fields(DesLocConfig):
            value = getattr(desloc, f.name) if desloc is not None else None
            if f.name == "codec" and desloc is not None and not desloc.compress_params:
                value = None  # unused
            out[f"desloc/{f.name}"] = _hparam_value(value)
        out["trainer/accumulate_grad_batches"] = int(trainer.accumulate_grad_batches)
        out["trainer/precision"] = str(trainer.precision)
        out.update(_flat_hparams("model/", pl_module.hparams))
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None and getattr(datamodule, "hparams", None):
            out.update(_flat_hparams("data/", datamodule.hparams))
        return out

    def _start_dashboard(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Rank 0: the layout, the hyperparameters and the baseline's loss into every TensorBoard run."""
        writers = self._writers(trainer)
        if not writers:
            return
        from torch.utils.tensorboard.summary import hparams

        layout = self.dashboard_layout(trainer)
        # metric names only: their values are the scalars of the same names, logged at fit end
        experiment, session_start, _ = hparams(self.run_hyperparameters(trainer, pl_module), dict.fromkeys(self._final_names(), 0.0))
        for writer in writers:
            writer.add_custom_scalars(layout)
            # before Lightning's own log_hyperparams (it runs after on_fit_start): TensorBoard keeps a run's first
            writer._get_file_writer().add_summary(experiment)
            writer._get_file_writer().add_summary(session_start)
            for step, value in self._baseline_curve:
                writer.add_scalar(BASELINE_PREFIX + self.loss_tag, value, step)
            writer.flush()

    def _end_dashboard(self, trainer: Trainer) -> None:
        """Rank 0: the HParams session's end (status: success) into every TensorBoard run."""
        writers = self._writers(trainer)
        if not writers:
            return
        from torch.utils.tensorboard.summary import hparams

        _, _, session_end = hparams({}, {})
        for writer in writers:
            writer._get_file_writer().add_summary(session_end)
            writer.flush()

    def _final_names(self) -> list[str]:
        names = ["loss", "ratio_vs_ddp", "sent_bytes", "sent_bytes_per_step", "optimizer_steps", "skipped_steps"]
        names += [f"modeled_seconds/{b:g}Gbps" for b in self.bandwidths_gbps]
        if self.inter_gbps is not None:
            names.append("modeled_seconds/links")
        return [FINAL_PREFIX + n for n in names]

    def _final_metrics(self, trainer: Trainer) -> dict[str, float]:
        t, s = self.totals, self.summary
        final = {
            "ratio_vs_ddp": float(s["ratio_vs_ddp"]),
            "sent_bytes": t["sent_bytes"],
            "sent_bytes_per_step": float(s["sent_bytes_per_step"]),
            "optimizer_steps": t["steps"],
            "skipped_steps": float(getattr(trainer.strategy, "skipped_steps", 0)),
        }
        final.update({f"modeled_seconds/{b:g}Gbps": t[f"modeled_seconds/{b:g}Gbps"] for b in self.bandwidths_gbps})
        if self.inter_gbps is not None:
            final["modeled_seconds/links"] = t["modeled_seconds/links"]
        for tag in (self.loss_tag, f"{self.loss_tag}_step"):
            loss = trainer.callback_metrics.get(tag)
            if loss is not None:
                final["loss"] = float(loss)
                break
        return {FINAL_PREFIX + k: v for k, v in final.items()}

    def _load_baseline(self, trainer: Trainer) -> list[tuple[int, float]]:
        """Rank 0 reads the baseline; every rank gets its verdict, so all raise together (or none)."""
        assert self.baseline is not None
        curve: list[tuple[int, float]] = []
        error: Optional[str] = None
        if trainer.is_global_zero:
            try:
                curve = read_baseline(self.baseline, self.loss_tag)
            except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
                error = str(e) if isinstance(e, ValueError) else f"baseline={str(self.baseline)!r}: {type(e).__name__}: {e}"
        error = trainer.strategy.broadcast(error, src=0)
        if error is not None:
            raise ValueError(f"CommunicationMonitor: {error}")
        if not any(isinstance(lg, TensorBoardLogger) for lg in trainer.loggers):
            rank_zero_warn(
                "CommunicationMonitor(baseline=...) draws the baseline in TensorBoard, but the Trainer has no "
                "TensorBoardLogger: add logger=TensorBoardLogger(...) or drop baseline="
            )
        return curve

    def _writers(self, trainer: Trainer) -> list["SummaryWriter"]:
        """Rank 0's TensorBoard writers (elsewhere ``logger.experiment`` is a no-op stand-in)."""
        if not trainer.is_global_zero:
            return []
        return [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]

    # ------------------------------------------------------------------ measurements
    def _ddp_seconds(self, ddp_bytes: float, n_trainable: int, world: int, bandwidth: float, latency: float) -> float:
        return ddp_modeled_seconds(ddp_bytes, n_trainable, world, bandwidth, latency, self.bucket_cap_mb)

    def _exchange_metrics(self, trainer: Trainer) -> dict[str, float]:
        exchanges = exchanges_of(trainer)
        if not exchanges:
            return {}
        groups = sorted(set(self._groups.values()))
        energy = [0.0] * (2 * len(groups) + 2)  # summed on the host: the stats are Python numbers already
        for ex in exchanges:
            for p, e in zip(ex.stats.exchanged, ex.stats.energy):
                g = groups.index(self._groups.get(p, "other"))
                energy[2 * g] += e.captured
                energy[2 * g + 1] += e.total
            energy[-2] += ex.stats.coefficients
            energy[-1] += ex.stats.tiled_elements
        comm = communicator_of(trainer)
        if comm is not None and comm.world_size > 1:
            # one small all-reduce on the communicator's device (NCCL takes no CPU tensor), one host read
            summed = torch.tensor(energy, dtype=torch.float64, device=comm.device)
            comm.all_reduce_sum_(summed, "monitor/reduce").wait()
            energy = summed.cpu().tolist()
        out = {f"demo/energy_captured/{g}": energy[2 * i] / energy[2 * i + 1] for i, g in enumerate(groups) if energy[2 * i + 1] > 0}
        if energy[-1] > 0:
            out["demo/keep_ratio"] = energy[-2] / energy[-1]
        return out

    @torch.no_grad()
    def _divergence(self, trainer: Trainer, pl_module: LightningModule) -> float:
        comm = communicator_of(trainer)
        if comm is None or comm.world_size == 1:
            return 0.0
        params = [p for p in pl_module.parameters() if p.requires_grad]
        # on the communicator's device (where Lightning keeps the parameters: no copy); one host read
        local = torch.cat([p.detach().reshape(-1).to(comm.device, torch.float64) for p in params])
        mean = local.clone()
        comm.all_reduce_sum_(mean, "monitor/divergence").wait()
        mean /= comm.world_size
        spread = torch.stack([(local - mean).pow(2).sum(), mean.pow(2).sum() / comm.world_size])
        comm.all_reduce_sum_(spread, "monitor/divergence").wait()
        spread_sum, norm2 = spread.cpu().tolist()
        variance = spread_sum / comm.world_size
        return math.sqrt(variance) / math.sqrt(norm2) if norm2 > 0 else 0.0

    @torch.no_grad()
    def _histograms(self, trainer: Trainer, step: int) -> None:
        writers = self._writers(trainer)
        exchanges = exchanges_of(trainer)
        if not writers or not exchanges:
            return
        coefficients: dict[str, list[Tensor]] = defaultdict(list)
        norms: dict[str, list[float]] = defaultdict(list)
        for ex in exchanges:
            chunk, transform = ex.config.codec.chunk, ex.config.codec.transform
            for p in ex.parameters():
                if not ex.has_momentum(p):
                    continue
                residual = ex.momentum(p)
                group = self._groups.get(p, "other")
                norms[group].append(float(residual.norm()))
                layout = plan_tiles(tuple(residual.shape), chunk)
                coefficients[group].append(tile_transform(to_tiles(residual.float(), layout), transform).abs().reshape(-1))
        for writer in writers:
            for group, values in coefficients.items():
                writer.add_histogram(f"demo/dct_abs/{group}", torch.cat(values), step)
                writer.add_histogram(f"demo/residual_norm/{group}", torch.tensor(norms[group]), step)

    # ------------------------------------------------------------------ summary
    def format_summary(self) -> str:
        """The fit-end summary as text (a rich table when ``rich`` is installed)."""
        s = self.summary
        if not s:
            return "CommunicationMonitor: no optimizer step recorded"
        rows = [
            ("optimizer steps", f"{s['optimizer_steps']}"),
            ("bytes sent / step / worker", f"{s['sent_bytes_per_step']:,.0f}"),
            ("bytes received / step / worker", f"{s['received_bytes_per_step']:,.0f}"),
            ("ratio vs DDP (bytes)", f"{s['ratio_vs_ddp']:.1f}x"),
        ]
        if s["inter_node_bytes_per_step"] > 0:
            rows.append(("inter-node bytes / step / worker", f"{s['inter_node_bytes_per_step']:,.0f}"))
            rows.append(("ratio vs DDP (inter-node bytes)", f"{s['inter_node_ratio_vs_ddp']:.1f}x"))
        for b, secs in s["modeled_seconds"].items():
            ddp = s["ddp_modeled_seconds"][b]
            rows.append((f"modeled comm time at {b:g} Gbit/s", f"{secs:.2f} s (DDP {ddp:.2f} s)"))
        if s["links"] is not None:
            rows.append((f"modeled comm time, {self.inter_gbps:g} Gbit/s between nodes, {self.intra_gbps:g} inside",
                         f"{s['links'][0]:.2f} s (DDP {s['links'][1]:.2f} s)"))
        for tag, (calls, sent) in sorted(s["by_tag"].items()):
            rows.append((f"  {tag}", f"{calls} calls, {sent:,.0f} B sent"))
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            width = max(len(r[0]) for r in rows)
            return "Communication summary\n" + "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
        table = Table(title="Communication summary")
        table.add_column("quantity")
        table.add_column("value", justify="right")
        for k, v in rows:
            table.add_row(k, v)
        console = Console(record=True, width=100)
        with console.capture() as capture:
            console.print(table)
        return capture.get()

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        totals = self._zero_totals()
        totals.update({k: float(v) for k, v in state_dict.get("totals", {}).items() if k in totals})
        self.totals = totals


def _ratio(ddp: float, ours: float) -> float:
    return ddp / ours if ours > 0 else (1.0 if ddp == 0 else float("inf"))
