"""Which pods are gone: a pod the registry knows that stopped announcing and that the cluster no longer has.
Its sessions leave the registry (and the routers hear it). Drains ask about their node before they look for its
sessions; the retention turn asks about every pod."""

from __future__ import annotations

import logging

from .replica import Replica

log = logging.getLogger(__name__)


async def forget_gone_pods(replica: Replica, node: str | None = None) -> set[str]:
    """Pods the registry knows that stopped announcing and that the cluster no longer has. Empty when the
    cluster cannot say: a silent pod that may still exist keeps its sessions (a drain then fails for them
    rather than forgetting them)."""
    silent = await replica.registry.silent_pods()
    if node is not None:
        silent = {p: n for p, n in silent.items() if n == node}
    if not silent:
        return set()
    try:
        present = {p.name for p in await replica.cluster.pods(node=node)}
    except Exception as exc:
        log.warning("cluster unreadable; silent pods kept", extra={"error": str(exc), "pods": sorted(silent)})
        return set()
    gone = set(silent) - present
    for pod in sorted(gone):
        await replica.publish_locations(await replica.registry.forget_pod(pod))
        log.info("pod gone: its sessions left the registry", extra={"pod": pod, "node": silent[pod]})
    return gone
