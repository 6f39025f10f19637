"""GPU inventory and health as the device service sees them."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from shared.contract.base import Event, NodeName


class MigInstance(msgspec.Struct, frozen=True, kw_only=True):
    """``gpu_instance_id`` and ``compute_instance_id`` are the ids NVML gives the instance on its GPU; they name
    its capability device nodes (``/proc/driver/nvidia-caps/mig-minors``), without which a container cannot open
    it. None where the GPU port does not know them."""

    uuid: str
    profile: str
    memory_mib: int = 0
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    placement_start: int | None = None
    """The first of the GPU's memory slices its GPU instance occupies (NVML's placement), None where unknown."""
    placement_size: int | None = None
    """How many memory slices it occupies from ``placement_start`` (a DRA slice's ``memorySlice<i>`` capacities)."""


class GpuDevice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    uuid: str
    model: str
    pci_bus_id: str = ""
    memory_total_mib: int = 0
    numa_node: int | None = None
    nvlink_peers: list[str] = msgspec.field(default_factory=list)
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_instances: list[MigInstance] = msgspec.field(default_factory=list)
    healthy: bool = True


class DeviceInventory(Event, frozen=True, kw_only=True, tag="device.inventory"):
    """The node's GPUs, published at start and whenever they change. ``simulated`` is never hidden."""

    family: ClassVar[str] = "device"

    node: NodeName
    driver_version: str = ""
    cuda_version: str = ""
    gpus: list[GpuDevice] = msgspec.field(default_factory=list)
    simulated: bool = False


class DeviceHealthChanged(Event, frozen=True, kw_only=True, tag="device.health.changed"):
    """A GPU became unhealthy or healthy again. ``pods`` are the pods using it, so their sessions can be saved."""

    family: ClassVar[str] = "device"

    node: NodeName
    gpu_uuid: str
    healthy: bool
    reason: str = ""
    xid: int | None = None
    pods: list[str] = msgspec.field(default_factory=list)


class GpuXid(Event, frozen=True, kw_only=True, tag="device.xid"):
    """An XID error as the driver reported it; ``critical`` says whether the health rules count it."""

    family: ClassVar[str] = "device"

    node: NodeName
    gpu_uuid: str
    xid: int
    critical: bool = True
    message: str = ""


MigConfigState = Literal["pending", "success", "failed"]


class MigConfigChanged(Event, frozen=True, kw_only=True, tag="device.mig.config"):
    """The node's MIG layout ``config`` (the value of its ``nvidia.com/mig.config`` label) is being applied
    (``pending``), was applied (``success``), or was refused or failed (``failed``, ``reason`` says why; a refused
    layout changed nothing). ``steps`` are the changes made or attempted, in order."""

    family: ClassVar[str] = "device"

    node: NodeName
    config: str
    state: MigConfigState
    reason: str = ""
    steps: list[str] = msgspec.field(default_factory=list)
