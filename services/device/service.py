"""What the device service decides: the node's GPU inventory, and which GPUs the health rules take out.

The health rules follow NVIDIA's device plugin: an XID is critical unless it is one of the application XIDs
(13, 31, 43, 45, 68, 109 by default, ``GPUWARDEN_DEVICE_APPLICATION_XIDS``: the fault of the program running, not
of the GPU); a critical XID or a lost GPU makes the GPU unhealthy; after a quiet period with no critical XID and a
passing probe it is offered again (``GPUWARDEN_DEVICE_RECOVERY_S``). Every XID is published as ``GpuXid``; a GPU
getting worse is published as ``DeviceHealthChanged`` naming the pods that hold it (so the checkpoint service can
save their sessions before anything else happens), and the inventory follows.

The node is labelled from each inventory in the style of NVIDIA's GPU feature discovery (``labels``).

The MIG controller (``mig``) gives the GPUs the MIG layout the node's ``nvidia.com/mig.config`` label picks from
the ``mig`` configuration document, pausing the device plugin while it works.

When the kubelet's device-plugins folder exists (or ``GPUWARDEN_DEVICE_PLUGIN=on``), the kubelet device plugin
advertises every inventory it is given, health included, before the inventory is published. With
``GPUWARDEN_DEVICE_API=dra`` or ``both`` the DRA driver (``dra``) publishes it as the node's ResourceSlice and
prepares the claims the kubelet hands it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from shared.contract.device import DeviceHealthChanged, DeviceInventory, GpuDevice, GpuXid
from shared.contract.node import NodeCordoned, NodeUncordoned
from shared.host.runner import ServiceContext
from shared.plumbing.consumer import node_consumer
from shared.ports.cluster import ClusterPort
from shared.ports.gpu import GpuError, GpuHealthEvent, GpuPort

from .config import DeviceSettings, load
from .dra.driver import DraDriver
from .gauges import DeviceCollector
from .health import judge, may_recover
from .labels import NodeLabeller, node_labels
from .mig import CONFIG_DOCUMENT, MigController, start_mig_controller
from .plugin import KubeletDevicePlugin
from .podresources import PodResourcesClient
from .ports import GpuPods, PodLookupError
from .resources import ResourceError
from .state import NodeGpuState

log = logging.getLogger(__name__)

POD_LOOKUP_TIMEOUT_S = 5.0
"""How long a failing GPU's announcement waits to name its pods; past it, it goes out saying they are unknown."""


