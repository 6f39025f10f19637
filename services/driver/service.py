"""What the driver service decides: it answers the coordinator's commands for its own node (``DriverAgent``, with the
node's GPU port), records every drain verdict, and (when it leads) coordinates the rolling driver upgrade of the
cluster (``services.driver.coordinator`` over the pure ``services.driver.upgrade``), reaching every node's GPUs
through that node's agent."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

from shared.clients.drains import RecordReader
from shared.contract.configdocs import DriverPolicy
from shared.contract.node import DrainCompleted, DrainFailed
from shared.host.runner import ServiceContext
from shared.plumbing.configsync import VersionedConfig
from shared.plumbing.consumer import ConsumerSpec
from shared.ports.cluster import ClusterPort
from shared.ports.gpu import GpuPort

from .agent import DriverAgent, bus_node_drivers
from .config import DriverSettings, load
from .coordinator import UpgradeCoordinator
from .gauges import UpgradeCollector
from .lease import RedisLeaderLease, open_redis
from .ports import NodeDrivers
from .upgrade import verdict_text

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0  # a client closing on shutdown never holds the service up for longer


VERDICTS_SHOWN = 1000
"""Drain verdicts this replica lists in its health, newest last."""


class DriverService:
    """``gpu`` is this node's GPU port (default: ``ctx.backends``, NVML or simulated); ``cluster`` and ``drivers``
    (how the coordinator reaches each node; default: each node's agent over the bus) replace the defaults in
    tests. Ports it opens itself are closed when it stops, not before."""

    name = "driver"
    config_names: tuple[str, ...] = ("driver",)

    def __init__(
        self,
        settings: DriverSettings | None = None,
        *,
        cluster: ClusterPort | None = None,
        gpu: GpuPort | None = None,
        drivers: NodeDrivers | None = None,
    ) -> None:
        self.settings = settings or load()
        self.verdicts: dict[str, str] = {}
        self.cluster = cluster
        self.gpu = gpu
        self.drivers = drivers
        self.agent: DriverAgent | None = None
        self.coordinator: UpgradeCoordinator | None = None
        self._wake = asyncio.Event()

    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        s = ctx.subjects
        cluster = self.cluster
        if cluster is None:  # the coordinator follows the cluster's changes; the agent only reads its own node
            opened = cluster = await ctx.backends.cluster(watch_kinds=None if self.settings.coordinate else ())
            ctx.on_stop(lambda: asyncio.wait_for(opened.close(), CLOSE_TIMEOUT_S))
        gpus = self.gpu or ctx.backends.gpus()
        agent = self.agent = DriverAgent(ctx.node, gpus, cluster, owns_port=self.gpu is None)
        ctx.on_stop(agent.close)  # stops what the agent runs, and closes its port if it opened it
        await agent.serve(ctx.bus)
        ctx.status["install"] = agent.status
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("driver", "drain-verdicts"),
                filter_subjects=(s.pattern("node.drain.completed"), s.pattern("node.drain.failed")),
                accepts=(DrainCompleted, DrainFailed),
                stream=s.events_stream,
            ),
            self.on_verdict,
        )
        ctx.config.on_change(self.on_policy)
        ctx.status["drain_verdicts"] = self.verdicts
        if self.settings.coordinate:
            client = open_redis(ctx.settings.redis)
            ctx.on_stop(client.aclose)
            holder = f"{ctx.node or 'driver'}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            self.coordinator = UpgradeCoordinator(
                cluster,
                self.drivers or bus_node_drivers(ctx.bus, self.settings.agent_timeout_s),
                RedisLeaderLease(client, s, holder, ttl_s=self.settings.lease_ttl_s),
                RecordReader(ctx.bus),
                ctx.publish,
                self.policy,
                resync_s=self.settings.resync_s,
            )
            coordinator = self.coordinator
            ctx.telemetry.registry.register(UpgradeCollector(coordinator))
            ctx.status["upgrade"] = coordinator.status
            ctx.spawn(lambda: coordinator.run(self.settings.reconcile_s, self._wake), "driver-upgrade")

    def policy(self) -> DriverPolicy:
        current = self.ctx.config.current("driver")
        return current.doc if current and isinstance(current.doc, DriverPolicy) else DriverPolicy()

    async def on_verdict(self, event: DrainCompleted | DrainFailed) -> None:
        """Idempotent: a verdict only wakes the coordinator, which asks the drain's record for it (any replica
        may hear it; every one reads the same record). This replica's health lists the verdicts it heard."""
        verdict = verdict_text(event)
        self.verdicts[event.drain_id] = verdict
        if self.coordinator is not None:
            self.coordinator.note_verdict(event.node)
        while len(self.verdicts) > VERDICTS_SHOWN:
            del self.verdicts[next(iter(self.verdicts))]
        self._wake.set()
        log.info("drain verdict", extra={"drain_id": event.drain_id, "verdict": verdict})

    def on_policy(self, applied: VersionedConfig) -> None:
        if isinstance(applied.doc, DriverPolicy):
            log.info("driver policy", extra={"desired": applied.doc.desired_version, "version": applied.version})
            self._wake.set()
