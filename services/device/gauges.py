"""The device service's Prometheus metrics, read from its state at scrape time: its node's GPUs by health (every
health value present, 0 when none is), XID errors seen, and the driver version the GPUs report."""

from __future__ import annotations

from collections.abc import Iterator
from typing import get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .health import GpuHealth
from .state import NodeGpuState

HEALTH_VALUES: tuple[str, ...] = get_args(GpuHealth)


class DeviceCollector(Collector):
    """Reads the ``NodeGpuState`` the device service keeps (the same object, so each scrape sees it as it is now)."""

    def __init__(self, state: NodeGpuState, node: str) -> None:
        self.state = state
        self.node = node

    def collect(self) -> Iterator[Metric]:
        inventory = self.state.inventory
        gpus = GaugeMetricFamily(
            "gpuwarden_device_gpus",
            "GPUs (or MIG-enabled GPUs) of the node by health: healthy, unhealthy (critical XID), lost",
            labels=["node", "health"],
        )
        counts = dict.fromkeys(HEALTH_VALUES, 0)
        for gpu in inventory.gpus if inventory is not None else ():
            health = self.state.health.get(gpu.uuid, "healthy")
            counts[health] = counts.get(health, 0) + 1
        for uuid, state in self.state.health.items():  # a lost GPU is no longer in the inventory
            if state == "lost" and (inventory is None or all(g.uuid != uuid for g in inventory.gpus)):
                counts["lost"] += 1
        for value, n in counts.items():
            gpus.add_metric([self.node, value], float(n))
        yield gpus
        xids = CounterMetricFamily(
            "gpuwarden_device_xid_errors",
            "XID errors seen on the node's GPUs, critical or not",
            labels=["node", "critical"],
        )
        for critical, n in sorted(self.state.xids.items()):
            xids.add_metric([self.node, critical], float(n))
        yield xids
        driver = GaugeMetricFamily(
            "gpuwarden_device_driver_info",
            "1, labelled with the driver version the node's GPUs report",
            labels=["node", "version"],
        )
        if inventory is not None and inventory.driver_version:
            driver.add_metric([self.node, inventory.driver_version], 1.0)
        yield driver