class DeviceService:
    name = "device"
    config_names: tuple[str, ...] = (CONFIG_DOCUMENT,)

    def __init__(
        self,
        settings: DeviceSettings | None = None,
        gpus: GpuPort | None = None,
        *,
        cluster: ClusterPort | None = None,
        pods: GpuPods | None = None,
    ) -> None:
        self.settings = settings or load()
        self.gpus = gpus
        self.cluster = cluster
        self.pods = pods
        self._opened_cluster: ClusterPort | None = None
        self._cluster_lock = asyncio.Lock()
        self.labeller: NodeLabeller | None = None
        self.cordoned = False
        self.ctx: ServiceContext | None = None
        self.gpu_state = NodeGpuState()
        """The inventory, health and XID counts its metrics collector reads (``gauges``)."""
        self.last_critical: dict[str, float] = {}
        self.clock = time.monotonic
        self.reasons: dict[str, str] = {}
        self.critical_xids: dict[str, int] = {}
        """The XID that took each unhealthy GPU out, by UUID: its DRA device taint's value."""
        self._inventory_lock = asyncio.Lock()
        self.plugin: KubeletDevicePlugin | None = None
        self.mig: MigController | None = None
        self.dra: DraDriver | None = None

    async def start(self, ctx: ServiceContext) -> None:
        """Reads the GPUs before subscribing to anything: a node whose GPUs cannot be read does not start."""
        self.ctx = ctx
        ctx.telemetry.registry.register(DeviceCollector(self.gpu_state, ctx.node))
        if self.gpus is None:
            self.gpus = ctx.backends.gpus()
            ctx.on_stop(self.gpus.close)
        gpus = self.gpus
        first = await self._read_inventory(gpus, ctx.node)
        if self.pods is None:
            socket = self.settings.pod_resources_socket
            self.pods = ctx.backends.gpu_pods(lambda: PodResourcesClient(socket))
            ctx.on_stop(self.pods.close)
        self.labeller = NodeLabeller(ctx.node, self._cluster_port)
        ctx.status["node_labels"] = self.labeller.describe
        s = ctx.subjects
        await ctx.consume(
            node_consumer(
                s, "device", "cordon", ctx.node, ("node.cordoned", "node.uncordoned"), (NodeCordoned, NodeUncordoned)
            ),
            self.on_cordon,
        )
        if self.settings.plugin_enabled:
            self.plugin = KubeletDevicePlugin(self.settings)
            ctx.status["device_plugin"] = self.plugin.describe
        if self.settings.dra_enabled:
            self.dra = DraDriver(self.settings, ctx.node, self._cluster_port)
            ctx.status["dra"] = self.dra.describe
        faults = await ctx.backends.serve_faults(gpus)
        ctx.status.update(node_cordoned=False, simulated=gpus.simulated, sim_faults=faults, unhealthy={})
        if gpus.simulated:
            log.info("GPUs are SIMULATED", extra={"gpus": len(first.gpus), "fault_injection": faults})
        await self._publish_if_changed(first)
        ctx.spawn(self.watch_health, "device-health")
        ctx.spawn(self.watch_inventory, "device-inventory")
        ctx.spawn(self.keep_labels, "device-labels")
        if self.plugin is not None:
            ctx.spawn(self.plugin.run, "device-plugin")
        if self.dra is not None:
            ctx.spawn(self.dra.run, "device-dra")
        advertisers = [a for a in (self.plugin, self.dra) if a is not None]
        self.mig = await start_mig_controller(
            ctx, self.settings, gpus, self._cluster_port, advertisers, self.refresh_inventory
        )

    async def on_cordon(self, event: NodeCordoned | NodeUncordoned) -> None:
        """Idempotent: an event only wakes it; the node as the cluster says it now sets the state, so one heard
        again, late or replayed, changes nothing. A node that cannot be read keeps the state last read (the next
        event reads again)."""
        name = self.ctx.node if self.ctx is not None and self.ctx.node else event.node  # this service's node
        try:
            node = await (await self._cluster_port()).node(name)
        except Exception as exc:
            log.warning("node unreadable; its cordon state is the last read", extra={"node": name, "error": str(exc)})
            return
        if node is None:
            return
        self.cordoned = not node.schedulable
        if self.ctx is not None:
            self.ctx.status["node_cordoned"] = self.cordoned

    async def on_health(self, event: GpuHealthEvent) -> None:
        """Publishes every XID; announces a GPU that got worse, then the inventory.

        Idempotent for health: the GPU's state changes only once its ``DeviceHealthChanged`` is published, so an
        event handled again after a failure announces what was not announced, and nothing twice. Its ``GpuXid``
        may be published twice then (at-least-once)."""
        assert self.ctx is not None
        node = self.ctx.node
        verdict = judge(event, self.gpu_state.health.get(event.uuid, "healthy"), self.settings.application_xids)
        if verdict.critical:
            self.last_critical[event.uuid] = self.clock()
        if event.kind == "xid":
            self.gpu_state.xids["true" if verdict.critical else "false"] += 1
            await self.ctx.publish(
                GpuXid(node=node, gpu_uuid=event.uuid, xid=event.xid, critical=verdict.critical, message=event.message)
            )
        if not verdict.changed:
            return
        pods, unknown = await self.pods_on(event.uuid)
        reason = verdict.reason + (f"; the pods holding it are unknown: {unknown}" if unknown else "")
        log.warning(
            "GPU unhealthy", extra={"gpu": event.uuid, "health": verdict.health, "reason": reason, "pods": pods}
        )
        await self.ctx.publish(
            DeviceHealthChanged(
                node=node,
                gpu_uuid=event.uuid,
                healthy=False,
                reason=reason,
                xid=event.xid if event.kind == "xid" else None,
                pods=pods,
            )
        )
        self.gpu_state.health[event.uuid] = verdict.health
        self.reasons[event.uuid] = verdict.reason
        if event.kind == "xid":
            self.critical_xids[event.uuid] = event.xid
        self.ctx.status["unhealthy"] = dict(self.reasons)
        try:
            await self.refresh_inventory()
        except GpuError as exc:
            log.warning("cannot read the GPUs; the inventory loop will publish", extra={"error": str(exc)})

    async def pods_on(self, uuid: str) -> tuple[list[str], str]:
        """The pods holding the GPU (from the last inventory: a lost GPU no longer answers, and NVML may name it
        only ``index:<n>``), and why they are unknown when they are."""
        assert self.pods is not None
        gpus = self.gpu_state.inventory.gpus if self.gpu_state.inventory is not None else []
        gpu = next((g for g in gpus if uuid in (g.uuid, f"index:{g.index}")), None)
        try:
            found = await asyncio.wait_for(
                self.pods.pods_using(gpu or GpuDevice(index=-1, uuid=uuid, model="")), POD_LOOKUP_TIMEOUT_S
            )
        except PodLookupError as exc:
            log.warning("cannot tell which pods hold the GPU", extra={"gpu": uuid, "error": str(exc)})
            return [], str(exc)
        except TimeoutError:
            log.warning("cannot tell which pods hold the GPU: no answer in time", extra={"gpu": uuid})
            return [], f"no answer within {POD_LOOKUP_TIMEOUT_S:g}s"
        return found, ""

    async def keep_labels(self) -> None:
        """Runs for the service's lifetime."""
        assert self.labeller is not None
        await self.labeller.run()

    async def _cluster_port(self) -> ClusterPort:
        """The service's one cluster port, for its labels and its MIG controller alike: the one it was given, or
        one opened on first use (following its own node only) and closed when the service stops; a failed open is
        tried again by the next caller."""
        if self.cluster is not None:
            return self.cluster
        assert self.ctx is not None
        async with self._cluster_lock:
            if self._opened_cluster is None:
                self._opened_cluster = await self.ctx.backends.cluster(watch_kinds=("node",), watch_node=self.ctx.node)
                self.ctx.on_stop(self._opened_cluster.close)
            return self._opened_cluster

    async def watch_health(self) -> None:
        """Runs for the service's lifetime."""
        assert self.gpus is not None
        async for event in self.gpus.health_events():
            await self.on_health(event)

    async def watch_inventory(self) -> None:
        """Level-triggered: reads the GPUs every ``inventory_s`` and re-publishes when anything changed."""
        assert self.ctx is not None
        while True:
            await self.ctx.sleep(self.settings.inventory_s)
            try:
                await self.recover_quiet_gpus()
                await self.refresh_inventory()
            except GpuError as exc:
                log.warning("cannot read the GPUs; keeping the last inventory", extra={"error": str(exc)})
                if self.ctx is not None:
                    self.ctx.status["gpu_error"] = str(exc)

    async def recover_quiet_gpus(self) -> None:
        """A GPU quiet for the recovery period is probed (still visible, the driver answers with its version)
        and, if the probe passes, offered again and announced healthy. Idempotent: a healthy GPU is left alone."""
        assert self.gpus is not None and self.ctx is not None
        now = self.clock()
        candidates = [
            uuid
            for uuid, health in self.gpu_state.health.items()
            if may_recover(health, self.last_critical.get(uuid, now), now, self.settings.recovery_s)
        ]
        if not candidates:
            return
        visible = {d.uuid for d in await self.gpus.devices()}
        versions = await self.gpus.versions()
        probe = await self.gpus.validate_driver(versions.driver)
        for uuid in candidates:
            if uuid not in visible or not probe.ok:
                log.info("GPU still unhealthy: probe failed", extra={"gpu": uuid, "reason": probe.reason})
                continue
            quiet = round(now - self.last_critical.get(uuid, now))
            reason = f"recovered: no critical XID for {quiet}s and a passing probe"
            await self.ctx.publish(DeviceHealthChanged(node=self.ctx.node, gpu_uuid=uuid, healthy=True, reason=reason))
            self.gpu_state.health[uuid] = "healthy"
            self.reasons.pop(uuid, None)
            self.critical_xids.pop(uuid, None)
            self.ctx.status["unhealthy"] = dict(self.reasons)
            log.warning("GPU healthy again", extra={"gpu": uuid, "reason": reason})

    async def refresh_inventory(self) -> None:
        """Idempotent: publishes the inventory only when it differs from the last one published."""
        assert self.gpus is not None and self.ctx is not None
        await self._publish_if_changed(await self._read_inventory(self.gpus, self.ctx.node))
        self.ctx.status.pop("gpu_error", None)

    async def _read_inventory(self, gpus: GpuPort, node: str) -> DeviceInventory:
        devices = await gpus.devices()
        versions = await gpus.versions()
        health = self.gpu_state.health
        marked = [msgspec.structs.replace(d, healthy=health.get(d.uuid, "healthy") == "healthy") for d in devices]
        return DeviceInventory(
            node=node,
            driver_version=versions.driver,
            cuda_version=versions.cuda,
            gpus=marked,
            simulated=gpus.simulated,
        )

    async def _advertise(self, inventory: DeviceInventory) -> None:
        """A layout the MIG strategy cannot describe is logged and shown in /healthz; the kubelet keeps the
        last advertisement."""
        if self.plugin is None:
            return
        try:
            await self.plugin.update(inventory.gpus, inventory.driver_version)
        except ResourceError as exc:
            log.error("cannot advertise the GPUs to the kubelet", extra={"error": str(exc)})

    async def _publish_if_changed(self, inventory: DeviceInventory) -> None:
        assert self.ctx is not None
        async with self._inventory_lock:
            last = self.gpu_state.inventory
            if last is not None and (last.driver_version, last.cuda_version, last.gpus) == (
                inventory.driver_version,
                inventory.cuda_version,
                inventory.gpus,
            ):
                return
            await self._advertise(inventory)
            if self.dra is not None:
                self.dra.want(inventory, self.gpu_state.health, self.critical_xids)
            self.ctx.status["gpus"] = [g.uuid for g in inventory.gpus]
            self.ctx.status["driver_version"] = inventory.driver_version
            await self.ctx.publish(inventory)
            self.gpu_state.inventory = inventory
            if self.labeller is not None:
                self.labeller.want(node_labels(inventory, self.settings.plugin_config.mig_strategy))
