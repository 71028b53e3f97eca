"""The DeMo exchange as stages: plan, encode (transform, select), transport, decode (sum, inverse).

Each stage is pure tensor code except the transport, which calls the
:class:`~demo_lightning.comm.Communicator`; each can be tested alone. The DeMo exchange
(:class:`~demo_lightning.algorithms.DeMoExchange`) and DES-LOC's compressed parameter sync
(:class:`~demo_lightning.algorithms.CompressedMean`) compose them.
"""

from demo_lightning.algorithms.stages.decode import accumulate, inverse, zeroed_means
from demo_lightning.algorithms.stages.encode import Selected, Workspace, select, select_at, transform_into, write_magnitudes
from demo_lightning.algorithms.stages.plan import ExchangePlan, Family, Run, TensorPlan, block_role, build_plan
from demo_lightning.algorithms.stages.positions import broadcast_positions
from demo_lightning.algorithms.stages.transport import (
    AllGatherTransport,
    AllReduceTransport,
    Contribution,
    Outgoing,
    PendingBucket,
    Transport,
    transport_for,
)

__all__ = [
    "AllGatherTransport",
    "AllReduceTransport",
    "Contribution",
    "ExchangePlan",
    "Family",
    "Outgoing",
    "PendingBucket",
    "Run",
    "Selected",
    "TensorPlan",
    "Transport",
    "Workspace",
    "accumulate",
    "block_role",
    "broadcast_positions",
    "build_plan",
    "inverse",
    "select",
    "select_at",
    "transform_into",
    "transport_for",
    "write_magnitudes",
    "zeroed_means",
]
