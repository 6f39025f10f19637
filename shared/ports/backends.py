"""What a service is handed to reach hardware and the cluster: every port, built for it by the composition root
(``shared.wiring.Wiring``) from the settings (``GPUWARDEN_BACKEND``: ``real`` or ``sim``).

Services depend on this Protocol and the ports it returns, never on an adapter: which adapter stands behind a port
is decided in ``shared.wiring`` alone. A port a service asks for is its own: the service closes it when it stops
(``ctx.on_stop``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

from shared.ports.cluster import ClusterPort
from shared.ports.gpu import GpuPort
from shared.ports.pods import GpuPods, PodOwners


class PortUnavailable(RuntimeError):
    """A port cannot be built yet (the simulation has not announced what it serves); says what is missing."""


class Backends(Protocol):
    simulated: bool
    """Whether the ports are the SIMULATED ones (for labels in logs and health, never for a decision)."""

    def gpus(self) -> GpuPort:
        """This node's GPUs (NVML, or simulated GPUs from the node spec). Raises ``SpecError`` for a node the
        simulation's spec lacks, before anything is opened."""
        ...

    async def cluster(
        self, *, watch_kinds: Iterable[Literal["node", "pod"]] | None = None, watch_node: str | None = None
    ) -> ClusterPort:
        """The cluster (the Kubernetes API, or the simulated cluster, created from the spec if absent). The watch
        options narrow what a Kubernetes watch follows. Raises ``ClusterError`` when it cannot be reached."""
        ...

    async def serve_faults(self, gpus: GpuPort) -> bool:
        """Answer fault-injection requests for ``gpus`` when they are simulated; says whether it does."""
        ...

    def gpu_pods(self, kubelet: Callable[[], GpuPods]) -> GpuPods:
        """Which pods hold a GPU: ``kubelet()`` (the node's PodResources API) on a real node, the simulated
        cluster's record in simulation. Opens nothing until asked."""
        ...

    def pod_owners(self) -> PodOwners | None:
        """Which deployment owns each pod where the cluster can tell cheaply (the simulated cluster); None: owners
        come from pod names."""
        ...

    def checkpoint_store(self, url: str) -> Any:
        """The checkpoint store ``url`` names (the checkpoint service's setting: ``file://`` a directory,
        ``nats://`` a JetStream object store bucket over this process's bus connection): a
        ``shared.kv.store.CheckpointStore``, named here in words only (the ports sit below the KV layer). Raises
        ``ValueError`` for a URL that names no store."""
        ...

    def redis(self) -> Any:
        """A Redis client (``redis.asyncio.Redis``, over this process's pool: ``shared.plumbing.configsync.
        redis_client``) for a service's own records; typed loosely, as the ports import no transport."""
        ...

    async def exporter_url(self) -> str | None:
        """The URL of this node's dcgm-exporter as the simulation announced it; None on a real node (its URL comes
        from the settings). Raises ``PortUnavailable`` while the simulation has announced none."""
        ...
