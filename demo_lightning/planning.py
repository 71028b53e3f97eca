"""A cost model of one optimizer step's communication on ``N`` nodes of ``G`` ranks: bytes per link
class and a modelled step time, per method, from the parameter shapes alone (no process group).

Used by ``demo-lightning plan`` and ``benchmarks/scale.py``. The bytes are the ledger's
(:mod:`~demo_lightning.comm.ledger`): for each method the model lists the collectives one rank
launches in a step (:func:`modeled_collectives`: op, payload, group size, link class, the share of
its sent bytes charged to the inter-node link, :meth:`~demo_lightning.comm.topology.NodeTopology.inter_share`)
and sums their ring-model sent bytes exactly as :class:`~demo_lightning.comm.ByteLedger` does, so
the estimate equals a real exchange's ``ledger.last_step`` to the byte (``tests/test_planning.py``
checks every method, record by record, on 4 gloo processes posing as 2 nodes of 2).

Notation: ``W = N * G`` ranks, numbered node-major; ``n`` parameters in all; per tensor
``P = CodecConfig.payload_bytes(shape)`` (bit-packed positions and values; for a tensor the codec
sends densely by an all-reduce (under ``dense_below`` elements, or 1-D under ``dense_vectors``), ``b_d * numel`` with ``b_d`` the bytes of the
codec's ``dense_format``: 2 for bf16, the default, 4 for fp32); ``n_d`` the elements of the dense
tensors; ``P_c`` the sum of ``P`` over the compressed ones. Parameters are fp32 (4 bytes per element
for gradients and broadcast updates). Per rank per step, sent (= received) bytes:

``ddp``
    DDP's ring all-reduce of every gradient: ``2 (W-1)/W * 4 n``; inter-node: ``1/G`` of it when
    ``N > 1`` (the ring crosses each node's link once), else 0.
``flat``
    today's ``strategy="demo"`` (every rank a DeMo worker): ring all-gather of the payload over all
    ``W`` ranks, ``(W-1) * P_c`` (one all-gather per bucket of ``bucket_cap_mb``), plus the dense
    all-reduce ``2 (W-1)/W * b_d n_d``; inter share ``1/G`` when ``N > 1``. (A low-pass codec with a
    float value format all-reduces instead: ``2 (W-1)/W * P_c``.)
``hierarchical``
    ``DeMoStrategy(hierarchy="node")``: (a) the node's ``G`` gradients are averaged by one dense
    all-reduce over the node, ``2 (G-1)/G * 4 n``, intra-node; (b) the tensors are split among the
    ``G`` local ranks (:func:`shard`: greedily by payload, the same on every rank); local rank ``i``
    runs the DeMo exchange of its share ``P_i``, ``n_d,i`` over the ``N`` ranks of local index ``i``
    (one per node): ``(N-1) * P_i + 2 (N-1)/N * b_d n_d,i``, all of it inter-node (inter share 1: one
    member per node); (c) each local rank broadcasts the updates of its share to its node (fp32;
    ring broadcast: every rank but the one before the root forwards it). Mean per rank: inter
    ``(N-1) P_c / G + 2 (N-1)/N * b_d n_d / G``, intra ``2 (G-1)/G * 4 n + (G-1)/G * 4 n``.
``shared``
    ``selection="shared"`` (ScaleCom's cyclic local top-k): each step one rank, in turn, picks the
    positions from its own momentum and broadcasts them bit-packed over the ``W`` ranks (one
    broadcast of ``I``, the sum over tensors of ``positions_nbytes(T, k, tile)``); then every rank all-reduces its values at those positions in a float
    format (``V`` bytes, one all-reduce per bucket): ``(W-1)/W * I + 2 (W-1)/W * V`` (+ the dense
    all-reduce); the broadcast's root rotates, so its ``(W-1)/W`` is every rank's average over ``W``
    steps (``modeled_collectives(step=...)`` gives one step's exact root). Inter share ``1/G`` when
    ``N > 1``. About ``I + 2 V``: independent of ``W``. A codec with ``selection="shared"`` makes
    ``flat`` and ``hierarchical`` the shared ones.
``hierarchical+shared``
    both: (a) and (c) as ``hierarchical``, and in (b) each local rank runs the shared exchange of
    its share over the ``N`` ranks of its local index (inter share 1).

Link time: the node's link to the network is shared by its ``G`` ranks, so it carries the sum of
their inter-node bytes, ``G * inter_node_bytes`` (the ledger's mean per rank), each way:
``inter_seconds = 8 * G * inter_node_bytes / inter_bandwidth``; each rank has its own intra-node
link: ``intra_seconds = 8 * max_rank(intra bytes) / intra_bandwidth``. Latency: the
:class:`~demo_lightning.callbacks.CommunicationMonitor`'s hop model, ``W_g - 1`` hops for an
all-gather or a broadcast and ``2 (W_g - 1)`` for an all-reduce over a group of ``W_g`` ranks, each
hop costing the inter-node latency when the group spans nodes (a ring waits for its slowest edge)
and the intra-node latency otherwise; the busiest rank's sum (in ``hierarchical``, the local ranks'
inter-node exchanges run side by side). DDP's gradient is all-reduced in ``bucket_cap_mb`` buckets
(25, DDP's default), one ring per bucket, as in the monitor's ``ddp_modeled_seconds``.

``step_seconds = compute + inter_seconds + intra_seconds + latency_seconds``. Assumptions: ring
algorithms (NCCL's trees change the latency term, not the bytes); no overlap of computation and
communication, nor of the intra- and inter-node parts (pessimistic for a ring, whose intra and inter
edges run at once; exact for the hierarchical stages, which run one after the other); full-duplex
links (a ring's sent and received bytes move at once); no congestion beyond the node's link; fp32
parameters and gradients; the same shapes and settings on every rank. ``flat``, ``ddp`` and
``hierarchical`` (and the shared ones, where ``CodecConfig`` has ``selection="shared"``) are checked
record by record against the ledger of real ``DeMoExchange`` runs (``tests/test_planning.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Optional, get_args

from demo_lightning.algorithms.config import DEFAULT_TOPK, GATHERED_PER_TILE, MIN_DEFAULT_TOPK, WIRE_DTYPES, CodecConfig
from demo_lightning.codec import positions_nbytes, values_nbytes
from demo_lightning.comm.ledger import CollectiveOp, human_bytes, ring_all_gather_bytes, ring_all_reduce_bytes
from demo_lightning.comm.topology import Link, NodeTopology, split_by_payload
from demo_lightning.validation import check_choice, check_int, check_number

__all__ = [
    "METHODS",
    "Estimate",
    "Method",
    "ModeledCollective",
    "estimate",
    "estimate_all",
    "format_plan",
    "gpt_like_dims",
    "gpt_like_shapes",
    "how_to_run",
    "modeled_collectives",
    "pick",
    "shard",
    "strength_text",
]

Method = Literal["ddp", "flat", "hierarchical", "shared", "hierarchical+shared"]
METHODS: tuple[str, ...] = get_args(Method)
"""The methods, from the least to the most change to the algorithm of a flat DeMo run."""

SHARED_VALUE_FORMATS: tuple[str, ...] = tuple(WIRE_DTYPES)  # the formats an all-reduce can sum
"""Value formats an all-reduce can sum (the shared selection's values)."""

DEFAULT_SHARED_VALUE_FORMAT = "bf16"
"""The shared methods' value format when the codec's is not a float format (``"sign"``, ``"int8"``)."""

HOW_TO_RUN: dict[str, str] = {
    "ddp": 'Trainer(strategy="ddp")',
    "flat": 'Trainer(strategy="demo")',
    "hierarchical": 'DeMoStrategy(hierarchy="node")',
    "shared": 'DeMoStrategy(selection="shared", value_format="{fmt}")',
    "hierarchical+shared": 'DeMoStrategy(hierarchy="node", selection="shared", value_format="{fmt}")',
}
"""How each method is chosen in a Trainer (``{fmt}``: the estimate's value format)."""


def how_to_run(e: "Estimate") -> str:
    """:data:`HOW_TO_RUN` for this estimate."""
    return HOW_TO_RUN.get(e.method, e.method).format(fmt=e.value_format)


CAVEATS: dict[str, str] = {
    "ddp": "exact gradient mean every step (the baseline)",
    "flat": "DeMo as it is: every rank a DeMo worker",
    "hierarchical": "changes the algorithm: N DeMo workers, each the mean of its node's G gradients (a G times larger batch per worker)",
    "shared": "changes the algorithm: one rank per step picks the positions from its own momentum (others' top components wait for their turn); values averaged exactly there",
    "hierarchical+shared": "changes the algorithm twice: node-averaged gradients and one node's positions per step",
}

"""What each method changes, for the plan's quality note."""

_PER_STEP_TAGS = {"ddp": "ddp/grad", "node_reduce": "demo/node_reduce", "node_share": "demo/node_share"}


# ---------------------------------------------------------------------------------------------- shapes
def gpt_like_shapes(n_params: int, d_model: Optional[int] = None) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-like model with exactly ``n_params`` parameters.

    Blocks as in :class:`~demo_lightning.models.GPTLightningModule` (no linear biases): per block two
    LayerNorms (four ``(d,)`` vectors), the fused ``(3d, d)`` QKV and ``(d, d)`` output projections and
    the ``(4d, d)`` / ``(d, 4d)`` MLP, ``12 d^2 + 4 d`` parameters. ``d_model`` (default: the multiple
    of 64 nearest ``(64 n / 12)^(1/3)``, i.e. a depth of about ``d / 64`` blocks, like GPT-2/3: GPT-3 XL
    has d 2048 and 24 blocks) sets the width; as many whole blocks as fit, then what is left as one
    ``(rest // d, d)`` matrix first (where a token embedding sits) and one ``(rest % d,)`` vector last,
    so the shapes add up to ``n_params`` exactly. 2-D matrices dominate the bytes; the vectors are
    sent densely (the codec's ``dense_vectors``, on by default).
    """
    d, blocks = gpt_like_dims(n_params, d_model)
    shapes: list[tuple[int, ...]] = []
    rows, tail = divmod(n_params - blocks * (12 * d * d + 4 * d), d)
    if rows:
        shapes.append((rows, d))
    for _ in range(blocks):
        shapes += [(d,), (d,), (3 * d, d), (d, d), (d,), (d,), (4 * d, d), (d, 4 * d)]
    if tail:
        shapes.append((tail,))
    return shapes


def gpt_like_dims(n_params: int, d_model: Optional[int] = None) -> tuple[int, int]:
    """``(d_model, blocks)`` of :func:`gpt_like_shapes` for ``n_params`` parameters."""
    n = check_int("n_params", n_params, 1, "parameters of the model")
    if d_model is None:
        d = max(64, 64 * round((64 * n / 12) ** (1 / 3) / 64))
    else:
        d = check_int("d_model", d_model, 1, "model width")
    return d, n // (12 * d * d + 4 * d)


def _check_shapes(shapes: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    out = []
    for shape in shapes:
        dims = tuple(shape)
        if not dims or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in dims):
            raise ValueError(f"every shape must be a non-empty tuple of positive integers, got {shape!r}")
        out.append(dims)
    if not out:
        raise ValueError("shapes must list at least one parameter shape")
    return out


# ---------------------------------------------------------------------------------------------- per tensor
@dataclass(frozen=True)
class _Tensor:
    numel: int
    dense: bool
    payload: int  # CodecConfig.payload_bytes: the flat/hierarchical exchange's bytes per worker
    index_bytes: int  # shared: bit-packed positions (0 when dense)
    value_bytes: int  # shared: the values in the shared value format (the dense format's bytes when dense)


@functools.lru_cache(maxsize=32)
def _tensors(shapes: tuple[tuple[int, ...], ...], codec: CodecConfig, shared_format: str) -> tuple[_Tensor, ...]:
    out = []
    for shape in shapes:
        numel = math.prod(shape)
        layout, k = codec.layout(shape)
        if layout is None:
            dense = codec.dense_nbytes(numel)
            out.append(_Tensor(numel, True, dense, 0, dense))
            continue
        positions = positions_nbytes(layout.n_tiles, k, layout.tile_numel)
        out.append(_Tensor(numel, False, codec.payload_bytes(shape), positions, values_nbytes(layout.n_tiles, k, shared_format)))  # type: ignore[arg-type]
    return tuple(out)


def shard(payloads: Sequence[int], ranks: int) -> list[int]:
    """The local rank that exchanges each tensor under a node hierarchy: tensors in decreasing
    payload (ties: earlier first) each go to the rank with the least payload so far (ties: the
    lowest), as ``DeMoExchange.owners`` splits them."""
    check_int("ranks", ranks, 1, "local ranks per node")
    return split_by_payload(payloads, ranks)


@functools.lru_cache(maxsize=32)
def _shard(payloads: tuple[int, ...], ranks: int) -> list[int]:
    return shard(payloads, ranks)


# ---------------------------------------------------------------------------------------------- collectives
@dataclass(frozen=True)
class ModeledCollective:
    """One collective one rank launches in a step, with its ring-model sent bytes (the ledger's).

    ``world_size`` and ``rank`` are the group's; ``root`` is a broadcast's root in the group
    (``None``: it rotates every step, and ``sent_bytes`` is the average over ``world_size`` steps)."""

    op: CollectiveOp
    tag: str
    payload_bytes: int
    world_size: int
    rank: int
    link: Link
    inter_share: float
    root: Optional[int] = None

    @property
    def sent_bytes(self) -> float:
        w = self.world_size
        if w <= 1:
            return 0.0
        if self.op == "all_gather":
            return ring_all_gather_bytes(self.payload_bytes, w)
        if self.op == "all_reduce":
            return ring_all_reduce_bytes(self.payload_bytes, w)
        if self.root is None:
            return (w - 1) / w * self.payload_bytes
        return 0.0 if self.rank == (self.root - 1) % w else float(self.payload_bytes)

    @property
    def inter_node_bytes(self) -> float:
        return self.sent_bytes * self.inter_share

    @property
    def hops(self) -> int:
        """Ring hops (the monitor's model): ``W_g - 1`` for an all-gather or broadcast, ``2 (W_g - 1)`` for an all-reduce."""
        w = max(0, self.world_size - 1)
        return 2 * w if self.op == "all_reduce" else w


def _buckets(sizes: Sequence[int], cap_mb: float) -> list[list[int]]:
    """Indexes of the tensors in each bucket, packed in order by ``sizes`` (the codec's
    ``payload_bytes``) as the exchange's plan packs them (``stages.plan``)."""
    cap = int(cap_mb * 1024 * 1024)
    buckets: list[list[int]] = []
    size = 0
    for i, p in enumerate(sizes):
        if not buckets or size + p > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += p
    return buckets


def _group(topology: NodeTopology, ranks: list[int], rank: int) -> tuple[int, int, Link, float]:
    return len(ranks), ranks.index(rank), topology.link_of(ranks), topology.inter_share(ranks, rank)


def _exchange(
    tensors: Sequence[_Tensor], codec: CodecConfig, shared: bool, group: tuple[int, int, Link, float], step: Optional[int],
) -> list[ModeledCollective]:
    """The collectives of one DeMo exchange of ``tensors`` over ``group``, in ``DeMoExchange``'s
    order: (shared: one broadcast of every position from the leader ``step mod W_g``, the rotating
    average when ``step`` is ``None``), the dense all-reduce, then one collective per bucket (shared:
    an all-reduce of the bucket's values, buckets packed by values + positions)."""
    world, rank, link, share = group
    out = []
    compressed = [t for t in tensors if not t.dense]
    if shared:
        leader = None if step is None else step % world
        out.append(ModeledCollective("broadcast", "demo/positions", sum(t.index_bytes for t in compressed), world, rank, link, share, root=leader))
    if any(t.dense for t in tensors):
        out.append(ModeledCollective("all_reduce", "demo/dense", sum(t.payload for t in tensors if t.dense), world, rank, link, share))
    if shared:
        for bucket in _buckets([compressed[i].index_bytes + compressed[i].value_bytes for i in range(len(compressed))], codec.bucket_cap_mb):
            out.append(ModeledCollective("all_reduce", "demo/shared", sum(compressed[i].value_bytes for i in bucket), world, rank, link, share))
        return out
    op: CollectiveOp = "all_reduce" if codec.all_reduces else "all_gather"
    tag = f"demo/{codec.selection}" if codec.all_reduces else f"demo/{'topk' if codec.sends_positions else 'values'}"
    for bucket in _buckets([t.payload for t in compressed], codec.bucket_cap_mb):
        out.append(ModeledCollective(op, tag, sum(compressed[i].payload for i in bucket), world, rank, link, share))
    return out


def _shared_format(codec: CodecConfig, shared_value_format: Optional[str]) -> str:
    if shared_value_format is None or codec.selection == "shared":
        return codec.value_format if codec.value_format in SHARED_VALUE_FORMATS else DEFAULT_SHARED_VALUE_FORMAT
    return check_choice("shared_value_format", shared_value_format, SHARED_VALUE_FORMATS, "the shared values are summed by an all-reduce")


def strength_text(codec: CodecConfig) -> str:
    """How many coefficients per tile the codec keeps, in words (for plan headers)."""
    if codec.topk is None and codec.keep_ratio is None:
        return f"topk by workers W (all-gathered: clamp({GATHERED_PER_TILE} // W, {MIN_DEFAULT_TOPK}, {DEFAULT_TOPK}); all-reduced: {DEFAULT_TOPK})"
    return f"topk {codec.topk}" if codec.topk is not None else f"keep ratio {codec.keep_ratio:g}"


def _resolved(codec: CodecConfig, topology: NodeTopology, method: str) -> CodecConfig:
    """The codec as the method's exchange runs it: the default k resolved for its DeMo workers
    (:meth:`CodecConfig.for_workers`: all ``W`` ranks for ``flat``, the ``N`` nodes under the
    hierarchy; the shared methods all-reduce their values and keep the codec's k)."""
    if method == "ddp" or "shared" in method:
        return codec
    return codec.for_workers(topology.world_size if method == "flat" else topology.num_nodes)


def _collectives_of(
    tensors: Sequence[_Tensor], topology: NodeTopology, method: str, codec: CodecConfig, rank: int, ddp_bucket_cap_mb: float,
    step: Optional[int] = None,
) -> list[ModeledCollective]:
    everyone = list(range(topology.world_size))
    if method == "ddp":
        n = sum(t.numel for t in tensors)
        world, r, link, share = _group(topology, everyone, rank)
        buckets = max(1, math.ceil(n * 4 / (ddp_bucket_cap_mb * 1024 * 1024)))
        cap = int(ddp_bucket_cap_mb * 1024 * 1024)  # full buckets, then the rest (bytes add up to 4 n)
        sizes = [cap] * (buckets - 1) + [4 * n - cap * (buckets - 1)]
        return [ModeledCollective("all_reduce", _PER_STEP_TAGS["ddp"], s, world, r, link, share) for s in sizes]
    shared = method in ("shared", "hierarchical+shared") or codec.selection == "shared"
    if method in ("flat", "shared"):
        return _exchange(tensors, codec, shared, _group(topology, everyone, rank), step)
    # the node hierarchy
    node, local = topology.node_of(rank), topology.local_rank_of(rank)
    intra = topology.node_ranks(node)
    g_world, g_rank, g_link, g_share = _group(topology, intra, rank)
    out = [ModeledCollective("all_reduce", _PER_STEP_TAGS["node_reduce"], 4 * sum(t.numel for t in tensors), g_world, g_rank, g_link, g_share)]
    weights = [t.index_bytes + t.value_bytes if shared else t.payload for t in tensors]
    owners = _shard(tuple(weights), topology.ranks_per_node)
    mine = [t for t, o in zip(tensors, owners) if o == local]
    out += _exchange(mine, codec, shared, _group(topology, topology.peer_ranks(local), rank), step)
    for owner in range(topology.ranks_per_node):
        part = sum(4 * t.numel for t, o in zip(tensors, owners) if o == owner)
        if part:
            out.append(ModeledCollective("broadcast", _PER_STEP_TAGS["node_share"], part, g_world, g_rank, g_link, g_share, root=owner))
    return out


def modeled_collectives(
    shapes: Iterable[Sequence[int]],
    topology: NodeTopology,
    method: Method,
    codec: CodecConfig = CodecConfig(),
    *,
    rank: int = 0,
    step: Optional[int] = None,
    shared_value_format: Optional[str] = None,
    ddp_bucket_cap_mb: float = 25.0,
) -> list[ModeledCollective]:
    """The collectives rank ``rank`` (of the default group) launches in one optimizer step of
    ``method``, in launch order (see the module docstring). Every node's ranks launch the same
    ones as the first node's of the same local index. ``step``: the exchange's index, which picks
    the shared methods' leader (``step mod W_g``); ``None``: the positions' broadcast is charged its
    average over the rotation, ``(W_g - 1) / W_g`` of its size on every rank."""
    shapes = _check_shapes(shapes)
    _check_topology(topology)
    check_choice("method", method, METHODS)
    check_int("rank", rank, 0, "a rank of the topology")
    if rank >= topology.world_size:
        raise ValueError(f"rank must be below the topology's world size {topology.world_size}, got {rank}")
    codec = _resolved(codec, topology, method)
    tensors = _tensors(tuple(shapes), codec, _shared_format(codec, shared_value_format))
    if step is not None:
        check_int("step", step, 0, "the exchange's index")
    return _collectives_of(tensors, topology, method, codec, rank, ddp_bucket_cap_mb, step)


def _check_topology(topology: object) -> NodeTopology:
    if not isinstance(topology, NodeTopology):
        raise ValueError(f"topology must be a NodeTopology, got {type(topology).__name__}")
    return topology


# ---------------------------------------------------------------------------------------------- estimates
@dataclass(frozen=True)
class Estimate:
    """One method's modelled step on one topology (bytes per rank per step: each rank sends as much as it receives).

    Attributes:
        inter_node_bytes: sent bytes charged to the inter-node link, mean over ranks (the ledger's
            ``last_step.inter_node_bytes``); the node's link carries ``G`` times this each way.
        intra_node_bytes: sent bytes that stay inside the node, mean over ranks.
        rank_inter_node_bytes, rank_sent_bytes: per local rank ``0..G-1`` (every node alike).
        ddp_sent_bytes, ddp_inter_node_bytes: DDP's for the same model and topology (per rank).
        compute_seconds, inter_seconds, intra_seconds, latency_seconds: the step's parts (module docstring).
        collectives: collectives one rank launches per step (the busiest rank).
        value_format: the values' format on the wire (the shared methods' float format).
    """

    method: str
    world_size: int
    ranks_per_node: int
    n_params: int
    inter_node_bytes: float
    intra_node_bytes: float
    rank_inter_node_bytes: tuple[float, ...]
    rank_sent_bytes: tuple[float, ...]
    ddp_sent_bytes: float
    ddp_inter_node_bytes: float
    compute_seconds: float
    inter_seconds: float
    intra_seconds: float
    latency_seconds: float
    collectives: int
    value_format: str

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def sent_bytes(self) -> float:
        """All bytes a rank sends per step (mean over ranks)."""
        return self.inter_node_bytes + self.intra_node_bytes

    @property
    def node_link_bytes(self) -> float:
        """Bytes on one node's inter-node link per step, each way: the sum over its ``G`` ranks."""
        return self.inter_node_bytes * self.ranks_per_node

    @property
    def communication_seconds(self) -> float:
        return self.inter_seconds + self.intra_seconds + self.latency_seconds

    @property
    def step_seconds(self) -> float:
        """Modelled step: compute, then communication (no overlap)."""
        return self.compute_seconds + self.communication_seconds

    @property
    def ratio_vs_ddp(self) -> float:
        """DDP's inter-node bytes over ours (``100``: 100x fewer on the inter-node link); ``inf``
        when we send none and DDP some, ``1`` when neither does (one node)."""
        if self.inter_node_bytes > 0:
            return self.ddp_inter_node_bytes / self.inter_node_bytes
        return 1.0 if self.ddp_inter_node_bytes == 0 else math.inf

    @property
    def sent_ratio_vs_ddp(self) -> float:
        """DDP's sent bytes over ours, all links together (the ledger's ``ratio_vs_ddp``)."""
        if self.sent_bytes > 0:
            return self.ddp_sent_bytes / self.sent_bytes
        return 1.0 if self.ddp_sent_bytes == 0 else math.inf


def _check_positive(name: str, value: float) -> float:
    v = check_number(name, value, 0.0, low_open=True)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def _check_non_negative(name: str, value: float) -> float:
    v = check_number(name, value, 0.0)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def estimate(
    shapes: Iterable[Sequence[int]],
    topology: NodeTopology,
    method: Method,
    codec: CodecConfig = CodecConfig(),
    *,
    inter_gbps: float = 10.0,
    intra_gbps: float = 400.0,
    step_compute_s: float = 0.0,
    latency_ms: float = 0.5,
    intra_latency_ms: float = 0.01,
    shared_value_format: Optional[str] = None,
    ddp_bucket_cap_mb: float = 25.0,
) -> Estimate:
    """Model one optimizer step of ``method`` for a model of these parameter ``shapes`` on ``topology``.

    Args:
        shapes: every trainable tensor's shape, in the model's parameter order (bucketing follows it).
        topology: ``NodeTopology(world_size, ranks_per_node)``.
        method: one of :data:`METHODS` (see the module docstring for each one's collectives).
        codec: the DeMo codec (chunk, topk or keep_ratio, selection, value_format, dense_below, bucket_cap_mb).
        inter_gbps: bandwidth of one node's link to the other nodes, Gbit/s, shared by its ``G`` ranks.
        intra_gbps: bandwidth of each rank's link inside its node, Gbit/s.
        step_compute_s: forward + backward + optimizer seconds of one step (added, not overlapped).
        latency_ms: per ring hop of a collective whose group spans nodes (the monitor's default 0.5).
        intra_latency_ms: per ring hop of a collective inside one node.
        shared_value_format: the shared methods' value format (``"fp32"``, ``"bf16"``, ``"fp16"``);
            ``None``: the codec's when it is one of those, else ``"bf16"``.
        ddp_bucket_cap_mb: DDP's gradient bucket size (one ring all-reduce per bucket).

    Raises ``ValueError`` naming the argument for a bad shape list, method, bandwidth, time or format.
    """
    shapes = _check_shapes(shapes)
    _check_topology(topology)
    check_choice("method", method, METHODS)
    if not isinstance(codec, CodecConfig):
        raise ValueError(f"codec must be a CodecConfig, got {type(codec).__name__}")
    inter_bps = _check_positive("inter_gbps", inter_gbps) * 1e9
    intra_bps = _check_positive("intra_gbps", intra_gbps) * 1e9
    compute = _check_non_negative("step_compute_s", step_compute_s)
    inter_latency = _check_non_negative("latency_ms", latency_ms) / 1000
    intra_latency = _check_non_negative("intra_latency_ms", intra_latency_ms) / 1000
    _check_positive("ddp_bucket_cap_mb", ddp_bucket_cap_mb)
    codec = _resolved(codec, topology, method)
    shared_format = _shared_format(codec, shared_value_format)
    tensors = _tensors(tuple(shapes), codec, shared_format)
    g = topology.ranks_per_node
    if method in ("ddp", "flat", "shared"):  # one group of all W ranks: every rank sends alike (a rotating root's average)
        per_rank = [_collectives_of(tensors, topology, method, codec, 0, ddp_bucket_cap_mb)] * g
    else:
        per_rank = [_collectives_of(tensors, topology, method, codec, local, ddp_bucket_cap_mb) for local in range(g)]

    def total(records: list[ModeledCollective], what: str) -> float:
        acc = 0.0  # summed in launch order, as the ledger sums a step's records
        for r in records:
            acc += getattr(r, what)
        return acc

    n = sum(t.numel for t in tensors)
    ddp_sent = ring_all_reduce_bytes(4 * n, topology.world_size)
    if method == "ddp":  # the buckets' records serve the latency; the bytes exactly as the ledger's baseline
        sent = (ddp_sent,) * g
        inter = (topology.ddp_inter_node_bytes(ddp_sent),) * g
    else:
        sent = tuple(total(rs, "sent_bytes") for rs in per_rank)
        inter = tuple(total(rs, "inter_node_bytes") for rs in per_rank)
    intra = [s - i for s, i in zip(sent, inter)]
    latency = max(sum(r.hops * (inter_latency if r.link == "inter" else intra_latency) for r in rs) for rs in per_rank)
    mean_inter = sum(inter) / g
    return Estimate(
        method=method,
        world_size=topology.world_size,
        ranks_per_node=g,
        n_params=n,
        inter_node_bytes=mean_inter,
        intra_node_bytes=sum(intra) / g,
        rank_inter_node_bytes=inter,
        rank_sent_bytes=sent,
        ddp_sent_bytes=ddp_sent,
        ddp_inter_node_bytes=topology.ddp_inter_node_bytes(ddp_sent),
        compute_seconds=compute,
        inter_seconds=8 * g * mean_inter / inter_bps,
        intra_seconds=8 * max(intra) / intra_bps,
        latency_seconds=latency,
        collectives=max(len(rs) for rs in per_rank),
        value_format="fp32" if method == "ddp" else (shared_format if "shared" in method or codec.selection == "shared" else codec.value_format),
    )


def estimate_all(
    shapes: Iterable[Sequence[int]],
    topology: NodeTopology,
    codec: CodecConfig = CodecConfig(),
    methods: Sequence[str] = METHODS,
    **kwargs: object,
) -> dict[str, Estimate]:
    """:func:`estimate` of every method in ``methods`` (keyword arguments passed on)."""
    shapes = _check_shapes(shapes)
    return {m: estimate(shapes, topology, m, codec, **kwargs) for m in methods}  # type: ignore[arg-type]


def pick(estimates: Mapping[str, Estimate]) -> Estimate:
    """The method with the fastest modelled step (ties: fewer inter-node bytes, then the one that
    changes the algorithm least, in :data:`METHODS` order)."""
    if not estimates:
        raise ValueError("pick needs at least one estimate")
    order = {m: i for i, m in enumerate(METHODS)}
    return min(estimates.values(), key=lambda e: (e.step_seconds, e.inter_node_bytes, order.get(e.method, len(order))))


# ---------------------------------------------------------------------------------------------- text
def _seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.3f} s"


def _ratio_text(e: Estimate) -> str:
    if e.num_nodes == 1:
        return "- (1 node)"
    r = e.ratio_vs_ddp
    return "inf" if math.isinf(r) else f"{r:,.1f}x"


def format_table(estimates: Mapping[str, Estimate]) -> str:
    """A plain-text table: per method the bytes per rank per step by link, the node link's bytes,
    the modelled step and its communication part, and the inter-node ratio to DDP."""
    header = ("method", "inter-node / rank", "node link", "intra-node / rank", "step", "of it comm", "inter-node: DDP / this")
    rows = [header]
    for m, e in estimates.items():
        rows.append((
            m, human_bytes(e.inter_node_bytes), human_bytes(e.node_link_bytes), human_bytes(e.intra_node_bytes),
            _seconds(e.step_seconds), _seconds(e.communication_seconds), _ratio_text(e),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_plan(estimates: Mapping[str, Estimate], near: float = 0.05) -> str:
    """The table, the pick (fastest modelled step) and why, and the quality caveats.

    ``near``: a method that changes the algorithm less and is within this fraction of the pick's
    step time is named as the safer alternative.
    """
    best = pick(estimates)
    lines = [format_table(estimates), ""]
    why = [f"Pick: {best.method} ({how_to_run(best)}): the fastest modelled step, {_seconds(best.step_seconds)}"]
    ddp = estimates.get("ddp")
    if ddp is not None and best.method != "ddp" and best.step_seconds > 0:
        why.append(f"{ddp.step_seconds / best.step_seconds:.1f}x faster than DDP's {_seconds(ddp.step_seconds)}")
    others = sorted((e for e in estimates.values() if e is not best), key=lambda e: e.step_seconds)
    if others:
        why.append(f"next {others[0].method} at {_seconds(others[0].step_seconds)}")
    lines.append("; ".join(why) + ".")
    if best.num_nodes > 1 and best.step_seconds > 0:
        lines.append(
            f"Its node link carries {human_bytes(best.node_link_bytes)} per step each way ({_ratio_text(best)} fewer inter-node "
            f"bytes than DDP); communication is {best.communication_seconds / best.step_seconds:.0%} of its step."
        )
    order = list(METHODS)
    safer = [e for e in estimates.values()
             if e.method in order and best.method in order and order.index(e.method) < order.index(best.method)
             and e.step_seconds <= best.step_seconds * (1 + near)]
    if safer:
        alt = min(safer, key=lambda e: order.index(e.method))
        lines.append(f"Within {near:.0%}: {alt.method} ({_seconds(alt.step_seconds)}) changes the algorithm less; prefer it unless the gap matters.")
    lines.append(f"Quality: {best.method}: {CAVEATS.get(best.method, '')}. Shared and hierarchical change the algorithm, "
                 "and this model says nothing about loss: compare losses on a short run before a long one.")
    return "\n".join(lines)
