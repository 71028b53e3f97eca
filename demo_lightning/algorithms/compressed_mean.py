"""Mean over workers of a list of dense tensors, sent through the DeMo codec (DES-LOC's compressed sync).

The stages of :mod:`~demo_lightning.algorithms.stages` composed for inputs that are plain tensors
(parameter changes), where the caller keeps its own error feedback in parameter space. For each
input ``x`` on each worker::

    K       = DCT(pad(x))                         # encode: transform into the family's storage
    (I, V)  = select(K, k)                        # top-k by magnitude, or the k lowest frequencies
    V^      = wire(V)                             # transport: the value format, as receivers decode it
    sent    = IDCT(scatter(I, V^))[:R, :C]        # what this worker contributed (for error feedback)
    mean    = IDCT(sum_{r=0..W-1} scatter(I_r, V^_r) / W)[:R, :C]

``DCT`` is the codec's ``transform`` (``"dct"``, ``"haar"`` or ``"identity"``: see
:mod:`~demo_lightning.codec.bases`). Tensors the codec sends densely (fewer than ``dense_below`` elements, or 1-D under ``dense_vectors``) skip it: ``mean`` is an all-reduce of ``x``
in ``dense_format`` (bfloat16 by default, or the compute dtype) divided by W, and ``sent`` is ``x``
as that format rounded it (``x`` itself under ``"fp32"``). The DeMo exchange
(:class:`~demo_lightning.algorithms.DeMoExchange`) runs the same stages on its momentum, which it
keeps in coefficient space instead.

Determinism and exactness: see :mod:`~demo_lightning.algorithms.stages.decode`.

Profiling: the stages run inside the stage ranges ``codec/encode`` (``codec/encode/transform``,
``codec/encode/select``), ``codec/transport`` (``codec/transport/pack``, the launches and the waits),
``codec/decode`` (``codec/decode/scatter_add``, ``codec/decode/inverse``: both inverses, the mean's and
what was sent). The contributions are unpacked as the sums draw them, so ``codec/transport/unpack``
nests inside ``codec/decode/scatter_add`` (:mod:`~demo_lightning.profiling`: its exclusive time
leaves the unpacking out).

Failure: the plan (count, sizes, per-tensor settings) is compared across workers whenever it is
rebuilt; a mismatch raises ``RuntimeError`` on every rank before any data moves. A collective that
cannot complete raises after the process group's timeout, and nothing is returned.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from demo_lightning.algorithms.config import CodecConfig, TensorCodec
from demo_lightning.algorithms.stages import (
    ExchangePlan,
    Outgoing,
    Workspace,
    accumulate,
    build_plan,
    inverse,
    select,
    transform_into,
    transport_for,
    zeroed_means,
)
from demo_lightning.comm import Communicator
from demo_lightning.profiling import CODEC, stage_range

__all__ = ["CompressedMean"]


class CompressedMean:
    """Average tensors over workers through the DeMo codec (see the module docstring).

    Args:
        config: codec settings.
        communicator: collectives and their ledger.
    """

    def __init__(self, config: CodecConfig, communicator: Communicator) -> None:
        self.config = config
        self.comm = communicator
        self.transport = transport_for(config, communicator, names=CODEC)
        self._plan: Optional[ExchangePlan] = None
        self._plan_key: Optional[tuple] = None
        self._workspace: Optional[Workspace] = None

    def drop_workspace(self) -> None:
        """Release the cached plan and its scratch buffers (they are rebuilt, and the plan compared
        across ranks, at the next call: every rank must drop them alike)."""
        self._plan, self._plan_key, self._workspace = None, None, None

    def plan(self, tensors: list[Tensor], overrides: Optional[list[Optional[TensorCodec]]] = None) -> ExchangePlan:
        """The (cached) plan for these shapes and settings; rebuilding it compares it across ranks
        (a collective: every rank rebuilds at the same call)."""
        key = tuple((tuple(x.shape), x.dtype, x.device, o) for x, o in zip(tensors, overrides or [None] * len(tensors)))
        if self._plan is None or key != self._plan_key:
            plan = build_plan(self.config, tensors, overrides)
            self.comm.check_same(
                plan.fingerprint(), "codec/fingerprint",
                "the list of tensors to average (count, sizes, compute dtypes), or their per-tensor codec settings (k, chunk, dense)",
            )
            self._plan, self._plan_key, self._workspace = plan, key, Workspace(plan)
        return self._plan

    @torch.no_grad()
    def __call__(
        self, inputs: list[Tensor], tag: str, overrides: Optional[list[Optional[TensorCodec]]] = None
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Return ``(mean over workers, what this worker sent)`` for every input, in the compute dtype."""
        plan = self.plan(inputs, overrides)
        workspace = self._workspace
        assert workspace is not None
        world = self.comm.world_size
        mean_out: list[Optional[Tensor]] = [None] * len(inputs)
        sent_out: list[Optional[Tensor]] = [None] * len(inputs)

        with stage_range(CODEC.transport):
            dense_pending = []
            for (dtype, _), group in plan.dense_groups.items():
                flat = torch.cat([inputs[i.position].reshape(-1).to(self.config.dense_dtype(dtype)) for i in group])
                sent = flat.to(dtype, copy=True)  # what this worker contributes, as the wire format rounded it
                dense_pending.append((group, flat, sent, self.comm.all_reduce_sum_(flat, f"{tag}/dense")))

        with stage_range(CODEC.encode):
            spectra = {key: torch.empty(f.numel, dtype=f.dtype, device=f.device) for key, f in plan.families.items()}
            with stage_range(CODEC.transform):
                transform_into(plan, inputs, spectra, workspace)
            with stage_range(CODEC.select):
                selected = {key: select(f, spectra[key], self.config.selection, workspace.family(f), self.config.strongest_first)
                            for key, f in plan.families.items()}
        with stage_range(CODEC.transport):
            pending = [
                self.transport.start([Outgoing(run, *(getattr(selected[run.family.key], a)[run.rows] for a in ("positions", "values")))
                                      for run in bucket], tag)
                for bucket in plan.buckets
            ]
            for *_, work in dense_pending:
                work.wait()

        def keep(out: list[Optional[Tensor]]):  # type: ignore[no-untyped-def]
            def write(item, tensor):  # type: ignore[no-untyped-def]
                out[item.position] = tensor.reshape(item.shape).clone()
            return write

        with stage_range(CODEC.decode):
            for group, flat, sent, _ in dense_pending:
                total = flat.to(sent.dtype).div_(world)
                sizes = [i.numel for i in group]
                for item, part, own in zip(group, torch.split(total, sizes), torch.split(sent, sizes)):
                    mean_out[item.position] = part.view(item.shape)
                    sent_out[item.position] = own.view(item.shape)
            means = zeroed_means(plan, workspace)
        for waiting in pending:  # bucket by bucket: later buckets stay in flight while earlier ones are summed
            with stage_range(CODEC.transport):
                waiting.wait()
            with stage_range(CODEC.decode), stage_range(CODEC.scatter_add):
                accumulate(means, waiting.contributions(), selected)  # unpacks as it sums (codec/transport/unpack)
        with stage_range(CODEC.decode):
            with stage_range(CODEC.inverse):
                inverse(plan, means, workspace, 1.0 / world, keep(mean_out))
            # what this worker sent: its decoded values alone, through the same inverse
            for key, family in plan.families.items():
                spectra[key].zero_()
            for bucket, waiting in zip(plan.buckets, pending):
                for run, decoded in zip(bucket, waiting.sent):
                    spectra[run.family.key].index_copy_(0, selected[run.family.key].offsets[run.rows].reshape(-1), decoded.reshape(-1))
            with stage_range(CODEC.inverse):
                inverse(plan, spectra, workspace, 1.0, keep(sent_out))
        return [t for t in mean_out if t is not None], [t for t in sent_out if t is not None]
