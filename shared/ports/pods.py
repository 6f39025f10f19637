"""Which pods hold a GPU, and which deployment owns a pod: what the device and metrics services ask the cluster
beyond ``ClusterPort``. Real adapters: the kubelet's PodResources API (``services.device.podresources``); the
simulated ones read the simulated cluster (``shared.sim.lookups``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from shared.contract.device import GpuDevice


class PodLookupError(RuntimeError):
    """Which pods hold a GPU could not be found out; the message says where it asked and what went wrong."""


@runtime_checkable
class GpuPods(Protocol):
    """Which pods hold a GPU: the kubelet's PodResources API on a real node, the simulated cluster's assignment in
    simulation."""

    simulated: bool

    async def pods_using(self, gpu: GpuDevice) -> list[str]:
        """``namespace/name`` of every pod holding ``gpu`` whole, a time-slice of it or one of its MIG instances,
        sorted and without repeats. Raises ``PodLookupError``."""
        ...

    async def close(self) -> None: ...


class PodOwners(Protocol):
    """Which deployment each pod belongs to, as the cluster says; refreshed by the metrics service each interval."""

    async def owners(self) -> Mapping[tuple[str, str], str]: ...

    async def close(self) -> None: ...
