"""Which node a new job goes to, across the cluster.

`ranking` orders the nodes for a job (join a resident LoRA group, else free
devices, else time-slice) and counts the placer's own recent placements
(pure); `spanning` plans a trainer wider than any node over several (pure);
`offers` offers the job to them in turn until one takes it (`OfferRound` is
the pure state, `ClusterPlacer` the async shell). Neither books a device: the
chosen node's device pool does.
"""

from openrld.cluster.placement.offers import ClusterPlacer, OfferRound, Reply, needs_of_note, needs_of_settings
from openrld.cluster.placement.ranking import (
    GROUP_ROOM,
    Booking,
    Candidate,
    JobNeeds,
    Placer,
    candidate,
    rank,
    too_large,
)
from openrld.cluster.placement.spanning import SpanNode, SpanPart, SpanPlan, plan_span, span_nodes, span_refusal

__all__ = [
    "GROUP_ROOM",
    "Booking",
    "Candidate",
    "ClusterPlacer",
    "JobNeeds",
    "OfferRound",
    "Placer",
    "Reply",
    "SpanNode",
    "SpanPart",
    "SpanPlan",
    "candidate",
    "needs_of_note",
    "needs_of_settings",
    "plan_span",
    "rank",
    "span_nodes",
    "span_refusal",
    "too_large",
]
