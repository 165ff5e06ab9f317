"""Ranks from the nodes Ray placed the workers on (no Ray import: plain bookkeeping).

Workers on one node get contiguous ranks, nodes in the order their first worker was placed, so
local ranks and cross ranks come out as `hvdlite-run` assigns them on a host list (and as the
coordinator recomputes them from the host names).
"""
from __future__ import annotations

from hvdlite.runner.hosts import SlotInfo


def assign_ranks(node_ids: list[str]) -> list[tuple[int, SlotInfo]]:
    """For workers placed on `node_ids` (worker index -> node), the workers in rank order:
    (worker index, its coordinates). The host name of a slot is its node id."""
    by_node: dict[str, list[int]] = {}
    for index, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(index)
    size = len(node_ids)
    out: list[tuple[int, SlotInfo]] = []
    rank = 0
    nodes = list(by_node)
    for node in nodes:
        members = by_node[node]
        for local_rank, index in enumerate(members):
            peers = [n for n in nodes if len(by_node[n]) > local_rank]
            out.append((index, SlotInfo(hostname=node, rank=rank, local_rank=local_rank,
                                        cross_rank=peers.index(node), size=size,
                                        local_size=len(members), cross_size=len(peers))))
            rank += 1
    return out


def slots_in_order(node_ids: list[str]) -> list[SlotInfo]:
    """Coordinates for ranks 0..n-1 placed on `node_ids` (rank -> node) as they are, for when
    the ranks are given (Ray Train's world ranks): local ranks count a node's ranks in rank order,
    nodes are ordered by their lowest rank (as the coordinator orders them)."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(rank)
    nodes = list(by_node)
    out = []
    for rank, node in enumerate(node_ids):
        members = by_node[node]
        local_rank = members.index(rank)
        peers = [n for n in nodes if len(by_node[n]) > local_rank]
        out.append(SlotInfo(hostname=node, rank=rank, local_rank=local_rank,
                            cross_rank=peers.index(node), size=len(node_ids),
                            local_size=len(members), cross_size=len(peers)))
    return out
