"""Who feeds which engine in a weight sync, and what each rank sends: pure, no torch.

A weight sync gathers each pipeline stage's tensor-parallel shards onto the stage's
*leader* (tensor-parallel rank 0) and streams the stages to the *feeders*, the ranks that
hand the engines their buckets (:mod:`dapo_megatron.weight_sync.gather`). Every
data-parallel replica holds the whole model, so a feeder is fed by its own replica's
leaders only. These rules are shared by the sync itself, by the orchestration that picks
feeders, and by ``plan`` and the placement rehearsal, which state the bytes every node
sends and receives per sync (:func:`sync_traffic`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SyncRoles:
    """Who gathers and streams what in a sync (see :func:`feeder_roles`)."""

    leaders: dict[int, list[int]]
    """Each data-parallel replica's stage leaders (tensor-parallel rank 0 of each
    pipeline stage), in stage order."""
    replica_of: dict[int, int]
    """Each global rank's data-parallel replica."""

    @property
    def valid_feeders(self) -> set[int]:
        return {rank for ranks in self.leaders.values() for rank in ranks}


def feeder_roles(ranks: list[tuple[int, int, int, int]]) -> tuple[list[int], set[int]]:
    """``(first replica's stage leaders, valid feeders)`` from every rank's ``(rank, dp, tp, pp)``.

    A stage leader is a replica's tensor-parallel rank 0 of a pipeline stage (the lowest
    such rank of the stage). Every replica holds the whole model, so a feeder is a stage
    leader of *any* replica: it gets its own stage from its own gathers and the other
    stages from its replica's other leaders, never from another replica. A
    tensor-parallel peer cannot feed: it takes part in its stage's gathers while the
    buckets stream, and would wait on both."""
    roles = sync_roles(ranks)
    return roles.leaders.get(0, []), roles.valid_feeders


def sync_roles(ranks: list[tuple[int, int, int, int]]) -> SyncRoles:
    """The :class:`SyncRoles` of every rank's ``(rank, dp, tp, pp)``."""
    leaders: dict[int, dict[int, int]] = {}
    for rank, dp, tp, pp in sorted(ranks):
        if tp == 0:
            leaders.setdefault(dp, {}).setdefault(pp, rank)
    return SyncRoles(
        {dp: [stages[pp] for pp in sorted(stages)] for dp, stages in leaders.items()},
        {rank: dp for rank, dp, _, _ in ranks},
    )


def check_feeders(feeders, valid: set[int]) -> None:
    """Refuse feeder ranks outside ``valid`` (see :func:`feeder_roles`), naming them."""
    invalid = sorted(set(feeders) - valid)
    if invalid:
        raise ValueError(
            f"ranks {invalid} cannot feed engines (tensor-parallel peers: a feeder is a stage leader of a replica); "
            f"valid feeders are {sorted(valid)}"
        )


def sync_traffic(
    feeders: Iterable[int], ranks: list[tuple[int, int, int, int]], rank_nodes: list[int], stage_bytes: list[int]
) -> dict[int, tuple[int, int]]:
    """Bytes each node sends and receives over the network in one sync, by node index:
    every feeder gets each stage it does not lead from its replica's leader of that
    stage (``ranks``: every rank's ``(rank, dp, tp, pp)``; ``rank_nodes[r]``: rank r's
    node; ``stage_bytes[s]``: stage s's weights as the sync sends them). Transfers inside
    a node are not counted."""
    roles = sync_roles(ranks)
    traffic: dict[int, list[int]] = {}
    for feeder in sorted(set(feeders)):
        for stage, leader in enumerate(roles.leaders[roles.replica_of[feeder]]):
            if leader == feeder or rank_nodes[leader] == rank_nodes[feeder]:
                continue
            traffic.setdefault(rank_nodes[leader], [0, 0])[0] += stage_bytes[stage]
            traffic.setdefault(rank_nodes[feeder], [0, 0])[1] += stage_bytes[stage]
    return {node: (sent, received) for node, (sent, received) in sorted(traffic.items())}
