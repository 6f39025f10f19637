"""What the device service needs besides the GPU and cluster ports (``shared.ports``): which pods hold a GPU."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from shared.contract.device import GpuDevice


class PodLookupError(RuntimeError):
    """Which pods hold a GPU could not be found out; the message says where it asked and what went wrong."""


@runtime_checkable
class GpuPods(Protocol):
    """Which pods hold a GPU: the kubelet's PodResources API on a real node (``podresources``), the simulated
    cluster's assignment in simulation."""

    simulated: bool

    async def pods_using(self, gpu: GpuDevice) -> list[str]:
        """``namespace/name`` of every pod holding ``gpu`` whole, a time-slice of it or one of its MIG instances,
        sorted and without repeats. Raises ``PodLookupError``."""
        ...

    async def close(self) -> None: ...
