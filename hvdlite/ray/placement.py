"""Placement groups for the workers, the driver-side rendezvous, and the words for Ray's
failures."""
from __future__ import annotations

from typing import Any, Optional

import ray

from hvdlite.runner.driver import Rendezvous


class RayRendezvous(Rendezvous):
    """The job's store, served by the driver process. It listens on 127.0.0.1 when every node
    the job may use shares the driver's address (a local cluster), else on all interfaces, and
    every worker reaches it at the driver node's address as Ray knows it."""

    def __init__(self, node_ips: Optional[list[str]], timeout_s: int,
                 nics: Optional[list[str]] = None) -> None:
        driver_ip = ray.util.get_node_ip_address()
        all_local = node_ips is not None and all(ip == driver_ip for ip in node_ips)
        super().__init__([], timeout_s, nics, all_interfaces=not all_local)
        self.driver_ip = "127.0.0.1" if all_local else driver_ip

    def addr_for(self, host: str) -> str:
        return self.driver_ip


def resources_text(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in resources.items()
             if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def free_text() -> str:
    """What the cluster has free now, per alive node, for error messages."""
    try:
        from ray._private.state import available_resources_per_node  # a developer API

        per_node = available_resources_per_node()
    except Exception:
        per_node = None
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if not per_node:
        return f"free in the cluster: {resources_text(ray.available_resources())}"
    parts = []
    for n in nodes:
        free = per_node.get(n["NodeID"], {})
        parts.append(f"node {n['NodeID'][:8]} ({n['NodeManagerAddress']}): "
                     f"{resources_text(free)} free of {resources_text(n.get('Resources', {}))}")
    total = resources_text(ray.available_resources())
    return f"free in all: {total}; {len(nodes)} alive nodes: " + "; ".join(parts)


def make_placement_group(bundles: list[dict[str, float]], strategy: str, timeout_s: float,
                         what: str) -> Any:
    """Reserve `bundles`; TimeoutError naming what was asked and what was free after
    `timeout_s` (the group is removed, so nothing stays reserved)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if ready:
        return pg
    free = free_text()
    remove_placement_group(pg)
    raise TimeoutError(
        f"hvdlite.ray: could not place {what} within placement_group_timeout_s={timeout_s:g} s: "
        f"asked for {len(bundles)} bundles of {resources_text(bundles[0])} ({strategy}); "
        f"{free}. Add nodes, ask for fewer workers or smaller ones, or raise "
        f"placement_group_timeout_s (an autoscaler may need longer).")


def node_addresses() -> dict[str, str]:
    """node id -> IP, for every node Ray knows (alive or not)."""
    return {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
