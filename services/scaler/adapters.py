"""Adapters for the scaler's ports: the request queue in NATS JetStream, and pod placement from a cluster port."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping

import nats.js.errors
from nats.aio.msg import Msg

from shared.plumbing.bus import Bus
from shared.ports.backends import Backends
from shared.ports.cluster import ClusterPort


class JetStreamQueue:
    """Queue depth from the JetStream API; arrivals from a core subscription on the queue's subject.

    JetStream stores a published request and core NATS delivers the same message to plain subscribers, so a core
    subscription hears the first request at once, without waiting for the next consumer info poll.
    """

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def depth(self, namespace: str, deployment: str) -> int:
        s = self.bus.subjects
        stream = s.requests_stream.name
        try:
            info = await self.bus.js.consumer_info(stream, s.durable("workload", namespace, deployment), timeout=2.0)
        except nats.js.errors.NotFoundError:
            # Nobody serves the queue yet (scaled to zero, first start): on the work-queue stream every message
            # still stored is unserved, so the subject's message count is the depth.
            subject = s.pattern("requests.inference", namespace=namespace, deployment=deployment)
            stream_info = await self.bus.js.stream_info(stream, subjects_filter=subject)
            return int((stream_info.state.subjects or {}).get(subject, 0))
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def on_arrival(
        self, namespace: str, deployment: str, callback: Callable[[], None]
    ) -> Callable[[], Awaitable[None]]:
        subject = self.bus.subjects.pattern("requests.inference", namespace=namespace, deployment=deployment)

        async def on_msg(_: Msg) -> None:
            callback()

        sub = await self.bus.nc.subscribe(subject, cb=on_msg, pending_msgs_limit=4096)

        async def unsubscribe() -> None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

        return unsubscribe


class ClusterPlacement:
    """Pods per node from a ``ClusterPort`` (the simulated cluster, or the Kubernetes API where RBAC allows)."""

    def __init__(self, cluster: ClusterPort) -> None:
        self.cluster = cluster

    async def pods_by_node(self, namespace: str, deployment: str) -> Mapping[str, int]:
        counts: dict[str, int] = {}
        for pod in await self.cluster.pods(namespace=namespace):
            if pod.deployment == deployment and pod.phase != "Terminating" and pod.node:
                counts[pod.node] = counts.get(pod.node, 0) + 1
        return counts


async def cluster_placement(backends: Backends) -> tuple[ClusterPlacement, Callable[[], Awaitable[None]]]:
    """Placement from the cluster port of the backends: the simulated cluster in Redis (``sim``), or the Kubernetes
    API (``real``: pods listed per namespace; deploy/rbac/scaler.yaml grants exactly ``list pods``). Returns it
    and how to close it; raises ``ClusterError`` when the cluster cannot be reached."""
    cluster = await backends.cluster()
    return ClusterPlacement(cluster), cluster.close
