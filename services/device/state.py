"""What the device service knows of its node's GPUs: the state it keeps as it handles health events and reads
inventories, and that its metrics collector (``gauges``) reads at scrape time. The service owns it and hands it
to the collector, so the collector sees these three things and nothing else of the service."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.contract.device import DeviceInventory

from .health import GpuHealth


@dataclass(slots=True)
class NodeGpuState:
    inventory: DeviceInventory | None = None
    """The last inventory published; None before the first."""
    health: dict[str, GpuHealth] = field(default_factory=dict)
    """Each GPU taken out or brought back, by UUID (a GPU not named is healthy); a lost GPU stays named though it
    has left the inventory."""
    xids: dict[str, int] = field(default_factory=lambda: {"true": 0, "false": 0})
    """XID errors seen, by whether they were critical (``"true"``, ``"false"``)."""
