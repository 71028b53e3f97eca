"""Shared Lightning glue of the communication-efficient strategies.

``DDPStrategy`` gives launching, process groups, ranks and the distributed sampler; this base
removes the ``DistributedDataParallel`` wrapper (no gradient all-reduce) and runs, per optimizer
step, an optional DeMo exchange (before the update) and optional DES-LOC averaging (after it).

Checkpoints: rank 0 writes Lightning's file (weights, rank 0's optimizer state, loops); every rank
writes its own state to its own shard beside it, ``<ckpt>.shards/rank<r>.pt`` (its DeMo momenta,
and with DES-LOC its parameters, buffers, full optimizer state and schedule position), so no rank
ever holds another rank's state and no collective runs while saving. The main file's optimizer
entries carry only the layout under ``"demo_lightning"`` (``{"layout": "shards", "world_size": W,
...}``; see :mod:`demo_lightning.strategies.shards`). On resume each rank reads only its own shard
(a missing or stale one raises :class:`~demo_lightning.strategies.shards.CheckpointShardError` on
every rank). A checkpoint from another world size restores the shared parts and restarts the
per-rank parts (warned): DeMo momenta from zero, the DES-LOC schedule from rank 0's shard.
Checkpoints of the earlier gathered layout (every rank's state in ``"per_rank"`` of the main file)
still load as before.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Optional, Union

import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from demo_lightning.comm import human_bytes
from demo_lightning.profiling import SinkHandle, add_sink, lightning_sink
from demo_lightning.strategies.front import CommunicationFront
from demo_lightning.strategies.options import HIERARCHIES, Hierarchy, StartMethod, as_timedelta  # noqa: F401  (also importable from here)
from demo_lightning.strategies.runtime import CHECKPOINT_KEY, record_of, strip_record
from demo_lightning.strategies.shards import SHARDS_LAYOUT, remove_shard, shard_dir_name

__all__ = ["CommunicationStrategy", "as_timedelta", "name_shards"]


def _unwrap(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _stamp(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What ties a Trainer checkpoint's shards to its main file."""
    return {"global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}


def name_shards(states: list[Any], entries: list[Optional[dict[str, Any]]], filepath: _PATH) -> list[Any]:
    """The optimizer entries of the main file, each with a shard entry naming the shard directory."""
    name = shard_dir_name(filepath)
    named = [{**s, CHECKPOINT_KEY: {**s[CHECKPOINT_KEY], "shards": name}} if e is not None else s for s, e in zip(states, entries)]
    return named + states[len(named):]


PROGRESS_BAR_KEY = "comm/sent"


class _ProgressBarTraffic:
    """A progress bar's ``get_metrics``, plus this step's bytes sent as a human size.

    Lightning logs numbers only, so ``comm/bytes_sent_per_step`` is logged as a number (for
    TensorBoard and ``callback_metrics``) and kept off the bar; the text
    (``comm/sent=62.4 kB/step``, :func:`~demo_lightning.comm.ledger.human_bytes`) is added where
    Lightning builds the bar's items, :meth:`ProgressBar.get_metrics` (its documented override
    point), by wrapping that method on the trainer's bar instance. Works for any bar (tqdm, rich,
    a subclass: its own ``get_metrics`` runs first); adds nothing before the first optimizer step.
    """

    def __init__(self, get_metrics: Callable[[Trainer, LightningModule], dict[str, Any]], strategy: "CommunicationStrategy") -> None:
        self.get_metrics = get_metrics
        self.strategy = strategy

    def __call__(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = dict(self.get_metrics(trainer, pl_module))
        traffic = self.strategy.last_traffic
        if traffic is not None:
            items[PROGRESS_BAR_KEY] = f"{human_bytes(traffic.sent_bytes)}/step"
        return items

    @classmethod
    def install(cls, bar: ProgressBar, strategy: "CommunicationStrategy") -> None:
        """Wrap ``bar.get_metrics`` once; a later setup (another fit, a validate) re-points it at ``strategy``."""
        current = bar.get_metrics
        if isinstance(current, cls):
            current.strategy = strategy
        else:
            bar.get_metrics = cls(current, strategy)  # type: ignore[method-assign]


class CommunicationStrategy(CommunicationFront, DDPStrategy):
    """Base of ``DeMoStrategy`` and ``DesLocStrategy`` (not registered itself).

    The algorithms' per-process state and step live in :attr:`runtime`
    (:class:`~demo_lightning.strategies.runtime.CommunicationRuntime`, shared with the Fabric
    strategies); this class connects it to the Trainer's hooks, logging and checkpoints.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "CommunicationStrategy is the base of DeMoStrategy and DesLocStrategy, not a strategy itself: construct one "
            "of those (their options build the configs)"
        )

    @override
    def _init_parallel(self, **settings: Any) -> None:
        DDPStrategy.__init__(self, **settings)

    # ------------------------------------------------------------------ setup
    @override
    def setup_distributed(self) -> None:
        """DDP's process group, then the runtime's topology and node groups
        (:meth:`CommunicationRuntime.connect`: the group this strategy created is destroyed at
        interpreter exit whatever its backend; Lightning registers that for NCCL only)."""
        created = not dist.is_initialized()
        super().setup_distributed()
        self.runtime.connect(created_group=created, device=self.root_device, global_rank=self.global_rank,
                             node_rank=self.node_rank, local_rank=self.local_rank, num_processes=self.num_processes)

    @override
    def setup(self, trainer: Trainer) -> None:
        self._refuse_fp16_with_scaler(isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None)
        self.runtime.reset_communicator(self.root_device)
        super().setup(trainer)
        self._report_stages_to(trainer)
        if trainer.progress_bar_callback is not None:
            _ProgressBarTraffic.install(trainer.progress_bar_callback, self)
        if trainer.state.fn == TrainerFn.FITTING:
            _warn_if_compile_misses_training_step(self.lightning_module)
            self._attach()

    _stage_sink: Optional[SinkHandle] = None

    def _report_stages_to(self, trainer: Trainer) -> None:
        """Report the exchange's and the averaging's stage ranges (:mod:`demo_lightning.profiling`) to
        the Trainer's profiler as actions of its own (``SimpleProfiler``, ``AdvancedProfiler``: e.g.
        ``demo/encode``); ``PyTorchProfiler`` records them as ``record_function`` ranges already."""
        if self._stage_sink is not None:
            self._stage_sink.remove()
        sink = lightning_sink(trainer.profiler)
        self._stage_sink = add_sink(sink) if sink is not None else None

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: gradients are never all-reduced. Replicas start from rank 0.
        assert self.model is not None
        self.communicator.broadcast_tensors_([*self.model.parameters(), *self.model.buffers()], "setup/broadcast_module")

    def _attach(self) -> None:
        self.runtime.detach()
        assert self.model is not None
        module = self.lightning_module
        trainer_clips = module is not None and module._trainer is not None and bool(module.trainer.gradient_clip_val)
        # clip_grad_norm="auto": the Trainer's gradient_clip_val, when set, is the only clipping (at the same point)
        front_end_clips = trainer_clips and self._clip_follows_trainer
        for position, optimizer in enumerate(map(_unwrap, self.optimizers)):
            buffers = list(self.model.buffers()) if position == 0 else []
            self.runtime.attach(optimizer, buffers, type(self).__name__, before_update=self._clip_local_gradients,
                                names={p: n for n, p in self.model.named_parameters()}, front_end_clips=front_end_clips)

    @override
    def on_train_end(self) -> None:
        """DES-LOC's final sync: every rank ends on the averaged parameters and buffers (``final_sync``).

        Not for an optimizer that a DeMo exchange drives: its replicas are identical at every step.
        """
        super().on_train_end()
        self.runtime.final_sync()

    @override
    def teardown(self) -> None:
        """Lightning's teardown moves the model and the optimizers' state to the CPU to free the
        accelerator; the exchanges' momenta and the averagers' state follow them
        (:meth:`CommunicationRuntime.follow_parameters`)."""
        self.runtime.close()
        if self._stage_sink is not None:
            self._stage_sink.remove()
            self._stage_sink = None
        super().teardown()
        self.runtime.follow_parameters()

    # ------------------------------------------------------------------ step
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Closure, guard, local clipping, exchange (DeMo), Lightning's hooks and the update, averaging (DES-LOC).

        Every rank runs the same collectives in the same order on every path: the guard's
        all-gather always; then either nothing more (a skipped step, a raise on every rank) or the
        exchange and the averaging.

        Gradient clipping: under DeMo, Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm``
        (through ``configure_gradient_clipping``) clips each worker's own gradient before it enters
        the momentum, and Lightning's usual clipping after ``on_before_optimizer_step`` (which would
        clip the shared update) is switched off; DES-LOC's ``clip_grad_norm`` runs at the same point.
        Under DES-LOC alone Lightning clips the local gradient as usual.

        Plan agreement: under DeMo the guard's all-gather also carries every rank's 8-byte plan
        digest (trainable tensors and their codec settings, :meth:`DeMoExchange.plan_digest`); if
        any differs, every rank runs the detailed check and raises the same ``RuntimeError`` before
        any data moves.

        Non-finite guard: after the closure (the loss it returns, ``None`` counting as finite, and
        every ``p.grad`` of ``optimizer``) all ranks agree, through one 1-byte-per-rank all-gather
        (9 bytes with the digest) run at every step, whether any rank saw a NaN or inf. If one did:

        * ``nonfinite="raise"``: every rank raises ``FloatingPointError`` naming the step, the ranks
          and the fix; nothing was updated.
        * ``nonfinite="skip"``: every rank drops its gradients (``p.grad = None``) and returns
          without the exchange, Lightning's ``on_before_optimizer_step`` hooks and clipping,
          ``optimizer.step()`` or DES-LOC averaging: parameters, optimizer state, DeMo residuals and
          the DES-LOC schedule position are unchanged on every rank. :attr:`skipped_steps` counts
          it (logged as ``guard/skipped_steps``, saved in checkpoints), :attr:`last_step_skipped` is
          set, rank 0 warns the first time. Lightning still counts the step: ``trainer.global_step``
          advances (Lightning 2.6 increments it after this method returns: the automatic loop's
          ``optim_progress`` after the ``optimizer_step`` hook, ``LightningOptimizer._on_after_step``
          under manual optimization) and step-interval LR schedulers step, as with the skipped steps
          of its own fp16 GradScaler; our counters (exchange steps, DES-LOC schedule) do not.

        Only the last micro-batch's loss is checked under gradient accumulation; a non-finite loss
        in an earlier micro-batch shows through the accumulated gradients.
        """
        raw = _unwrap(optimizer)
        if not self.runtime.manages(raw):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        exchange = self.runtime.exchange_of(raw)
        closure_result = closure()  # forward + backward of the last micro-batch

        def update() -> Any:
            with _without_lightning_clipping(self.precision_plugin) if exchange is not None else nullcontext():
                return super(CommunicationStrategy, self).optimizer_step(optimizer, lambda: closure_result, model, **kwargs)

        output = self.runtime.step(raw, update, closure_result, self._global_step())
        self._log_metrics()
        return output

    def _clip_local_gradients(self, optimizer: Optimizer) -> None:
        """Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm`` (through the module's
        ``configure_gradient_clipping`` hook) applied to this worker's own gradient, before the exchange."""
        module = self.lightning_module
        if module is None or module._trainer is None:
            return
        trainer = module.trainer
        self.precision_plugin._clip_gradients(
            module, optimizer, trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
        )

    def _global_step(self) -> Optional[int]:
        module = self.lightning_module
        return None if module is None or module._trainer is None else module._trainer.global_step

    def _log_metrics(self) -> None:
        """Log this step's bytes, the ratio to DDP over all steps so far (periodic syncs make a single
        step's ratio swing between infinity and a fraction) and the cumulative count of skipped steps
        (the same on every rank): :meth:`CommunicationRuntime.metrics`.

        The logged values are numbers (for TensorBoard and ``callback_metrics``); the progress bar
        shows this step's bytes sent as a human size instead (``comm/sent=62.4 kB/step``, added by
        :class:`_ProgressBarTraffic`, which :meth:`setup` installs)."""
        module = self.lightning_module
        if module is None or module._trainer is None:
            return
        module.log_dict(self.runtime.metrics(), on_step=True, on_epoch=False, batch_size=1, sync_dist=False)

    # ------------------------------------------------------------------ checkpoints
    _checkpoint_path: Optional[str] = None
    """The file :meth:`load_checkpoint` read last; :meth:`load_optimizer_state_dict` reads its shards."""

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state dict plus, for an optimizer with per-rank state, the layout record
        ``{"layout": "shards", "version", "world_size", "skipped_steps"}`` under ``"demo_lightning"``.

        No per-rank data and no collective: each rank's own state goes to its own shard file in
        :meth:`save_checkpoint` (rank 0's dict is the one written to the main file).
        """
        optimizer = _unwrap(optimizer)
        state = super().optimizer_state(optimizer)
        record = self.runtime.record(optimizer)
        return state if record is None else {**state, CHECKPOINT_KEY: record}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Every rank writes its own shard ``<filepath>.shards/rank<r>.pt``, then rank 0 writes the main file.

        Lightning calls this on every rank (``Trainer.save_checkpoint``, then a barrier); it runs no
        collective. A shard holds this rank's entry (:meth:`CommunicationRuntime.local_state`) for every optimizer whose
        checkpoint entry carries this strategy's record (none when ``weights_only``: no shard is then
        written), stamped with the rank, world size, global step and epoch of the main file; the main
        file's records name the shard directory (layout: :mod:`demo_lightning.strategies.shards`).

        Failure: the shard is written atomically (temporary file, then rename), so a save killed
        midway leaves the previous shard (or none) under the final name; an error writing it (disk
        full, no permission) propagates on this rank before rank 0 writes the main file.
        """
        states = list(checkpoint.get("optimizer_states") or [])
        entries = [
            self.runtime.local_state(_unwrap(optimizer)) if (record_of(state) or {}).get("layout") == SHARDS_LAYOUT else None
            for optimizer, state in zip(self.optimizers, states)
        ]
        if any(entry is not None for entry in entries):
            checkpoint = {**checkpoint, "optimizer_states": name_shards(states, entries, filepath)}
            self.runtime.write_shard(filepath, entries, _stamp(checkpoint))
            del entries
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 removes the main file (Lightning's); every rank removes its own shard of it, and the
        rank that removes the last one the then empty ``<filepath>.shards`` directory.

        ``ModelCheckpoint`` (``save_top_k``) calls this on every rank, without a barrier; no rank
        touches another rank's shard, so the ranks do not race. Nothing else is removed: a file the
        user put in the directory keeps it, and so do the shards of a rank that does not call this.
        """
        super().remove_checkpoint(filepath)
        remove_shard(filepath, self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's load of the main file (every rank reads it), remembering its path: the shards
        beside it are read by :meth:`load_optimizer_state_dict`, i.e. only when training state is restored
        (``fit``), not for ``validate`` / ``test`` / ``predict``."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._checkpoint_path = os.fspath(checkpoint_path)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore the optimizers from the main file, then each rank's own state.

        * Shards (this layout): at the saving world size each rank reads only its own shard
          ``<ckpt>.shards/rank<r>.pt`` and gets its state back bitwise. At another world size (warned
          once) parameters and rank 0's optimizer state come from the main file, DeMo momenta restart
          from zero (no shard is read), and under DES-LOC every rank reads rank 0's shard for the
          schedule position (and, with compressed sync, rank 0's anchor and residual).
        * Gathered (``"per_rank"`` in the main file, written before shards): as before, each rank takes
          entry ``rank`` at the saving world size, rank 0's schedule otherwise.

        Raises:
            CheckpointShardError: on every rank (one small all-gather agrees on it), if a shard a rank
                needs is missing, unreadable or from another save, naming the rank, the file and the fix
                (copy the ``.shards`` directory beside the checkpoint, or resume with only the weights).
                Never a silent restart from zero at the saving world size.
            ValueError: the saved per-worker parameters or buffers do not fit this model.
        """
        optimizer_states = checkpoint["optimizer_states"]
        records = [record_of(s) for s in optimizer_states]
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": [strip_record(s) for s in optimizer_states]})
        self.runtime.restore(self._checkpoint_path, list(map(_unwrap, self.optimizers)), records, _stamp(checkpoint))


def _warn_if_compile_misses_training_step(module: Optional[LightningModule]) -> None:
    """Warn when ``model.compile()`` was called on the LightningModule itself.

    That compiles only the module's ``__call__`` (its forward); Lightning calls ``training_step``
    directly, so only what ``training_step`` runs through ``self(...)`` is compiled, and a step that
    does not is silently eager. ``Trainer.fit(torch.compile(model))`` (Lightning's ``from_compiled``,
    which sets ``_compiler_ctx``) compiles ``training_step`` itself, and a compiled submodule
    (``self.net.compile()``) is compiled wherever it is called. Reads torch's private marker of an
    in-place compile, ``_compiled_call_impl``; without it (another torch) nothing is warned.
    """
    if module is None or module._compiler_ctx is not None or getattr(module, "_compiled_call_impl", None) is None:
        return
    rank_zero_warn(
        f"{type(module).__name__}.compile() compiles only the module's forward (its __call__), but Lightning calls "
        "training_step directly: only what training_step runs through self(...) is compiled, and a training_step that "
        "calls its layers itself runs eagerly. Pass torch.compile(model) to Trainer.fit instead (Lightning then compiles "
        "training_step), or compile the submodules training_step calls (e.g. self.net.compile())."
    )


@contextmanager
def _without_lightning_clipping(plugin: Precision) -> Iterator[None]:
    """Within the block, the precision plugin's gradient clipping (run after ``on_before_optimizer_step``)
    does nothing: under DeMo ``p.grad`` then holds the shared update, already made from clipped gradients."""
    plugin._clip_gradients = _no_clipping  # type: ignore[method-assign]
    try:
        yield
    finally:
        del plugin._clip_gradients


def _no_clipping(*args: Any, **kwargs: Any) -> None:
    return None


