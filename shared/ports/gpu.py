"""The GPU port: what the services need from a node's GPUs.

The real adapter speaks NVML (nvidia-ml-py); the simulated one (``shared.sim.gpus``) serves CI and laptops. Device
records reuse the contract's ``GpuDevice`` so inventory events carry exactly what the port returned.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from shared.contract.device import GpuDevice, MigInstance


class GpuError(RuntimeError):
    """The GPU layer failed (NVML missing, a call refused). Says what and why; never a bare stack trace."""


class DriverInstallError(GpuError):
    pass


@dataclass(frozen=True, slots=True)
class DriverVersions:
    driver: str
    cuda: str


@dataclass(frozen=True, slots=True)
class GpuUtilisation:
    """One sample of one GPU. Percentages are 0-100."""

    uuid: str
    gpu_util: float
    mem_copy_util: float
    mem_used_mib: float
    mem_free_mib: float
    power_w: float
    temperature_c: float


@dataclass(frozen=True, slots=True)
class GpuHealthEvent:
    """An XID error (``kind="xid"`` with ``xid`` set) or a GPU that fell off the bus (``kind="lost"``)."""

    uuid: str
    kind: Literal["xid", "lost"]
    xid: int = 0
    message: str = ""


@dataclass(frozen=True, slots=True)
class MigProfile:
    """A MIG profile a GPU offers: ``1g.10gb`` takes 1 of the GPU's compute slices; ``max_count`` instances of it
    fit on the GPU when nothing else is there. ``memory_mib`` is 0 when the adapter does not know it."""

    name: str
    slices: int
    max_count: int
    memory_mib: int = 0


@dataclass(frozen=True, slots=True)
class DriverValidation:
    ok: bool
    version: str
    visible_gpus: int
    reason: str = ""


@runtime_checkable
class GpuPort(Protocol):
    simulated: bool

    async def devices(self) -> list[GpuDevice]: ...

    async def versions(self) -> DriverVersions: ...

    async def utilisation(self) -> list[GpuUtilisation]: ...

    def health_events(self) -> AsyncIterator[GpuHealthEvent]:
        """Health events from now on; the iterator ends only when the adapter closes."""
        ...

    async def mig_profiles(self, uuid: str) -> list[MigProfile]:
        """The MIG profiles the GPU offers; empty when it is not MIG-capable (or the driver does not say)."""
        ...

    async def set_mig_mode(self, uuid: str, enabled: bool) -> None:
        """Raises ``GpuError`` when the mode did not take effect (a change pending a GPU reset included)."""
        ...

    async def create_mig_instance(self, uuid: str, profile: str) -> MigInstance: ...

    async def destroy_mig_instance(self, uuid: str, instance_uuid: str) -> None: ...

    async def install_driver(self, version: str) -> None:
        """Install ``version`` (raises ``DriverInstallError``); the caller validates afterwards."""
        ...

    async def validate_driver(self, expected_version: str) -> DriverValidation: ...

    async def close(self) -> None: ...
