"""The driver service's Prometheus metrics, read from the upgrade coordinator at scrape time: only the leading
coordinator exports the upgrade states (the others' views are not kept current)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .coordinator import UpgradeCoordinator
from .upgrade import ORDER


class UpgradeCollector(Collector):
    def __init__(self, coordinator: UpgradeCoordinator) -> None:
        self.coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        status = self.coordinator.status()
        leading = bool(status["leader"])
        leader = GaugeMetricFamily(
            "gpuwarden_driver_upgrade_leader", "1 while this driver pod leads the rolling driver upgrades"
        )
        leader.add_metric([], 1.0 if leading else 0.0)
        yield leader
        nodes = GaugeMetricFamily(
            "gpuwarden_driver_upgrade_nodes",
            "Nodes in each driver upgrade state (the leader's view; state '' is a node no upgrade touched)",
            labels=["state"],
        )
        since = GaugeMetricFamily(
            "gpuwarden_driver_upgrade_state_since_timestamp_seconds",
            "When each node entered its upgrade state, upgrade-done included (seconds since the epoch)",
            labels=["node", "state"],
        )
        if leading:
            counts = dict.fromkeys((*ORDER, "upgrade-failed"), 0)
            for node, state in status["nodes"].items():
                name = state.get("state", "")
                counts[name] = counts.get(name, 0) + 1
                try:
                    entered = float(state.get("since", ""))
                except ValueError:
                    continue
                if name and entered > 0:
                    since.add_metric([node, name], entered)
            for name, n in counts.items():
                nodes.add_metric([name], float(n))
        yield nodes
        yield since
