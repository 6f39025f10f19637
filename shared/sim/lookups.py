"""What the SIMULATED cluster answers to the services' pod questions: which pods hold a GPU (``GpuPods``) and which
deployment owns a pod (``PodOwners``), both read from the simulated cluster in Redis."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import redis.asyncio as aioredis

from shared.contract.device import GpuDevice
from shared.contract.subjects import Subjects
from shared.ports.cluster import ClusterError
from shared.ports.pods import PodLookupError
from shared.sim.cluster import SimCluster


class SimGpuPods:
    """``GpuPods`` over the simulated cluster's record of which GPU indices each pod was bound to. SIMULATED."""

    simulated = True

    def __init__(self, cluster: SimCluster, node: str, *, owns_cluster: bool = False) -> None:
        self.cluster = cluster
        self.node = node
        self._owns_cluster = owns_cluster

    async def pods_using(self, gpu: GpuDevice) -> list[str]:
        try:
            holders = await self.cluster.gpu_holders(self.node)
        except ClusterError as exc:
            raise PodLookupError(f"simulated cluster: {exc}") from None
        return sorted(set(holders.get(gpu.index, [])))

    async def close(self) -> None:
        if self._owns_cluster:
            await self.cluster.close()


class SimPodOwners:
    """Pod -> deployment from the SIMULATED cluster in Redis."""

    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        self.client = client
        self.cluster = SimCluster(client, subjects)

    async def owners(self) -> Mapping[tuple[str, str], str]:
        try:
            return {(p.namespace, p.name): p.deployment for p in await self.cluster.pods()}
        except ClusterError:
            return {}

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()
