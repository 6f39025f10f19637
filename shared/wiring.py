"""The composition root: the one place that chooses real or SIMULATED adapters for the ports, from the settings.

``GPUWARDEN_BACKEND=real`` gets NVML (``shared.adapters.nvml``), the Kubernetes API (``shared.adapters.kube``) and
the kubelet; ``sim`` gets the simulation's GPUs, cluster and lookups (``shared.sim``); either way the checkpoint
store a URL names and Redis clients over the process's pool are opened here. Each service's ``__main__``
hands ``Wiring`` to the runner (``run(service, Wiring)``), which builds it once the bus is up and gives it to the
service as ``ctx.backends`` (the ``shared.ports.backends.Backends`` Protocol). Services never import this module or
``shared.sim`` (an import-linter contract holds them to it); tests hand it, or ports of their own, the same way.

``HollowWiring`` is the same choice for a process that hosts many simulated nodes (``shared.host.hollow``):
each node's ports are the ones ``Wiring`` gives, built over what the nodes share: one Redis pool, one informer of
the simulated cluster (``SharedSimCluster``: each node's watch sees its own node's changes), one reader of every
node's GPU health stream (``SimHealthFeed``), the nodes' GPU states read together (``SimGpuStore``) and one
answer to fault requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Literal

import redis.asyncio as aioredis

from shared.contract.subjects import Subjects
from shared.kv.store import CheckpointStore
from shared.kv.stores import open_store
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.ports.backends import PortUnavailable
from shared.ports.cluster import ClusterPort
from shared.ports.gpu import GpuPort
from shared.ports.pods import GpuPods, PodOwners
from shared.sim.cluster import SimCluster
from shared.sim.exporter import find_exporter
from shared.sim.faults import serve_faults
from shared.sim.gpus import SimGpus
from shared.sim.gpustore import SimGpuStore, SimHealthFeed
from shared.sim.informer import SharedSimCluster
from shared.sim.lookups import SimGpuPods, SimPodOwners
from shared.sim.spec import SpecError, load_spec


class Wiring:
    """``Backends`` from the settings: every port a service asks for, real or simulated. Each call builds a new
    port, owned by the caller."""

    def __init__(self, settings: Settings, subjects: Subjects, bus: Bus | None = None) -> None:
        self.settings = settings
        self.subjects = subjects
        self.bus = bus
        self.simulated = settings.backend == "sim"

    def gpus(self) -> GpuPort:
        settings = self.settings
        if not self.simulated:
            from shared.adapters.nvml import NvmlGpus

            return NvmlGpus()
        spec = load_spec()
        try:
            spec.node(settings.node)
        except SpecError as exc:
            raise SpecError(
                f"GPUWARDEN_NODE={settings.node}: {exc}; set GPUWARDEN_NODE to one of them, or GPUWARDEN_SIM_SPEC to "
                "a spec with this node"
            ) from None
        return SimGpus(redis_client(settings.redis), self.subjects, spec, settings.node, owns_client=True)

    async def cluster(
        self, *, watch_kinds: Iterable[Literal["node", "pod"]] | None = None, watch_node: str | None = None
    ) -> ClusterPort:
        if self.simulated:
            return await SimCluster.create(self.settings.redis, self.subjects)
        from shared.adapters.kube import KubeCluster

        if watch_kinds is None:
            return await KubeCluster.connect(watch_node=watch_node)
        return await KubeCluster.connect(watch_kinds=tuple(watch_kinds), watch_node=watch_node)

    def attached_cluster(self) -> SimCluster | None:
        """The simulated cluster, attached (not created: the simulation makes it); None with backend ``real``."""
        if not self.simulated:
            return None
        return SimCluster(redis_client(self.settings.redis), self.subjects, owns_client=True)

    async def serve_faults(self, gpus: GpuPort) -> bool:
        if not isinstance(gpus, SimGpus) or self.bus is None:
            return False
        await serve_faults(self.bus, gpus.client, gpus.subjects, gpus.spec)
        return True

    def gpu_pods(self, kubelet: Callable[[], GpuPods]) -> GpuPods:
        cluster = self.attached_cluster()
        if cluster is None:
            return kubelet()
        return SimGpuPods(cluster, self.settings.node, owns_cluster=True)

    def pod_owners(self) -> PodOwners | None:
        if not self.simulated:
            return None
        return SimPodOwners(redis_client(self.settings.redis), self.subjects)

    def checkpoint_store(self, url: str) -> CheckpointStore:
        return open_store(url, self.bus.nc if self.bus is not None else None)

    def redis(self) -> aioredis.Redis:
        return redis_client(self.settings.redis)

    async def exporter_url(self) -> str | None:
        if not self.simulated:
            return None
        client = redis_client(self.settings.redis)
        try:
            url = await find_exporter(client, self.subjects, self.settings.node)
        finally:
            await client.aclose()
        if not url:
            raise PortUnavailable(
                f"no SIMULATED dcgm-exporter is announced for node {self.settings.node} yet (start the simulation, "
                "or set GPUWARDEN_METRICS_URL)"
            )
        return url


class HollowWiring:
    """The ports of every node of a hollow host (``shared.host.hollow.HostBackends``), SIMULATED: what the
    nodes share is built once, here, and closed after they have all stopped."""

    def __init__(self, settings: Settings, subjects: Subjects, bus: Bus) -> None:
        if settings.backend != "sim":
            raise SpecError("hollow nodes are simulated nodes: GPUWARDEN_BACKEND=sim")
        self.settings = settings
        self.subjects = subjects
        self.bus = bus
        self.spec = load_spec()
        self.client = redis_client(settings.redis)  # over the host's one pool (share_redis_pool)
        self.health = SimHealthFeed(self.client, subjects)
        self.gpu_store = SimGpuStore(self.client, subjects, batch_reads=True)
        self.cluster = SharedSimCluster(self.client, subjects)
        self.cluster.start()
        self._created = False
        self._creating = asyncio.Lock()
        self._faults_served = False

    def for_node(self, settings: Settings, bus: Bus) -> HollowNodeWiring:
        return HollowNodeWiring(self, settings, bus)

    async def created_cluster(self) -> SharedSimCluster:
        """The host's informer, once the simulated cluster exists (created from the spec if absent, as
        ``Wiring.cluster`` does)."""
        async with self._creating:
            if not self._created:
                await self.cluster.ensure(self.spec)
                self._created = True
        return self.cluster

    async def serve_faults_once(self) -> None:
        """Fault requests name their node: one answer for every node of the host."""
        if not self._faults_served:
            self._faults_served = True
            await serve_faults(self.bus, self.client, self.subjects, self.spec)

    async def close(self) -> None:
        await self.cluster.close()
        await self.health.close()


class HollowNodeWiring(Wiring):
    """One node's ``Backends`` in a hollow host: ``Wiring``'s ports over what ``HollowWiring`` shares. A port a
    node's service closes closes nothing shared."""

    def __init__(self, host: HollowWiring, settings: Settings, bus: Bus) -> None:
        super().__init__(settings, host.subjects, bus)
        self.host = host

    def gpus(self) -> GpuPort:
        node = self.settings.node
        try:
            self.host.spec.node(node)
        except SpecError as exc:
            raise SpecError(f"hollow node {node}: {exc}; the spec (GPUWARDEN_SIM_SPEC) must list it") from None
        host = self.host
        return SimGpus(host.client, self.subjects, host.spec, node, feed=host.health, store=host.gpu_store)

    async def cluster(
        self, *, watch_kinds: Iterable[Literal["node", "pod"]] | None = None, watch_node: str | None = None
    ) -> ClusterPort:
        return (await self.host.created_cluster()).view(watch_kinds, watch_node)

    def attached_cluster(self) -> SimCluster:
        return self.host.cluster.view()

    async def serve_faults(self, gpus: GpuPort) -> bool:
        if not isinstance(gpus, SimGpus):
            return False
        await self.host.serve_faults_once()
        return True

    def pod_owners(self) -> PodOwners:
        return SimPodOwners(self.host.client, self.subjects)
